"""Rule for MatMul: a dense layer Z = A W (or A W^T with transpose_b).

Identity (Goodfellow 2015, "Efficient per-example gradient computations",
arXiv 1510.01799): with A [B*k, d] and dZ [B*k, n] (k rows per example, e.g. the
Tensordot form of a Dense layer on [B, k, d]),
    grad_i(W) = sum_t a_it ⊗ dz_it                       [d, n]
and its squared norm is ||a_i||^2 ||dz_i||^2 for k = 1, or the ghost norm
sum_{t,s} (a_it·a_is)(dz_it·dz_is) (Li et al. 2021, arXiv 2110.05679) for k > 1.
For k = 1 the elementwise sum of squares is sum_i grad_i(W)^2 = (A⊙A)^T (dZ⊙dZ)
(BackPACK's SumGradSquared, Dangel et al. 2020, arXiv 1912.10985).
The clipped sum sum_i f_i grad_i(W) = A^T (f ⊙ dZ), the batch gradient with example
i's rows of dZ scaled by f_i (the book-keeping of Bu et al. 2023, arXiv 2210.00038).

Covered: the weight on the right (input 1), transpose_b either way, the activation not
transposed. A weight on the left (W A) has no rows per example and falls back.
"""

import tensorflow as tf

from pertower._layout import _rows
from pertower._layout import _shapes
from pertower.rules import registry as registry_lib

__all__ = ["MUL_MIN_COLUMNS", "MatMulRule", "outer_products", "right_operand_reason",
           "register"]

# outer products whose last axis is at least this long are one broadcast Mul
# (`outer_products`), shorter ones one Einsum
MUL_MIN_COLUMNS = 1024


class MatMulRule(registry_lib.Rule):
    """Z = A W or A W^T: per-example outer products."""

    def match(self, op, slot, analysis):
        return right_operand_reason(op, slot, "transpose_a") or self.example_use(
            op, slot, analysis)

    def per_group(self, use, dZ, G):
        # [G*k, d], [G*k, n] -> [G, k, d], [G, k, n] -> [G, d, n] (or [G, n, d] when W
        # is stored transposed): sum over each group's rows of a ⊗ dz
        A = use.activation
        if _shapes.rows_are_groups(A, G, use.rows.k):    # one row per group
            return outer_products(A, dZ, use.op.get_attr("transpose_b"))
        A_g = _shapes.to_groups(A, G, use.rows.k, 1)
        dZ_g = _shapes.to_groups(dZ, G, use.rows.k, 1)
        if use.op.get_attr("transpose_b"):
            return tf.einsum("gtn,gtd->gnd", dZ_g, A_g)
        return tf.einsum("gtd,gtn->gdn", A_g, dZ_g)

    def squared_norms(self, use, dZ, B):
        d, n = use.weight_shape.as_list()
        if use.rows.k != 1 and not _rows.ghost_norm_is_cheaper(use.rows.k, d, n):
            return None
        return _rows.dense_squared_norms(use.activation, dZ, B, use.rows.k)

    def sum_squared(self, use, dZ_columns, B, per_example=False):
        # k = 1: grad_{i,c} = a_i ⊗ dz_ic, so sum_c grad_{i,c}^2 = a_i^2 ⊗ sum_c dz_ic^2
        # and its sum over i is (A⊙A)^T sum_c (dZ_c⊙dZ_c) (Dangel et al. 2020, BackPACK,
        # arXiv 1912.10985): no [B, d, n] unless asked per example
        if use.rows.k != 1:
            return None
        A2 = tf.square(use.activation)                                   # [B, d]
        dZ2 = tf.reduce_sum(tf.square(dZ_columns), axis=0)               # [C, B, n] -> [B, n]
        transposed = use.op.get_attr("transpose_b")
        if per_example:
            return _rows.dense_per_group(A2, dZ2, B, transposed)         # [B, d, n] / [B, n, d]
        if transposed:
            return tf.matmul(dZ2, A2, transpose_a=True)                  # [n, d]
        return tf.matmul(A2, dZ2, transpose_a=True)                      # [d, n]

    def sum_squared_size(self, use, C, per_example=False):
        # numbers per example `sum_squared` holds: only the [B, d, n] result per example
        return None if use.rows.k != 1 else (use.weight_shape.num_elements() * per_example)

    def clipped_sum(self, use, dZ, factors):
        # sum_i f_i grad_i(W) = A^T (f ⊙ dZ): the batch gradient with dZ's rows scaled
        scaled = _rows.scale_rows(dZ, factors)                    # [B*k, n]
        if use.op.get_attr("transpose_b"):
            return tf.matmul(scaled, use.activation, transpose_a=True)   # [n, d]
        return tf.matmul(use.activation, scaled, transpose_a=True)       # [d, n]

    def kfac_rows(self, use):
        # Z = A W: the GGN block of W is approximated by kron(A^T A / B, dZ^T dZ)
        return use.activation if use.op.type == "MatMul" else None       # [R, d]


def right_operand_reason(op, slot, transposed_attr):
    """Why a product's weight is not covered (it must be the right operand and the
    batch-side input not transposed, attribute `transposed_attr`), or None."""
    if slot != 1:
        return f"the weight is the left operand of {op.type} (rows are not examples)"
    if op.get_attr(transposed_attr):
        return f"{op.type} transposes (or takes the adjoint of) its batch-side input"
    return None


def outer_products(A, dZ, transposed):
    """[B, d], [B, n] -> [B, d, n] (or [B, n, d] when `transposed`): a_i ⊗ dz_i per row,
    written once in its final layout. With a long last axis (at least
    `MUL_MIN_COLUMNS`, static) by ONE broadcast `Mul` of the rows seen as a column and a
    row ([B, d, 1] * [B, 1, n]): a product with no sum runs as a streaming write, where
    a BatchMatMul or Einsum with a contraction of length 1 goes through the matmul
    kernel's packing for nothing. With a short last axis the broadcast runs slowly and
    ONE Einsum is used (timings: docs/benchmark.md, "Measurements moved from
    docstrings")."""
    if transposed:
        A, dZ = dZ, A
    columns = tf.compat.dimension_value(dZ.shape[-1])
    if columns is None or columns < MUL_MIN_COLUMNS:
        return tf.einsum("gd,gn->gdn", A, dZ)
    return tf.expand_dims(A, _shapes.constant(2)) * tf.expand_dims(dZ, _shapes.constant(1))


def register(registry):
    """Adds the MatMul rule to `registry`."""
    registry.register("MatMul", MatMulRule())

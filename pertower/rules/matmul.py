"""Rule for the matrix products with a weight on the right: MatMul, SparseMatMul (the
same product; tf_keras' LocallyConnected implementation=2) and BatchMatMul(V2/V3) with
a weight matrix.

Identity (Goodfellow 2015, arXiv 1510.01799): with A [B*k, ..., d] and dZ [B*k, ..., n],
each row r of the last two axes is one use of W [d, n]; with T = k * prod(middle axes)
rows per example
    grad_i(W) = sum over example i's rows r of a_r ⊗ dz_r                    [d, n],
its squared norm ||a_i||^2 ||dz_i||^2 for T = 1, else the ghost norm
sum_{r,s} (a_r·a_s)(dz_r·dz_s) (Li et al. 2021, arXiv 2110.05679). For T = 1,
sum_i grad_i(W)^2 = (A⊙A)^T (dZ⊙dZ) (BackPACK's SumGradSquared, Dangel et al. 2020,
arXiv 1912.10985). The clipped sum sum_i f_i grad_i(W) = A^T (f ⊙ dZ) (Bu et al. 2023,
arXiv 2210.00038).

Covered: the weight as the right operand (rank 2, or leading axes of size 1 for
BatchMatMul), transposed or adjoint either way; the activation not transposed.
"""

import tensorflow as tf

from pertower import _op_types as op_types
from pertower._layout import _rows
from pertower._layout import _shapes
from pertower.rules import registry as registry_lib

__all__ = ["MUL_MIN_COLUMNS", "MatMulRule", "outer_products", "right_operand_reason",
           "register"]

# outer products whose last axis is at least this long are one broadcast Mul
# (`outer_products`), shorter ones one Einsum
MUL_MIN_COLUMNS = 1024


def _transposes(op):
    """(the attribute transposing the activation, the one transposing the weight)."""
    if op.type in op_types.BATCH_MATMUL_OP_TYPES:
        return "adj_x", "adj_y"
    return "transpose_a", "transpose_b"


class MatMulRule(registry_lib.Rule):
    """Z = A W or A W^T: per-example sums of outer products."""

    def match(self, op, slot, analysis):
        reason = right_operand_reason(op, slot, _transposes(op)[0])
        if reason:
            return reason
        w_shape = op.inputs[1].shape
        if op.type in op_types.BATCH_MATMUL_OP_TYPES and (
                w_shape.rank is None or w_shape.rank < 2 or not w_shape.is_fully_defined()
                or any(d != 1 for d in w_shape.as_list()[:-2])):
            return f"the weight of BatchMatMul has shape {w_shape}; only matrices are covered"
        return self.example_use(op, slot, analysis)

    def per_group(self, use, dZ, G):
        # [G*T, ..., d], [G*T, ..., n] -> [G, T', d], [G, T', n] -> [G, d, n] (or
        # [G, n, d] when W is stored transposed): sum over each group's rows of a ⊗ dz
        A, transposed = use.activation, use.op.get_attr(_transposes(use.op)[1])
        if A.shape.rank == 2 and _shapes.rows_are_groups(A, G, use.rows.k):
            return outer_products(A, dZ, transposed)          # one row per group
        A_g = _shapes.to_groups(A, G, use.rows.k, 1)
        dZ_g = _shapes.to_groups(dZ, G, use.rows.k, 1)
        if transposed:
            grad = tf.einsum("gtn,gtd->gnd", dZ_g, A_g)
        else:
            grad = tf.einsum("gtd,gtn->gdn", A_g, dZ_g)
        if use.weight_shape.rank == 2:
            return grad
        return tf.reshape(grad, _rows.group_shape(G, use.weight_shape.as_list()))

    def squared_norms(self, use, dZ, B):
        d, n = use.weight_shape.as_list()[-2:]
        middle = use.activation.shape[1:-1].num_elements()
        rows = None if None in (middle, use.rows.k) else use.rows.k * middle   # T
        if rows != 1 and not _rows.ghost_norm_is_cheaper(rows, d, n):
            return None
        return _rows.dense_squared_norms(use.activation, dZ, B, rows)

    def sum_squared(self, use, dZ_columns, B, per_example=False):
        # T = 1: grad_{i,c} = a_i ⊗ dz_ic, so sum_c grad_{i,c}^2 = a_i^2 ⊗ sum_c dz_ic^2
        # and its sum over i is (A⊙A)^T sum_c (dZ_c⊙dZ_c): no [B, d, n] unless asked
        if use.rows.k != 1 or use.activation.shape.rank != 2:
            return None
        A2 = tf.square(use.activation)                                   # [B, d]
        dZ2 = tf.reduce_sum(tf.square(dZ_columns), axis=0)               # [C, B, n] -> [B, n]
        transposed = use.op.get_attr(_transposes(use.op)[1])
        if per_example:
            return outer_products(A2, dZ2, transposed)                   # [B, d, n] / [B, n, d]
        if transposed:
            return tf.matmul(dZ2, A2, transpose_a=True)                  # [n, d]
        return tf.matmul(A2, dZ2, transpose_a=True)                      # [d, n]

    def sum_squared_size(self, use, C, per_example=False):
        # numbers per example `sum_squared` holds: only the [B, d, n] result per example
        if use.rows.k != 1 or use.activation.shape.rank != 2:
            return None
        return use.weight_shape.num_elements() * per_example

    def clipped_sum(self, use, dZ, factors):
        # sum_i f_i grad_i(W) = A^T (f ⊙ dZ): the batch gradient with dZ's rows scaled
        if use.activation.shape.rank != 2:
            return registry_lib.batch_gradient_clipped_sum(self, use, dZ, factors)
        scaled = _rows.scale_rows(dZ, factors)                           # [B*k, n]
        if use.op.get_attr(_transposes(use.op)[1]):
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
    `MUL_MIN_COLUMNS`, static) ONE broadcast `Mul`, [B, d, 1] * [B, 1, n] (a product
    with no sum streams, where a matmul with a contraction of length 1 packs for
    nothing); with a short one ONE Einsum (timings: docs/benchmark.md)."""
    if transposed:
        A, dZ = dZ, A
    columns = tf.compat.dimension_value(dZ.shape[-1])
    if columns is None or columns < MUL_MIN_COLUMNS:
        return tf.einsum("gd,gn->gdn", A, dZ)
    return tf.expand_dims(A, _shapes.constant(2)) * tf.expand_dims(dZ, _shapes.constant(1))


def register(registry):
    """Adds the rule to `registry` for MatMul, SparseMatMul and every BatchMatMul."""
    registry_lib.register_each(registry, {"MatMul", "SparseMatMul"}
                               | op_types.BATCH_MATMUL_OP_TYPES, MatMulRule())

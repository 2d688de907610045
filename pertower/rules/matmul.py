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
BatchMatMul), transposed or adjoint either way; the activation not transposed. The
weight as the LEFT operand of a 2-D MatMul (Z = W x^T, [n, B*k], e.g. in a recurrent
body) is the same product seen transposed: with W' = op_a(W) and X' = op_b(x) (each
transposed as its attribute says), Z^T = X'^T W'^T, so A = X'^T [B*k, d], dZ^T
[B*k, n], and W'^T is the right operand (`_right_operand_view`).
"""

import tensorflow as tf

from pertower import _op_types as op_types
from pertower._batch_axis import Rows
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


def _right_operand_view(use, dZ):
    """(A [B*k, ..., d], dZ [B*k, ..., n], whether W is stored as [n, d]) of `use` as a
    product with the weight on the right: the op's own for a right operand; for a left
    one (2-D), Z = W' X' read as Z^T = X'^T W'^T (the module docstring)."""
    op = use.op
    if use.slot == 1:
        return use.activation, dZ, op.get_attr(_transposes(op)[1])
    A = use.activation if op.get_attr("transpose_b") else tf.transpose(use.activation)
    return A, None if dZ is None else tf.transpose(dZ), not op.get_attr("transpose_a")


def _left_operand_use(rule, op, analysis):
    """The `Use` of the weight at input 0 of a 2-D MatMul whose input 1 x, [B*k, d]
    (transpose_b) or [d, B*k], gives Z [n, B*k] example-major along axis 1; else why not."""
    x, lead = op.inputs[1], 0 if op.get_attr("transpose_b") else 1
    rows, out = analysis.value(x), analysis.value(op.outputs[0])    # (not row layouts)
    if not isinstance(rows, Rows) or rows.lead != lead or rows.k is None:
        return (f"the weight is the left operand of {op.type} and the rows of its right "
                f"operand {x.name} could not be traced to examples along axis {lead}")
    if not isinstance(out, Rows) or out.lead != 1 or out.k != rows.k:
        return (f"the weight is the left operand of {op.type} and the columns of its output "
                f"{op.outputs[0].name} could not be traced to examples")
    return registry_lib.Use(op, 0, rule, x, op.outputs[0], op.inputs[0].shape, rows)


class MatMulRule(registry_lib.Rule):
    """Z = A W or A W^T (or W x^T, seen transposed): per-example sums of outer products."""

    def match(self, op, slot, analysis):
        if slot == 0 and op.type in ("MatMul", "SparseMatMul"):
            return _left_operand_use(self, op, analysis)
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
        A, dZ, transposed = _right_operand_view(use, dZ)
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
        A, dZ, _ = _right_operand_view(use, dZ)
        d, n = use.weight_shape.as_list()[-2:]
        middle = A.shape[1:-1].num_elements()
        rows = None if None in (middle, use.rows.k) else use.rows.k * middle   # T
        if rows != 1 and not _rows.ghost_norm_is_cheaper(rows, d, n):
            return None
        return _rows.dense_squared_norms(A, dZ, B, rows)

    def sum_squared(self, use, dZ_columns, B, per_example=False):
        # T = 1: grad_{i,c} = a_i ⊗ dz_ic, so sum_c grad_{i,c}^2 = a_i^2 ⊗ sum_c dz_ic^2
        # and its sum over i is (A⊙A)^T sum_c (dZ_c⊙dZ_c): no [B, d, n] unless asked
        if use.rows.k != 1 or use.activation.shape.rank != 2 or use.slot == 0:
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
        if use.rows.k != 1 or use.activation.shape.rank != 2 or use.slot == 0:
            return None
        return use.weight_shape.num_elements() * per_example

    def clipped_sum(self, use, dZ, factors):
        # sum_i f_i grad_i(W) = A^T (f ⊙ dZ): the batch gradient with dZ's rows scaled
        if use.activation.shape.rank != 2:
            return registry_lib.batch_gradient_clipped_sum(self, use, dZ, factors)
        A, dZ, transposed = _right_operand_view(use, dZ)                 # [B*k, d], [B*k, n]
        scaled = _rows.scale_rows(dZ, factors)                           # [B*k, n]
        if transposed:
            return tf.matmul(scaled, A, transpose_a=True)                # [n, d]
        return tf.matmul(A, scaled, transpose_a=True)                    # [d, n]

    def kfac_rows(self, use):
        # Z = A W: the GGN block of W is approximated by kron(A^T A / B, dZ^T dZ)
        if use.slot == 0:
            return (f"the weight is the left operand of {use.op.name!r} (MatMul), whose output "
                    "gradient's rows are not examples; Kronecker factors are built for the "
                    "right operand")
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

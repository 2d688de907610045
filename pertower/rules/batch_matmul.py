"""Rule for BatchMatMul(V2/V3) with a weight matrix: Z = A W on [B, ..., T, d] inputs.

Identity (Goodfellow 2015, arXiv 1510.01799, with the sequence axis summed): W [d, n]
broadcast over the leading axes, A [B*k, ..., T, d], dZ [B*k, ..., T, n]; every row of
the last two axes is one use of W, so
    grad_i(W) = sum over example i's rows r of a_r ⊗ dz_r          [d, n]
and the ghost norm of Li et al. 2021 (arXiv 2110.05679) gives its squared norm.

Covered: the weight as the right operand, rank 2 (or leading axes of size 1), adj_y
either way; the activation not adjoint.
"""

import tensorflow as tf

from pertower import _op_types as op_types
from pertower._layout import _rows
from pertower.rules import matmul
from pertower.rules import registry as registry_lib


class BatchMatMulRule(registry_lib.Rule):
    """Z = A W with W shared by every row: per-example sums of outer products."""

    def match(self, op, slot, analysis):
        reason = matmul.right_operand_reason(op, slot, "adj_x")
        if reason:
            return reason
        w_shape = op.inputs[1].shape
        if w_shape.rank is None or w_shape.rank < 2 or not w_shape.is_fully_defined() or any(
                d != 1 for d in w_shape.as_list()[:-2]):
            return f"the weight of BatchMatMul has shape {w_shape}; only matrices are covered"
        return self.example_use(op, slot, analysis)

    def _rows_per_example(self, use):
        """Rows of the product per example: k times the middle axes of A."""
        middle = _rows.static_size(use.activation.shape[1:-1])
        return None if middle is None else use.rows.k * middle

    def per_group(self, use, dZ, G):
        grad = _rows.dense_per_group(use.activation, dZ, G, use.op.get_attr("adj_y"))
        # [G, d, n] -> [G, *w.shape]
        return tf.reshape(grad, _rows.group_shape(G, use.weight_shape.as_list()))

    def squared_norms(self, use, dZ, B):
        d, n = use.weight_shape.as_list()[-2:]
        rows = self._rows_per_example(use)
        if rows != 1 and not _rows.ghost_norm_is_cheaper(rows, d, n):
            return None
        return _rows.dense_squared_norms(use.activation, dZ, B, rows)

    # sum_i f_i grad_i(w): the one-group (batch) gradient of dZ scaled per example
    clipped_sum = registry_lib.batch_gradient_clipped_sum


def register(registry):
    """Adds the rule to `registry` for every BatchMatMul version."""
    registry_lib.register_each(registry, op_types.BATCH_MATMUL_OP_TYPES, BatchMatMulRule())

"""Rule for embedding lookups: GatherV2(W, ids, axis=0) and ResourceGather(handle, ids).

Identity: Z = W[ids] copies rows, so the gradient of example i scatters its rows of dZ
back to the rows of W they came from, adding the rows of repeated ids:
    grad_i(W)[v] = sum over example i's positions t with ids_it = v of dz_it,
the dense [B, V, *W.shape[1:]] of pertower's contract (one unsorted segment sum with
segment g*V + id). Its squared norm is sum_{t,s} [ids_it = ids_is] (dz_it · dz_is)
(the ghost norm of Li et al. 2021, arXiv 2110.05679, with an indicator for the
activation Gram matrix), used when an example has few ids.

Covered: axis 0, batch_dims 0, the table's shape static.
"""

import tensorflow as tf

from pertower import _batch_axis
from pertower._layout import _rows
from pertower.rules import registry as registry_lib


class GatherRule(registry_lib.Rule):
    """Per-example scatter-adds of dZ rows into the table's rows."""

    def match(self, op, slot, analysis):
        if slot != 0:
            return "the weight holds the ids of the gather, not its table"
        if "batch_dims" in op.node_def.attr and op.get_attr("batch_dims"):
            return "gather with batch_dims"
        if op.type == "GatherV2":
            axis = _batch_axis.static_value(op.inputs[2])
            if axis is None or int(axis) != 0:
                return "gather along an axis other than 0"
            w_shape = op.inputs[0].shape
        else:
            w_shape = None  # the variable's shape, filled in by the caller
        rows = _rows.example_rows(analysis, op.inputs[1], op.outputs[0])
        if isinstance(rows, str):
            return rows
        return registry_lib.Use(op, slot, self, op.inputs[1], op.outputs[0], w_shape, rows)

    def per_group(self, use, dZ, G):
        V = use.weight_shape.as_list()[0]
        row_shape = use.weight_shape.as_list()[1:]
        D = _rows.static_size(use.weight_shape[1:])
        ids = tf.reshape(tf.cast(use.activation, tf.int64), _rows.group_shape(G, [-1]))  # [G, L]
        groups = tf.shape(ids, out_type=tf.int64)[0]
        segments = tf.range(groups)[:, None] * V + ids                  # [G, L]
        rows = tf.reshape(dZ, [-1, D])                                    # [G*L, D]
        dense = tf.math.unsorted_segment_sum(rows, tf.reshape(segments, [-1]), groups * V)
        return tf.reshape(dense, _rows.group_shape(G, [V] + row_shape))  # [G, V, *row]

    def squared_norms(self, use, dZ, B):
        if not isinstance(use.rows, _batch_axis.Rows):   # a subclass's own row kinds
            return None
        V = use.weight_shape.as_list()[0]
        D = _rows.static_size(use.weight_shape[1:])
        L = _rows.static_size(use.activation.shape[1:])
        if L is None or L * use.rows.k * L * use.rows.k > V * D:
            return None
        ids = tf.reshape(use.activation, _rows.group_shape(B, [-1]))     # [B, L]
        dZ_g = tf.reshape(dZ, _rows.group_shape(B, [-1, D]))              # [B, L, D]
        same = tf.cast(tf.equal(ids[:, :, None], ids[:, None, :]), dZ.dtype)  # [B, L, L]
        gram = tf.einsum("btd,bsd->bts", dZ_g, dZ_g)                      # [B, L, L]
        return tf.reduce_sum(same * gram, axis=[1, 2])                    # [B]

    # sum_i f_i grad_i(w): the one-group (batch) gradient of dZ scaled per example
    clipped_sum = registry_lib.batch_gradient_clipped_sum


def register(registry):
    """Adds the gather rules to `registry`."""
    registry_lib.register_each(registry, ("GatherV2", "ResourceGather"), GatherRule())

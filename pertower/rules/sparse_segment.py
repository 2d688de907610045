"""Rule for a table read by SparseSegmentSum/Mean/SqrtN(table, ids, segment_ids) whose
segments are the batch's examples (tf.sparse.from_dense of the batch's ids, looked up by
tf.compat.v1.nn.embedding_lookup_sparse; proof in `_batch_axis.transfer_lookups`).

Identity: row s of Z is c_s sum_{j: seg_j = s} W[ids_j] with c_s = 1 (sum), 1/n_s
(mean) or 1/sqrt(n_s) (sqrtN), n_s the entries of segment s = example s, so
    grad_i(W)[v] = c_i sum over entries j of example i with ids_j = v of dz_i
(Goodfellow 2015, arXiv 1510.01799): one unsorted segment sum of the rows c_i dz_i
with segment g*V + ids_j for example i's group g = i // (B/G).
"""

import tensorflow as tf

from pertower._batch_axis import transfer_lookups
from pertower._layout import _rows
from pertower.rules import registry as registry_lib

__all__ = ["SparseSegmentRule", "scatter", "segment_rows", "register"]


def segment_rows(dZ, segments, groups, G, weight_shape):
    """[G, V, *row]: the rows of dZ [n, *row] added at `segments` [n] (group * V + id),
    `groups` the number of groups as an int64 tensor."""
    V = weight_shape.as_list()[0]
    D = weight_shape[1:].num_elements()
    dense = tf.math.unsorted_segment_sum(tf.reshape(dZ, [-1, D]), segments,
                                         groups * V)                        # [G*V, D]
    return tf.reshape(dense, _rows.group_shape(G, weight_shape.as_list()))  # [G, V, *row]


def scatter(segment_op, ids, weight_shape, dZ, G):
    """[G, V, *row]: each example's output gradient dZ [B, *row] of `segment_op`, scaled
    by c_i, scattered into the rows of its entries' ids [m] (see the module)."""
    V = weight_shape.as_list()[0]
    D = weight_shape[1:].num_elements()
    segments = tf.cast(segment_op.inputs[2], tf.int64)                     # [m]
    rows = tf.reshape(dZ, [-1, D])                                         # [B', D]
    B = tf.shape(rows, out_type=tf.int64)[0]
    if segment_op.type != "SparseSegmentSum":
        counts = tf.math.unsorted_segment_sum(tf.ones_like(segments, rows.dtype),
                                              segments, B)                 # [B]
        counts = tf.maximum(counts, 1)
        scale = 1 / counts if segment_op.type == "SparseSegmentMean" else tf.math.rsqrt(counts)
        rows = rows * scale[:, None]
    # the batch's B (dZ has B' <= B rows: none after the last example with an id)
    examples = tf.shape(transfer_lookups.sparse_lookup(segment_op)[1], out_type=tf.int64)[0]
    groups = segments // tf.maximum(examples // tf.cast(G, tf.int64), 1)   # [m]
    return segment_rows(tf.gather(rows, segments), groups * V + tf.cast(ids, tf.int64),
                        tf.cast(G, tf.int64), G, weight_shape)


class SparseSegmentRule(registry_lib.Rule):
    """Per-example scatter-adds of each example's output gradient into its ids' rows."""

    def match(self, op, slot, analysis):
        if slot != 0:
            return "the weight holds the ids or segment ids, not the table"
        if transfer_lookups.sparse_lookup(op) is None:
            return ("its segments are not the entries of a SparseTensor built from the "
                    "batch's dense ids (tf.sparse.from_dense)")
        rows = analysis.rows(op.outputs[0])
        if rows is None or rows.lead != 0 or rows.k != 1:
            return f"the rows of its output {op.outputs[0].name} could not be traced to examples"
        if not op.inputs[0].shape[1:].is_fully_defined():
            return "the table's row shape is not static"
        return registry_lib.Use(op, slot, self, op.inputs[1], op.outputs[0],
                                op.inputs[0].shape, rows)

    def per_group(self, use, dZ, G):
        return scatter(use.op, use.op.inputs[1], use.weight_shape, dZ, G)

    # sum_i f_i grad_i(W): the one-group gradient of dZ's rows scaled per example
    clipped_sum = registry_lib.batch_gradient_clipped_sum


def register(registry):
    """Adds the sparse segment rule to `registry`."""
    registry_lib.register_each(registry, transfer_lookups.SPARSE_SEGMENT_OP_TYPES,
                               SparseSegmentRule())

"""Rule for a table read by SparseSegmentSum/Mean/SqrtN(table, ids, segment_ids) whose
segments are the batch's examples (a SparseTensor built from the batch's dense ids with
tf.sparse.from_dense, looked up by tf.compat.v1.nn.embedding_lookup_sparse; the pattern
and its proof are in `pertower._batch_axis.transfer_lookups`).

Identity: row s of Z is c_s sum_{j: seg_j = s} W[ids_j] with c_s = 1 (sum), 1/n_s (mean)
or 1/sqrt(n_s) (sqrtN), n_s the entries of segment s, and segment s is example s. So

    grad_i(W)[v] = c_i sum over entries j of example i with ids_j = v of dz_i,

the batch gradient's terms of example i (Goodfellow 2015, arXiv 1510.01799): one
unsorted segment sum of the rows c_i dz_i, one per entry, with segment g*V + ids_j for
example i's group g = i // (B/G).
"""

import tensorflow as tf

from pertower._batch_axis import transfer_lookups
from pertower.rules import _rows
from pertower.rules import partitioned_gather
from pertower.rules import registry as registry_lib

__all__ = ["SparseSegmentRule", "UniqueGatherRule", "register"]


def _scatter(segment_op, ids, weight_shape, dZ, G):
    """[G, V, *row]: each example's output gradient dZ [B, *row] of `segment_op`, scaled
    by c_i, scattered into the rows of its entries' ids [m] (see the module)."""
    V = weight_shape.as_list()[0]
    row_shape = weight_shape.as_list()[1:]
    D = _rows.static_size(weight_shape[1:])
    ids = tf.cast(ids, tf.int64)                                           # [m]
    segments = tf.cast(segment_op.inputs[2], tf.int64)                     # [m]
    rows = tf.reshape(dZ, [-1, D])                                         # [B', D]
    B = tf.shape(rows, out_type=tf.int64)[0]
    if segment_op.type != "SparseSegmentSum":
        counts = tf.math.unsorted_segment_sum(tf.ones_like(segments, rows.dtype),
                                              segments, B)                 # [B]
        counts = tf.maximum(counts, 1)
        scale = 1 / counts if segment_op.type == "SparseSegmentMean" else tf.math.rsqrt(counts)
        rows = rows * scale[:, None]
    entries = tf.gather(rows, segments)                                    # [m, D]
    # the batch's B (dZ has B' <= B rows: none after the last example with an id)
    examples = tf.shape(transfer_lookups.sparse_lookup(segment_op)[1], out_type=tf.int64)[0]
    groups = segments // tf.maximum(examples // tf.cast(G, tf.int64), 1)   # [m]
    dense = tf.math.unsorted_segment_sum(entries, groups * V + ids,
                                         tf.cast(G, tf.int64) * V)         # [G*V, D]
    return tf.reshape(dense, _rows.group_shape(G, [V] + row_shape))       # [G, V, *row]


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
        return _scatter(use.op, use.op.inputs[1], use.weight_shape, dZ, G)

    # sum_i f_i grad_i(W): the one-group gradient of dZ's rows scaled per example
    clipped_sum = registry_lib.batch_gradient_clipped_sum


class _UniqueLookup:
    """A table's gather by unique ids u, Unique(ids) = (u, idx), whose rows a
    SparseSegment op combines by idx: the rule reads that op's output gradient."""

    def __init__(self, segment_op):
        self.segment_op = segment_op


class UniqueGatherRule(partitioned_gather.PartitionedGatherRule):
    """The gather rules, and for a table gathered by the unique ids of a sparse lookup
    (TensorFlow's embedding_lookup_sparse on a resource table) the sparse segment rule,
    read at the lookup's output (the gathered rows are shared by the examples)."""

    def match(self, op, slot, analysis):
        segment_op = _unique_lookup(op, analysis) if slot == 0 else None
        if segment_op is None:
            return super().match(op, slot, analysis)
        w_shape = op.inputs[0].shape if op.type != "ResourceGather" else None
        ids = op.inputs[1].op.inputs[0]   # Unique's input: the entries' ids [m]
        return registry_lib.Use(op, slot, self, ids, segment_op.outputs[0], w_shape,
                                _UniqueLookup(segment_op))

    def per_group(self, use, dZ, G):
        if not isinstance(use.rows, _UniqueLookup):
            return super().per_group(use, dZ, G)
        return _scatter(use.rows.segment_op, use.activation, use.weight_shape, dZ, G)

    # squared norms: the gather's ghost norm, for a gather's `Rows` only; clipped sum:
    # the batch gradient of dZ scaled per example, through `per_group`, for both


def _unique_lookup(op, analysis):
    """The SparseSegment op that alone reads the gather `op` of unique ids (through
    Identity ops) when the analysis proved its rows; else None."""
    consumers, tensor = list(op.outputs[0].consumers()), op.outputs[0]
    while len(consumers) == 1 and consumers[0].type == "Identity":
        tensor = consumers[0].outputs[0]
        consumers = list(tensor.consumers())
    if len(consumers) != 1 or consumers[0].type not in transfer_lookups.SPARSE_SEGMENT_OP_TYPES:
        return None
    segment_op = consumers[0]
    found = transfer_lookups.sparse_lookup(segment_op)
    rows = analysis.rows(segment_op.outputs[0])
    if (found is None or found[3] is not op or segment_op.inputs[0] is not tensor
            or rows is None or rows.lead != 0 or rows.k != 1):
        return None
    return segment_op


def register(registry):
    """Adds the sparse segment rules to `registry` (and the gather rules, which the
    unique-ids case extends)."""
    registry_lib.register_each(registry, transfer_lookups.SPARSE_SEGMENT_OP_TYPES,
                               SparseSegmentRule())
    registry_lib.register_each(registry, ("GatherV2", "ResourceGather"), UniqueGatherRule())

"""Rule for embedding lookups by the batch's ids: GatherV2(W, ids, axis=0) and
ResourceGather(handle, ids) (ids the same for one example alone, as a position table's
`tf.range(T)`, make the gather a function of the weight: `_weight_functions`).

Identity: Z = W[ids] copies rows, so example i's gradient scatters its rows of dZ back
to the rows of W they came from, adding repeated ids (Goodfellow 2015, arXiv 1510.01799):
    grad_i(W)[v] = sum over example i's rows t with ids_t = v of dz_t,
the dense [G, V, *W.shape[1:]] as one unsorted segment sum with segment g*V + id for
group g = i // (B/G). Its squared norm is sum_{t,s} [ids_it = ids_is] (dz_it · dz_is)
(the ghost norm of Li et al. 2021, arXiv 2110.05679), used when an example has few ids.

Which example a gathered row belongs to:
    ids of the batch      k rows per example (the analysis' `Rows`).
    a partitioned table   part p's ids are partition p of a DynamicPartition of the
                          batch's n = B*k ids, stitched back by DynamicStitch
                          (`_batch_axis.transfer_lookups`): row j of part p is flat
                          row positions_p[j] = DynamicPartition(range(n), P)[p][j].
    unique ids            Unique(ids) = (u, idx), whose rows a SparseSegment op combines
                          by idx (embedding_lookup_sparse on a resource table):
                          `rules.sparse_segment`'s scatter at that op's output.

Covered: axis 0, batch_dims 0, the table's shape static.
"""

import dataclasses

import tensorflow as tf

from pertower import _batch_axis
from pertower._batch_axis import transfer_lookups
from pertower._layout import _rows
from pertower.rules import registry as registry_lib
from pertower.rules import sparse_segment

__all__ = ["GatherRule", "register"]


@dataclasses.dataclass(eq=False)
class _Partition:
    """The rows of a partitioned table's part: the flat rows its rows came from [n_p],
    the range(n) they index (n = B*k flat ids) and k."""
    positions: tf.Tensor
    flat_range: tf.Tensor
    k: int


@dataclasses.dataclass(eq=False)
class _UniqueLookup:
    """The rows of a gather by unique ids: the SparseSegment op that combines them."""
    segment_op: tf.Operation


class GatherRule(registry_lib.Rule):
    """Per-example scatter-adds of dZ rows into the table's rows."""

    def match(self, op, slot, analysis):
        if slot != 0:
            return "the weight holds the ids of the gather, not its table"
        w_shape = op.inputs[0].shape if op.type != "ResourceGather" else None
        partition = _partition_of(op, analysis)
        if partition is not None:
            return registry_lib.Use(op, slot, self, op.inputs[1], op.outputs[0], w_shape,
                                    partition)
        segment_op = _unique_lookup(op, analysis)
        if segment_op is not None:
            ids = op.inputs[1].op.inputs[0]   # Unique's input: the entries' ids [m]
            return registry_lib.Use(op, slot, self, ids, segment_op.outputs[0], w_shape,
                                    _UniqueLookup(segment_op))
        if "batch_dims" in op.node_def.attr and op.get_attr("batch_dims"):
            return "gather with batch_dims"
        if op.type == "GatherV2":
            axis = _batch_axis.static_value(op.inputs[2])
            if axis is None or int(axis) != 0:
                return "gather along an axis other than 0"
        rows = _rows.example_rows(analysis, op.inputs[1], op.outputs[0])
        if isinstance(rows, str):
            return rows
        return registry_lib.Use(op, slot, self, op.inputs[1], op.outputs[0], w_shape, rows)

    def per_group(self, use, dZ, G):
        if isinstance(use.rows, _UniqueLookup):
            return sparse_segment.scatter(use.rows.segment_op, use.activation,
                                          use.weight_shape, dZ, G)
        V = use.weight_shape.as_list()[0]
        if isinstance(use.rows, _Partition):
            part = use.rows
            examples = tf.cast(part.positions // part.k, tf.int64)          # [n_p]
            count = tf.size(part.flat_range, out_type=tf.int64)              # n = B*k
            per_group = count // part.k // tf.cast(G, tf.int64)
            groups = examples // tf.maximum(per_group, 1)                     # [n_p]
            segments = groups * V + tf.cast(use.activation, tf.int64)        # [n_p]
            return sparse_segment.segment_rows(dZ, segments, tf.cast(G, tf.int64), G,
                                                use.weight_shape)
        ids = tf.reshape(tf.cast(use.activation, tf.int64), _rows.group_shape(G, [-1]))  # [G, L]
        groups = tf.shape(ids, out_type=tf.int64)[0]
        segments = tf.range(groups)[:, None] * V + ids                      # [G, L]
        return sparse_segment.segment_rows(dZ, tf.reshape(segments, [-1]), groups, G,
                                            use.weight_shape)

    def squared_norms(self, use, dZ, B):
        if not isinstance(use.rows, _batch_axis.Rows):
            return None
        V = use.weight_shape.as_list()[0]
        D = use.weight_shape[1:].num_elements()
        L = use.activation.shape[1:].num_elements()
        if L is None or L * use.rows.k * L * use.rows.k > V * D:
            return None
        ids = tf.reshape(use.activation, _rows.group_shape(B, [-1]))     # [B, L]
        dZ_g = tf.reshape(dZ, _rows.group_shape(B, [-1, D]))              # [B, L, D]
        same = tf.cast(tf.equal(ids[:, :, None], ids[:, None, :]), dZ.dtype)  # [B, L, L]
        gram = tf.einsum("btd,bsd->bts", dZ_g, dZ_g)                      # [B, L, L]
        return tf.reduce_sum(same * gram, axis=[1, 2])                    # [B]

    def clipped_sum(self, use, dZ, factors):
        # sum_i f_i grad_i: the one-group gradient of dZ's rows scaled by their example's f
        if not isinstance(use.rows, _Partition):
            return registry_lib.batch_gradient_clipped_sum(self, use, dZ, factors)
        examples = use.rows.positions // use.rows.k                        # [n_p]
        scale = tf.gather(tf.cast(factors, dZ.dtype), examples)            # [n_p]
        scaled = dZ * tf.reshape(scale, [-1] + [1] * (dZ.shape.rank - 1))
        return self.per_group(use, scaled, 1)[0]


def _partition_of(op, analysis):
    """The `_Partition` of the gather `op` when it is part of a partitioned lookup
    that the analysis proved (its DynamicStitch has rows); else None."""
    ids = op.inputs[1]
    if ids.op.type != "DynamicPartition":
        return None
    stitches = [c for t in op.outputs for c in _past_identities(t)
                if c.type in transfer_lookups.STITCH_OP_TYPES]
    if len(stitches) != 1:
        return None
    found = transfer_lookups.partitioned_lookup(stitches[0])
    rows = analysis.rows(stitches[0].outputs[0])
    if found is None or op not in found[3] or rows is None or rows.lead != 0 or rows.k is None:
        return None
    where = found[2][1]   # DynamicPartition(range(n), P)
    return _Partition(where.outputs[ids.value_index], where.inputs[0], rows.k)


def _past_identities(tensor):
    """The consumers of `tensor`, those past Identity ops."""
    consumers = []
    for c in tensor.consumers():
        if c.type == "Identity":
            consumers.extend(_past_identities(c.outputs[0]))
        else:
            consumers.append(c)
    return consumers


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
    """Adds the gather rule to `registry`."""
    registry_lib.register_each(registry, ("GatherV2", "ResourceGather"), GatherRule())

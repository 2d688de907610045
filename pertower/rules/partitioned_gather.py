"""Rule for the parts of a partitioned embedding table: GatherV2(part_p, ids_p) (or
ResourceGather) whose ids are partition p of a DynamicPartition of the batch's ids,
stitched back by DynamicStitch (`tf.nn.embedding_lookup` over a list of parts or a
PartitionedVariable, partition_strategy "mod" or "div"; the pattern and its proof are
in `pertower._batch_axis.transfer_lookups`). Other gathers: `gather.GatherRule`.

Identity: with n = B*k rows (k ids per example) and positions_p = DynamicPartition(
range(n), P)[p] the flat row each of partition p's rows came from, the gathered row j
of partition p belongs to example positions_p[j] // k, and Z_p = part_p[ids_p] copies
rows, so

    grad_i(part_p)[v] = sum over j with positions_p[j] // k = i and ids_p[j] = v of dz_pj,

the gather rule's scatter-add (Goodfellow 2015, arXiv 1510.01799: a per-example
gradient is the per-example sum of the batch gradient's terms) with each row's example
read from the positions instead of from a fixed k rows per example: one unsorted
segment sum with segment g*V + id for group g = i // (B/G).
"""

import tensorflow as tf

from pertower._batch_axis import transfer_lookups
from pertower.rules import _rows
from pertower.rules import gather
from pertower.rules import registry as registry_lib

__all__ = ["PartitionedGatherRule", "register"]


class _Partition:
    """What a use of part p needs: the positions its rows came from [n_p], the
    range(n) they index (n = B*k flat ids) and k."""

    def __init__(self, positions, flat_range, k):
        self.positions = positions
        self.flat_range = flat_range
        self.k = k


def _partition_of(op, analysis):
    """The `_Partition` of the gather `op` when it is part of a partitioned lookup
    that the analysis proved (its DynamicStitch has rows); else None."""
    ids = op.inputs[1]
    if ids.op.type != "DynamicPartition":
        return None
    stitches = [c for t in op.outputs for c in _through_identities(t)
                if c.type in transfer_lookups.STITCH_OP_TYPES]
    if len(stitches) != 1:
        return None
    found = transfer_lookups.partitioned_lookup(stitches[0])
    rows = analysis.rows(stitches[0].outputs[0])
    if found is None or op not in found[3] or rows is None or rows.lead != 0 or rows.k is None:
        return None
    where = found[2][1]   # DynamicPartition(range(n), P)
    return _Partition(where.outputs[ids.value_index], where.inputs[0], rows.k)


def _through_identities(tensor):
    consumers = []
    for c in tensor.consumers():
        if c.type == "Identity":
            consumers.extend(_through_identities(c.outputs[0]))
        else:
            consumers.append(c)
    return consumers


class PartitionedGatherRule(gather.GatherRule):
    """The gather rule, with each gathered row's example read from the partition's
    positions when the ids are a DynamicPartition's."""

    def match(self, op, slot, analysis):
        partition = _partition_of(op, analysis) if slot == 0 else None
        if partition is None:
            return super().match(op, slot, analysis)
        w_shape = op.inputs[0].shape if op.type != "ResourceGather" else None
        return registry_lib.Use(op, slot, self, op.inputs[1], op.outputs[0], w_shape,
                                partition)

    def per_group(self, use, dZ, G):
        if not isinstance(use.rows, _Partition):
            return super().per_group(use, dZ, G)
        part = use.rows
        V = use.weight_shape.as_list()[0]
        row_shape = use.weight_shape.as_list()[1:]
        D = _rows.static_size(use.weight_shape[1:])
        examples = tf.cast(part.positions // part.k, tf.int64)          # [n_p]
        count = tf.size(part.flat_range, out_type=tf.int64)              # n = B*k
        per_group = count // part.k // tf.cast(G, tf.int64)
        groups = examples // tf.maximum(per_group, 1)                     # [n_p]
        segments = groups * V + tf.cast(use.activation, tf.int64)          # [n_p]
        dense = tf.math.unsorted_segment_sum(tf.reshape(dZ, [-1, D]), segments,
                                             tf.cast(G, tf.int64) * V)    # [G*V, D]
        return tf.reshape(dense, _rows.group_shape(G, [V] + row_shape))  # [G, V, *row]

    def clipped_sum(self, use, dZ, factors):
        if not isinstance(use.rows, _Partition):
            return super().clipped_sum(use, dZ, factors)
        # sum_i f_i grad_i: the one-group gradient of dZ's rows scaled by their example's f
        examples = use.rows.positions // use.rows.k                        # [n_p]
        scale = tf.gather(tf.cast(factors, dZ.dtype), examples)            # [n_p]
        scaled = dZ * tf.reshape(scale, [-1] + [1] * (dZ.shape.rank - 1))
        return self.per_group(use, scaled, 1)[0]


def register(registry):
    """Adds the partitioned gather rule (which covers every gather) to `registry`."""
    registry_lib.register_each(registry, ("GatherV2", "ResourceGather"),
                               PartitionedGatherRule())

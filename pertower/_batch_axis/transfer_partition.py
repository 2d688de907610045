"""Transfer function of the partitioned lookup: DynamicStitch of gathers by a
DynamicPartition of the rows (`tf.nn.embedding_lookup` over a partitioned table, either
`partition_strategy`).

Notation: n rows (k per example of B), N partitions, P [n] the partition of each row.

TensorFlow looks up ids [n] in a table split into N parts as

    gather_ids = DynamicPartition(new_ids, P, N)          # new_ids, P: [n], row-wise
    positions  = DynamicPartition(Range(0, n, 1), P, N)   # where each row came from
    result     = DynamicStitch(positions, [Gather(part_p, gather_ids[p]) for p < N])

so row r of `result` is Gather(part_{P[r]}, new_ids[r]): the stitch puts every gathered
row back at the position it came from (DynamicPartition keeps the rows' order within a
partition; both partitions split the same P, and DynamicPartition checks at run time
that its data has P's n rows). The result has the rows of new_ids and P: Rows(0, k).
The partitions in between hold a data-dependent number of rows per example, which the
lattice has no value for; the analysis loses the batch axis at the DynamicPartitions
and `stitch` takes that loss back once it has matched the whole pattern and found no
other use of the partitions or the gathered rows between the batch and `ys`.
"""

from pertower._batch_axis import lattice
from pertower._batch_axis import static
from pertower._batch_axis.lattice import Rows

__all__ = ["TRANSFERS", "READS_UNKNOWN", "partitioned_lookup"]

_STITCH_OP_TYPES = frozenset({"DynamicStitch", "ParallelDynamicStitch"})
_GATHER_OP_TYPES = frozenset({"GatherV2", "Gather", "ResourceGather"})


def _row_gather(op):
    """Whether `op` gathers whole rows (axis 0, no batch_dims) of its params by its ids."""
    if op.type not in _GATHER_OP_TYPES:
        return False
    if "batch_dims" in op.node_def.attr and op.get_attr("batch_dims"):
        return False
    if op.type == "GatherV2":
        axis = static.static_value(op.inputs[2])
        return axis is not None and int(axis) == 0
    return True


def _unwrap_identities(tensor):
    ops = []
    while tensor.op.type == "Identity":
        ops.append(tensor.op)
        tensor = tensor.op.inputs[0]
    return tensor, ops


def partitioned_lookup(op):
    """For a DynamicStitch `op` of the pattern above: (P, new_ids, the two
    DynamicPartition ops, the gather ops, the Identity ops between them and `op`);
    else None. Structural only: the caller checks the values."""
    if op.type not in _STITCH_OP_TYPES:
        return None
    N = len(op.inputs) // 2
    positions, data = op.inputs[:N], op.inputs[N:]
    where = positions[0].op
    if where.type != "DynamicPartition" or len(where.outputs) != N:
        return None
    if any(t.op is not where or t.value_index != p for p, t in enumerate(positions)):
        return None
    count = where.inputs[0].op
    if count.type != "Range" or [static.static_value(count.inputs[i]) for i in (0, 2)] != [0, 1]:
        return None
    gathers, identities, split = [], [], None
    for p, tensor in enumerate(data):
        tensor, ids_ops = _unwrap_identities(tensor)
        if not _row_gather(tensor.op):
            return None
        ids = tensor.op.inputs[1]
        if ids.op.type != "DynamicPartition" or ids.value_index != p:
            return None
        if split is None:
            split = ids.op
        elif ids.op is not split:
            return None
        gathers.append(tensor.op)
        identities.extend(ids_ops)
    if split is None or len(split.outputs) != N or split.inputs[1] is not where.inputs[1]:
        return None
    return where.inputs[1], split.inputs[0], (split, where), gathers, identities


def stitch(scan, op, _):
    """Rows(0, k) for the partitioned lookup's DynamicStitch (see the module)."""
    partitions, new_ids, partition_ops, gathers, identities = lattice.matched(
        partitioned_lookup(op), "its indices and data are not the partitions of one "
        "partitioned lookup")
    rows = [scan.value_of(t) for t in (partitions, new_ids)]
    if not all(isinstance(v, Rows) and v.lead == 0 and v.k is not None for v in rows) or (
            rows[0].k != rows[1].k or partitions.shape.rank != 1 or new_ids.shape.rank != 1):
        raise lattice.Lost("the rows it partitions are not the batch's rows, one id each")
    if any(lattice.depends_on_values(scan.value_of(g.inputs[0])) for g in gathers):
        raise lattice.Lost("it gathers from tables that depend on the batch")
    # every use of the partitions and gathered rows between the batch and `ys` is the
    # pattern's own: nothing else reads the rows whose axis the analysis lost
    inside = set(partition_ops) | set(gathers) | set(identities) | {op}
    for member in inside - {op}:
        for tensor in member.outputs:
            if any(c in scan.region and c not in inside for c in tensor.consumers()):
                raise lattice.Lost(f"{tensor.name} has another use between the batch and `ys`")
    scan.forgive(partition_ops)
    return [Rows(0, rows[1].k, None)]


TRANSFERS = dict.fromkeys(_STITCH_OP_TYPES, stitch)
READS_UNKNOWN = frozenset(_STITCH_OP_TYPES)

"""Transfer functions of lookups whose intermediate rows are data-dependent: the
analysis loses the batch axis inside; the pattern's last op matches it whole, checks
that nothing else between the batch and `ys` reads those rows, and takes the loss back
(`scan.forgive`).

Partitioned lookup (`tf.nn.embedding_lookup` over N parts); n rows, k per example, P
[n] the partition of each row:

    gather_ids = DynamicPartition(new_ids, P, N)          # new_ids, P: [n], row-wise
    positions  = DynamicPartition(Range(0, n, 1), P, N)   # where each row came from
    result     = DynamicStitch(positions, [Gather(part_p, gather_ids[p]) for p < N])

Row r of `result` is Gather(part_{P[r]}, new_ids[r]): Rows(0, k).

Sparse lookup (`tf.compat.v1.nn.embedding_lookup_sparse`, weights None, of
`tf.sparse.from_dense(X)`); X [B, n] the batch's ids, m entries:

    C           = Where(M)                  # [m, 2], (row, column) of X's entries
    ids         = GatherNd(X, C)            # [m], entry j of example C[j, 0]
    segment_ids = C[:, 0]                   # [m], the example of entry j
    result      = SparseSegmentMean(table, ids, segment_ids)   # [B', D]

Row s of `result` combines the table's rows of example s's own ids: Rows(0, 1). For a
resource table TensorFlow passes Gather(table, u) of the unique ids u, idx =
Unique(ids), as the op's table and indices.
"""

from pertower._batch_axis import lattice
from pertower._batch_axis import static
from pertower._batch_axis.lattice import Rows

__all__ = ["TRANSFERS", "READS_UNKNOWN", "STITCH_OP_TYPES", "SPARSE_SEGMENT_OP_TYPES",
           "partitioned_lookup", "sparse_lookup", "unique_gather"]

STITCH_OP_TYPES = frozenset({"DynamicStitch", "ParallelDynamicStitch"})
SPARSE_SEGMENT_OP_TYPES = frozenset({"SparseSegmentSum", "SparseSegmentMean",
                                     "SparseSegmentSqrtN"})
_UNIQUE_OP_TYPES = ("Unique", "UniqueV2")


def _through(tensor, op_types):
    """`tensor` with the ops of `op_types` above it passed; and those ops."""
    ops = []
    while tensor.op.type in op_types:
        ops.append(tensor.op)
        tensor = tensor.op.inputs[0]
    return tensor, ops


def _row_gather(op, op_types=("GatherV2", "Gather", "ResourceGather")):
    """Whether `op` gathers whole rows (axis 0, no batch_dims) of its params by its ids."""
    if op.type not in op_types:
        return False
    if "batch_dims" in op.node_def.attr and op.get_attr("batch_dims"):
        return False
    if op.type == "GatherV2":
        axis = static.static_value(op.inputs[2])
        return axis is not None and int(axis) == 0
    return True


def _only_pattern_reads(scan, inside, last):
    """Raises Lost when an output of the ops `inside` (but `last`) has a consumer between
    the batch and `ys` outside them."""
    for member in inside - {last}:
        for tensor in member.outputs:
            if any(c in scan.region and c not in inside for c in tensor.consumers()):
                raise lattice.Lost(f"{tensor.name} has another use between the batch and `ys`")


def partitioned_lookup(op):
    """For a DynamicStitch `op` of the pattern above (structure only): (P, new_ids,
    the two DynamicPartition ops, the gathers, the Identity ops after them); else None."""
    if op.type not in STITCH_OP_TYPES:
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
        tensor, ids_ops = _through(tensor, ("Identity",))
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
    _only_pattern_reads(scan, set(partition_ops) | set(gathers) | set(identities) | {op}, op)
    scan.forgive(partition_ops)
    return [Rows(0, rows[1].k, None)]


def _column_zero(op):
    """The coordinates C when `op` is C[:, 0] of a [m, 2] C; else None."""
    if op.type != "StridedSlice" or op.inputs[0].shape.rank != 2:
        return None
    begin, end, strides = (static.static_value(t) for t in op.inputs[1:4])
    if begin is None or end is None or strides is None or len(begin) != 2:
        return None
    masks = [op.get_attr(name) for name in ("begin_mask", "end_mask", "ellipsis_mask",
                                            "new_axis_mask", "shrink_axis_mask")]
    if masks[2] or masks[3] or masks[4] != 2 or list(strides) != [1, 1]:
        return None
    whole_rows = (masks[0] & 1 or int(begin[0]) == 0) and masks[1] & 1
    if not whole_rows or int(begin[1]) != 0 or int(end[1]) != 1 or masks[0] & 2 or masks[1] & 2:
        return None
    return op.inputs[0]


def unique_gather(tensor):
    """(the row gather, its Unique) when `tensor` is Gather(table, Unique(v).y) (through
    Identity ops); else None."""
    gather = _through(tensor, ("Identity",))[0].op
    if not _row_gather(gather, ("GatherV2", "ResourceGather")):
        return None
    ids = gather.inputs[1]
    if ids.op.type not in _UNIQUE_OP_TYPES or ids.value_index != 0:
        return None
    return gather, ids.op


def sparse_lookup(op):
    """For a SparseSegment op of the pattern above (structure only): (C, X, M, the
    table's gather by unique ids or None); else None."""
    if op.type not in SPARSE_SEGMENT_OP_TYPES:
        return None
    casts = ("Cast", "Identity")
    ids, segments = _through(op.inputs[1], casts)[0], _through(op.inputs[2], casts)[0]
    table_gather = None
    if ids.op.type in _UNIQUE_OP_TYPES:
        found = unique_gather(op.inputs[0])
        if ids.value_index != 1 or found is None or found[1] is not ids.op:
            return None
        table_gather, ids = found[0], _through(ids.op.inputs[0], casts)[0]
    coordinates = _column_zero(segments.op)
    if coordinates is None or coordinates.op.type != "Where" or ids.op.type != "GatherNd":
        return None
    if ids.op.inputs[1] is not coordinates or coordinates.op.inputs[0].shape.rank != 2:
        return None
    return coordinates, ids.op.inputs[0], coordinates.op.inputs[0], table_gather


def _own_uses(scan, coordinates):
    """Whether every use of `coordinates` between the batch and `ys` (through casts)
    is a column-0 slice or a gather of ids that ends in a proven sparse lookup (also
    through a Unique and the table's gather by its unique ids)."""
    def inside(consumer):
        return consumer in scan.region

    def lookup(consumer):
        return consumer.type in SPARSE_SEGMENT_OP_TYPES and sparse_lookup(consumer) is not None

    def to_lookups(tensor):
        for consumer in filter(inside, tensor.consumers()):
            if consumer.type in ("Cast", "Identity"):
                if not to_lookups(consumer.outputs[0]):
                    return False
            elif consumer.type in _UNIQUE_OP_TYPES:
                if not all(gathers_to_lookups(g)
                           for g in filter(inside, consumer.outputs[0].consumers())):
                    return False
                if not to_lookups(consumer.outputs[1]):
                    return False
            elif not lookup(consumer):
                return False
        return True

    def gathers_to_lookups(gather):
        if gather.type not in ("GatherV2", "ResourceGather"):
            return False
        for tensor in gather.outputs:
            for consumer in filter(inside, tensor.consumers()):
                while consumer.type == "Identity":
                    nxt = [c for c in consumer.outputs[0].consumers() if inside(c)]
                    if len(nxt) != 1:
                        return False
                    consumer = nxt[0]
                if not lookup(consumer) or sparse_lookup(consumer)[3] is not gather:
                    return False
        return True

    for consumer in filter(inside, coordinates.consumers()):
        column = consumer.type == "StridedSlice" and _column_zero(consumer) is coordinates
        ids = consumer.type == "GatherNd" and consumer.inputs[1] is coordinates
        if not (column or ids) or not to_lookups(consumer.outputs[0]):
            return False
    return True


def sparse_segment(scan, op, _):
    """Rows(0, 1) for the sparse lookup's SparseSegment op (see the module)."""
    coordinates, ids_source, mask, table_gather = lattice.matched(
        sparse_lookup(op), "its ids and segment ids are not the entries of a SparseTensor "
        "built from the batch's dense ids (tf.sparse.from_dense)")
    for tensor in (ids_source, mask):
        value = scan.value_of(tensor)
        if not (isinstance(value, Rows) and value.lead == 0 and value.k == 1):
            raise lattice.Lost(f"{tensor.name} does not hold one row per example")
    table = op.inputs[0] if table_gather is None else table_gather.inputs[0]
    if lattice.depends_on_values(scan.value_of(table)):
        raise lattice.Lost("it looks up a table that depends on the batch")
    if not _own_uses(scan, coordinates):
        raise lattice.Lost(f"the coordinates {coordinates.name} have another use between "
                           "the batch and `ys`")
    scan.forgive([coordinates.op])
    return [Rows(0, 1, None)]


TRANSFERS = dict.fromkeys(STITCH_OP_TYPES, stitch)
TRANSFERS.update(dict.fromkeys(SPARSE_SEGMENT_OP_TYPES, sparse_segment))
READS_UNKNOWN = STITCH_OP_TYPES | SPARSE_SEGMENT_OP_TYPES

"""Transfer function of a sparse lookup of ids built from the batch's dense ids:
SparseSegment{Sum,Mean,SqrtN}(table, ids, segment_ids) with the SparseTensor made in
the graph by `tf.sparse.from_dense` (`tf.compat.v1.nn.embedding_lookup_sparse` on one
table, weights None: TensorFlow's direct path).

Notation: X [B, n] the batch's ids (one row per example), m non-zero entries.

    C           = Where(M)                  # [m, 2], (row, column) of X's entries, row-major
    ids         = GatherNd(X, C)            # [m], entry j of example C[j, 0]
    segment_ids = C[:, 0]                   # [m], the example of entry j
    result      = SparseSegmentMean(table, ids, segment_ids)   # [B', D]

Row s of `result` combines the table's rows of example s's own ids: Rows(0, 1) (B' = B
when the last example has an entry; else the user's graph fails on the shapes, as
without pertower). X and M must have one row per example (Rows(0, 1)) and the table
must not depend on the batch. The coordinates C hold a data-dependent number of entries
per example, which the lattice has no value for: the analysis loses the batch axis at
the Where, and `sparse_segment` takes that loss back once every use of C between the
batch and `ys` is one of these column-0 slices and gathers feeding such lookups.
"""

from pertower._batch_axis import lattice
from pertower._batch_axis import static
from pertower._batch_axis.lattice import Rows

__all__ = ["TRANSFERS", "READS_UNKNOWN", "sparse_lookup", "unique_gather",
           "SPARSE_SEGMENT_OP_TYPES"]

SPARSE_SEGMENT_OP_TYPES = frozenset({"SparseSegmentSum", "SparseSegmentMean",
                                     "SparseSegmentSqrtN"})
_CASTS = frozenset({"Cast", "Identity"})


def _source(tensor):
    while tensor.op.type in _CASTS:
        tensor = tensor.op.inputs[0]
    return tensor


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


def _identities(tensor):
    while tensor.op.type == "Identity":
        tensor = tensor.op.inputs[0]
    return tensor


def unique_gather(tensor):
    """(the row gather, its Unique) when `tensor` is Gather(table, Unique(v).y) (through
    Identity ops); else None."""
    gather = _identities(tensor).op
    if gather.type not in ("GatherV2", "ResourceGather") or (
            "batch_dims" in gather.node_def.attr and gather.get_attr("batch_dims")):
        return None
    if gather.type == "GatherV2":
        axis = static.static_value(gather.inputs[2])
        if axis is None or int(axis) != 0:
            return None
    ids = gather.inputs[1]
    if ids.op.type not in ("Unique", "UniqueV2") or ids.value_index != 0:
        return None
    return gather, ids.op


def sparse_lookup(op):
    """For a SparseSegment op of the pattern above: (C, the GatherNd's params X, the
    Where's input M, the table's gather by unique ids or None); else None. The table is
    input 0 itself, or (as TensorFlow builds it for a resource table) the rows
    Gather(table, u) of the unique ids u, idx = Unique(ids) as the op's indices.
    Structural only."""
    if op.type not in SPARSE_SEGMENT_OP_TYPES:
        return None
    ids, segments, table_gather = _source(op.inputs[1]), _source(op.inputs[2]), None
    if ids.op.type in ("Unique", "UniqueV2"):
        found = unique_gather(op.inputs[0])
        if ids.value_index != 1 or found is None or found[1] is not ids.op:
            return None
        table_gather, ids = found[0], _source(ids.op.inputs[0])
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

    def to_lookups(tensor):
        for consumer in filter(inside, tensor.consumers()):
            if consumer.type in _CASTS:
                if not to_lookups(consumer.outputs[0]):
                    return False
            elif consumer.type in ("Unique", "UniqueV2"):
                if not all(_gathers_to_lookups(g)
                           for g in filter(inside, consumer.outputs[0].consumers())):
                    return False
                if not to_lookups(consumer.outputs[1]):
                    return False
            elif consumer.type not in SPARSE_SEGMENT_OP_TYPES or sparse_lookup(consumer) is None:
                return False
        return True

    def _gathers_to_lookups(gather):
        if gather.type not in ("GatherV2", "ResourceGather"):
            return False
        for tensor in gather.outputs:
            for consumer in filter(inside, tensor.consumers()):
                while consumer.type == "Identity":
                    nxt = [c for c in consumer.outputs[0].consumers() if inside(c)]
                    if len(nxt) != 1:
                        return False
                    consumer = nxt[0]
                if consumer.type not in SPARSE_SEGMENT_OP_TYPES or sparse_lookup(consumer) is None:
                    return False
                if sparse_lookup(consumer)[3] is not gather:
                    return False
        return True

    for consumer in filter(inside, coordinates.consumers()):
        if consumer.type == "StridedSlice" and _column_zero(consumer) is coordinates:
            ok = to_lookups(consumer.outputs[0])
        elif consumer.type == "GatherNd" and consumer.inputs[1] is coordinates:
            ok = to_lookups(consumer.outputs[0])
        else:
            ok = False
        if not ok:
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


TRANSFERS = dict.fromkeys(SPARSE_SEGMENT_OP_TYPES, sparse_segment)
READS_UNKNOWN = SPARSE_SEGMENT_OP_TYPES

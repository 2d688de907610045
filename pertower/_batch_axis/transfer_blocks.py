"""Transfer functions of SpaceToBatchND, BatchToSpaceND and the ops between them (a
dilated convolution without oneDNN: SpaceToBatchND -> Conv2D -> BatchToSpaceND).

Notation: N rows on axis 0, B examples, K = prod(block_shape) of one op.

SpaceToBatchND writes the block at offset j < K of input row r to output row j*N + r
(the block offset outermost, TensorFlow's documentation of the op). So Rows(0, inner)
becomes `lattice.Interleaved(inner, K)`, and Interleaved(inner, blocks) becomes
Interleaved(inner, K*blocks). BatchToSpaceND builds output row r ([N/K, ...]) from the
input rows j*(N/K) + r, j < K: it undoes the outermost K blocks (Interleaved(inner,
blocks/K), or Rows(0, inner) when blocks = K); on any other layout it mixes examples.
A convolution (`ROW_WISE_CONVOLUTION_OP_TYPES`), and ExpandDims and Squeeze of other
axes than 0, keep Interleaved; any other op loses the batch axis there (`misread`).
"""

import numpy as np

from pertower import _op_types as op_types
from pertower._batch_axis import lattice
from pertower._batch_axis import static
from pertower._batch_axis import transfer_compute
from pertower._batch_axis import transfer_layout
from pertower._batch_axis.lattice import Interleaved, Rows

__all__ = ["TRANSFERS", "READS_INTERLEAVED", "MISREAD", "misread", "known"]

MISREAD = ("it reads the blocks of a SpaceToBatchND (examples' rows interleaved on axis "
           "0), which only a convolution or BatchToSpaceND may read")


def _blocks(op, ins):
    """K = prod(block_shape) of a SpaceToBatchND or BatchToSpaceND, or Lost."""
    if any(lattice.depends_on_values(v) for v in ins[1:]):
        raise lattice.Lost("its block_shape, paddings or crops depend on the batch's values")
    shape = static.static_value(op.inputs[1])
    if shape is None:
        raise lattice.Lost("its block_shape is not static")
    return int(np.prod(np.reshape(shape, [-1]), dtype=np.int64))


def _interleaved(tensor, inner, blocks):
    """Interleaved(inner, blocks, E) for `tensor`, E = inner*blocks rows of prod(shape[1:])
    elements (None when not static)."""
    rest = tensor.shape[1:]
    if tensor.shape.rank is None or not rest.is_fully_defined():
        return Interleaved(inner, blocks, None)
    return Interleaved(inner, blocks, inner * blocks * int(np.prod(rest.as_list(), dtype=np.int64)))


def space_to_batch(scan, op, ins):
    value, K = ins[0], _blocks(op, ins)
    if len(scan.batches.parts_of(op.inputs[0])) > 1:
        raise lattice.Lost("its input joins several batches along the batch axis")
    if isinstance(value, Rows) and value.lead == 0 and value.k is not None:
        inner, blocks = value.k, K
    elif isinstance(value, Interleaved):
        inner, blocks = value.inner, K * value.blocks
    else:
        raise lattice.Lost("its input's batch axis is not axis 0 with a known number of "
                           "rows per example")
    return [_interleaved(op.outputs[0], inner, blocks)]


def batch_to_space(scan, op, ins):
    value, K = ins[0], _blocks(op, ins)
    if not isinstance(value, Interleaved) or value.blocks % K:
        raise lattice.Lost(
            "it puts rows j*N/K + r (j < K) of its input into row r of its output, which "
            "here mixes examples (its input is not the blocks of a SpaceToBatchND with "
            "this block_shape)")
    if value.blocks == K:
        return [Rows(0, value.inner, None)]
    blocks = value.blocks // K
    return [_interleaved(op.outputs[0], value.inner, blocks)]


def convolution(scan, op, ins):
    value = ins[0]
    if not isinstance(value, Interleaved):
        return transfer_compute.convolution(scan, op, ins)
    if any(lattice.depends_on_values(v) for v in ins[1:]):
        raise lattice.Lost("its filter depends on the batch's values")
    return [_interleaved(op.outputs[0], value.inner, value.blocks)]


def _keeps_axis_0(op):
    """Whether an ExpandDims or Squeeze `op` leaves axis 0 in place."""
    if op.type == "ExpandDims":
        axis = static.static_value(op.inputs[1])
        rank = op.outputs[0].shape.rank
        return axis is not None and rank is not None and int(np.reshape(axis, [])) % rank != 0
    dims = list(op.get_attr("squeeze_dims"))
    rank = op.inputs[0].shape.rank
    return bool(dims) and rank is not None and all(d % rank != 0 for d in dims)


def layout(scan, op, ins):
    """ExpandDims and Squeeze of other axes than 0 keep the rows."""
    value = ins[0]
    if not isinstance(value, Interleaved):
        return _LAYOUT[op.type](scan, op, ins)
    if any(lattice.depends_on_values(v) for v in ins[1:]) or not _keeps_axis_0(op):
        raise lattice.Lost("it reshapes axis 0 of the blocks of a SpaceToBatchND")
    return [_interleaved(op.outputs[0], value.inner, value.blocks)]


_LAYOUT = {op_type: transfer_layout.TRANSFERS[op_type] for op_type in ("ExpandDims", "Squeeze")}
TRANSFERS = {op_type: space_to_batch for op_type in op_types.SPACE_TO_BATCH_OP_TYPES}
TRANSFERS.update({op_type: layout for op_type in _LAYOUT})
TRANSFERS.update({op_type: batch_to_space for op_type in op_types.BATCH_TO_SPACE_OP_TYPES})
TRANSFERS.update({op_type: convolution for op_type in op_types.ROW_WISE_CONVOLUTION_OP_TYPES})
# The op types whose transfer functions read Interleaved values.
READS_INTERLEAVED = frozenset(TRANSFERS)


def misread(scan, op, ins):
    """Whether `op` reads an Interleaved value without knowing that layout; then the
    batch axis is lost at `op` (recorded on `scan`)."""
    if op.type in READS_INTERLEAVED or not any(isinstance(v, Interleaved) for v in ins):
        return False
    scan.lose(op, MISREAD)
    return True


def known(value):
    """`value` as a rule's `output_layouts` sees it: None for UNKNOWN and Interleaved."""
    return None if value is lattice.UNKNOWN or isinstance(value, Interleaved) else value

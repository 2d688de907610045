"""Batch-size values: where a value computed from the batch's size feeds a computation.

Notation:
    B   examples in the batch            T   towers; each replays B/T examples
    size value  an integer tensor that depends on the batch tensors only through the
                shapes of batch-dependent tensors: Shape/ShapeN/Size of them and
                integer arithmetic on those (tf.shape(x)[0], B * 3, [B, -1], ...)
    size-data edge  an input (consumer op, index) of the replayed ops that reads a
                size value as data: a Cast of B to float, B in a float op, B compared
                or added to values; any input that is not a shape or axis operand

`ys` is defined on the whole batch: for `cost / tf.cast(tf.shape(x)[0], tf.float32)`
row i of `ys` is cost_i / B. A tower replays the graph on B/T examples, so its own
`tf.shape` gives B/T. At a size-data edge the tower must read the whole batch's value
(the original graph's tensor), so that its rows are the rows of `ys`; at a shape use
(Reshape's shape, Fill dims, Tile multiples, slice bounds, Range, reduction axes,
loop counters and bounds (a While's inputs, a TF1 loop's condition), tensor-list
element shapes, ...) it keeps its own size, the size of
the slice it computes on.

`size_data_edges(ops, batch)` lists the size-data edges of `ops`.
"""

import tensorflow as tf

__all__ = ["size_data_edges"]

# Ops whose outputs are the size of a batch-dependent input (a size value).
_SIZE_SOURCES = frozenset({"Shape", "ShapeN", "Size"})

# Integer ops that carry a size value on as a size value when all their inputs are
# size values or batch-independent (and their outputs are integers).
_SIZE_ARITHMETIC = frozenset({
    "Identity", "StridedSlice", "Slice", "Pack", "Unpack", "ConcatV2", "Concat",
    "GatherV2", "Gather", "Cast", "Add", "AddV2", "Sub", "Mul", "FloorDiv",
    "TruncateDiv", "Div", "FloorMod", "Mod", "Maximum", "Minimum", "Prod", "Sum",
    "Max", "Min", "Reshape", "ExpandDims", "Squeeze", "Neg", "Abs", "BroadcastArgs",
    # TF1 (v1) loop plumbing: a size value entering a loop frame stays one
    "Enter", "RefEnter", "Merge", "RefMerge", "Switch", "RefSwitch", "Exit", "RefExit",
    "NextIteration", "RefNextIteration",
})
# Ops a loop condition's comparison may pass through on its way to LoopCond.
_CONDITION_LOGIC = frozenset({"LogicalAnd", "LogicalOr", "LogicalNot", "Identity"})


def _bounds_v1_loop(op):
    """Whether every output of `op` only decides a TF1 loop's iterations (reaches
    LoopCond through boolean logic): comparing a counter with the size is a loop
    bound, which each tower keeps for its own slice, as a While's bound."""
    stack, seen = list(op.outputs), set()
    reached = False
    while stack:
        tensor = stack.pop()
        for consumer in tensor.consumers():
            if consumer.type == "LoopCond":
                reached = True
            elif consumer.type in _CONDITION_LOGIC and consumer not in seen:
                seen.add(consumer)
                stack.extend(consumer.outputs)
            else:
                return False
    return reached

# {op type: input indices that are shape or axis operands}; None means every input.
_SHAPE_OPERANDS = {
    "Reshape": (1,), "Fill": (0,), "Tile": (1,), "BroadcastTo": (1,), "Empty": (0,),
    "Slice": (1, 2), "StridedSlice": (1, 2, 3), "Range": (0, 1, 2),
    "Pad": (1,), "PadV2": (1,), "MirrorPad": (1,), "ExpandDims": (1,),
    "Squeeze": (), "Transpose": (1,), "ReverseV2": (1,), "Roll": (1, 2),
    "ConcatV2": "last", "Concat": (0,), "Split": (0,), "SplitV": (1, 2),
    "GatherV2": (2,), "OneHot": (1,), "Cumsum": (1,), "Cumprod": (1,),
    "Sum": (1,), "Mean": (1,), "Max": (1,), "Min": (1,), "Prod": (1,), "All": (1,),
    "Any": (1,), "ArgMax": (1,), "ArgMin": (1,), "EuclideanNorm": (1,),
    "UnsortedSegmentSum": (2,), "UnsortedSegmentMax": (2,), "UnsortedSegmentMin": (2,),
    "UnsortedSegmentProd": (2,), "MatrixBandPart": (1, 2), "MatrixDiagV3": (1, 2, 3),
    "ResizeBilinear": (1,), "ResizeNearestNeighbor": (1,), "ResizeBicubic": (1,),
    "RandomUniform": (0,), "RandomStandardNormal": (0,), "TruncatedNormal": (0,),
    "RandomUniformInt": (0,), "StatelessRandomUniform": (0,),
    "StatelessRandomNormal": (0,), "StatelessTruncatedNormal": (0,),
    "StatelessRandomUniformV2": (0,), "StatelessRandomNormalV2": (0,),
    "StatelessTruncatedNormalV2": (0,), "StatelessRandomUniformIntV2": (0,),
    "StatelessRandomUniformInt": (0,),
    "EmptyTensorList": (0, 1), "TensorListReserve": (0, 1),
    "TensorListFromTensor": (1,), "TensorListStack": (1,), "TensorListGetItem": (1, 2),
    "TensorListSetItem": (1,), "TensorListElementShape": (), "TensorArrayV3": (0,),
    "TensorArrayReadV3": (1,), "TensorArrayWriteV3": (1,), "TensorArrayGatherV3": (1,),
    "TensorArrayScatterV3": (1,),
    # loop variables of a while loop whose value is a size: its counters and bounds
    "While": None, "StatelessWhile": None,
    "BroadcastGradientArgs": None, "BroadcastArgs": None,
    "Shape": None, "ShapeN": None, "Size": None, "Rank": None,
}


def _is_shape_operand(op, index):
    operands = _SHAPE_OPERANDS.get(op.type, ())
    if operands is None:
        return True
    if operands == "last":
        return index == len(op.inputs) - 1
    return index in operands


def size_data_edges(ops, batch):
    """The inputs of `ops` that read a batch-size value as data.

    Args:
      ops: the ops between the batch and `ys` (e.g. the ops the towers replay).
      batch: the batch tensors, each [B, ...].

    Returns:
      A list of (consumer tf.Operation, input index), in graph order: the consumer
      is in `ops`, its input at that index is a size value (see the module
      docstring), and the input is not a shape or axis operand of the consumer.
    """
    order = sorted(set(ops), key=lambda op: op._id)  # pylint: disable=protected-access
    dependent = {b.name for b in batch}  # tensors whose values depend on the batch's
    size = set()                         # size values
    edges = []
    for op in order:
        names = [t.name for t in op.inputs]
        if not any(n in dependent or n in size for n in names):
            continue  # batch-independent (e.g. computed from weight reads only)
        outputs = [out.name for out in op.outputs]
        if op.type in _SIZE_SOURCES:
            size.update(outputs)
            continue
        if (op.type in _SIZE_ARITHMETIC and not any(n in dependent for n in names)
                and all(out.dtype.is_integer for out in op.outputs)):
            size.update(outputs)
            continue
        dependent.update(outputs)
        if _bounds_v1_loop(op):
            continue
        edges.extend((op, i) for i, n in enumerate(names)
                     if n in size and not _is_shape_operand(op, i))
    return edges

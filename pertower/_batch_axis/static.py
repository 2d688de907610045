"""Static values and shapes: what can be known about small integer tensors while building.

Notation: B examples in the batch. A *shape value* is a 1-D integer tensor described
entry by entry as (coefficient, power): the entry is coefficient * B ** power, with
power 0 (no batch) or 1 (a multiple of B); the coefficient is None when not known.
`tf.shape(x)` of a [B, 7, 4] x is [(1, 1), (7, 0), (4, 0)]; the Keras reshape target
[tf.shape(x)[0] * 7, 4] is [(7, 1), (4, 0)].
"""

import numpy as np
import tensorflow as tf

from pertower import _op_types as op_types
from pertower._batch_axis import lattice

__all__ = ["static_value", "parse_einsum", "ShapeEvaluator", "resolve_minus_one",
           "constant_sizes", "SHAPE_SLOTS", "shape_slots", "SHAPE_ARITHMETIC"]

# Small integer ops folded where tf.get_static_value stops (the axis arithmetic of
# tf.nn.softmax(axis=0), tf.sort, ...).
_FOLDED = {
    "Sub": np.subtract, "Add": np.add, "AddV2": np.add, "Mul": np.multiply,
    "FloorMod": np.mod, "Neg": np.negative, "Maximum": np.maximum, "Minimum": np.minimum,
    "Range": lambda start, limit, delta: np.arange(start, limit, delta),
    "Pack": lambda *parts: np.stack(parts), "Identity": lambda v: v,
}


# Inputs that are shapes, axes, bounds or sizes rather than values, per op type: a
# SIZE value there stays SIZE (the replayed op sees its slice's size, as it should).
SHAPE_SLOTS = {
    "Reshape": {1}, "Fill": {0}, "Tile": {1}, "BroadcastTo": {1}, "EnsureShape": set(),
    "ExpandDims": {1}, "Transpose": {1}, "ConjugateTranspose": {1}, "Squeeze": set(),
    "ConcatV2": {-1}, "Concat": {0}, "Split": {0}, "SplitV": {1, 2},
    "Pad": {1}, "PadV2": {1}, "MirrorPad": {1}, "Slice": {1, 2},
    "StridedSlice": {1, 2, 3}, "GatherV2": {2}, "OneHot": {1}, "Range": {0, 1, 2},
    "ArgMax": {1}, "ArgMin": {1}, "Cumsum": {1},
    "Cumprod": {1}, "CumulativeLogsumexp": {1}, "ReverseV2": {1}, "Roll": {1, 2},
    "TopKV2": {1}, "NthElement": {1}, "ResizeBilinear": {1},
    "ResizeNearestNeighbor": {1}, "ResizeBicubic": {1}, "ResizeArea": {1},
    "TensorListReserve": {0, 1}, "TensorListFromTensor": {1}, "TensorListStack": {1},
    "TensorListGetItem": {1, 2}, "TensorListSetItem": {1}, "TensorListElementShape": {0},
    "Zeros": {0}, "Ones": {0}, "MaxPoolV2": {1, 2}, "Empty": {0},
    # a transposed convolution's output shape, [B, h, w, c] (tf_keras Conv2DTranspose
    # stacks tf.shape(x)[0] into it), and a filter gradient's filter shape
    "Conv2DBackpropInput": {0}, "Conv3DBackpropInputV2": {0},
    "DepthwiseConv2dNativeBackpropInput": {0}, "Conv2DBackpropFilter": {1},
    "Conv3DBackpropFilterV2": {1}, "DepthwiseConv2dNativeBackpropFilter": {1},
    # block shapes and paddings or crops (`transfer_blocks`)
    "SpaceToBatchND": {1, 2}, "BatchToSpaceND": {1, 2},
}
SHAPE_SLOTS.update({t: {0} for t in op_types.RANDOM_OP_TYPES})
SHAPE_SLOTS.update({t: {1} for t in op_types.REDUCTION_OP_TYPES})


def shape_slots(op):
    """The indices of op's inputs that are shape or axis operands."""
    slots = SHAPE_SLOTS.get(op.type, set())
    return {s % len(op.inputs) for s in slots} if op.inputs else set()


def static_value(tensor, depth=0):
    """The value of `tensor` as a numpy array when it is known while building, else None."""
    try:
        value = tf.get_static_value(tensor)
    except (TypeError, ValueError, NotImplementedError):
        value = None
    if value is not None:
        return np.asarray(value)
    op = tensor.op
    if depth > 16 or not (op.type in _FOLDED or op.type == "ConcatV2"):
        return None
    try:
        if op.type == "Pack" and op.get_attr("axis") != 0:
            return None
        inputs = [static_value(t, depth + 1) for t in op.inputs]
        if any(v is None for v in inputs):
            return None
        if op.type == "ConcatV2":
            return np.concatenate([np.reshape(v, [-1]) for v in inputs[:-1]])
        return np.asarray(_FOLDED[op.type](*inputs))
    except (ValueError, TypeError):
        return None


# Ops of shape arithmetic whose SIZE outputs `constant_sizes` may prove constant.
SHAPE_ARITHMETIC = frozenset({"StridedSlice", "Slice", "GatherV2", "Prod", "Mul", "FloorDiv",
                               "Pack", "ConcatV2", "ExpandDims", "Reshape", "Identity", "Cast"})


def constant_sizes(shape_value, op, outs):
    """`outs` (the values of `op`'s outputs) with INDEPENDENT for each SIZE output that
    `shape_value` proves constant (every entry (c, 0), c known: Keras' GroupNormalization
    reshapes its weights to [1, 1, 1, G, tf.shape(x)[-1] // G]); only where no batch axis
    is static (a graph built for a static B may hold it in a static dimension)."""
    if op.type not in SHAPE_ARITHMETIC or not shape_value.dynamic_batch:
        return outs
    result = []
    for tensor, value in zip(op.outputs, outs):
        entries = shape_value(tensor) if value is lattice.SIZE and tensor.dtype.is_integer \
            else None
        constant = entries is not None and all(c is not None and p == 0 for c, p in entries)
        result.append(lattice.INDEPENDENT if constant else value)
    return result


def parse_einsum(equation):
    """'ab,bc->ac' -> (['ab', 'bc'], 'ac'); None for ellipses or implicit outputs."""
    equation = equation.decode() if isinstance(equation, bytes) else equation
    equation = equation.replace(" ", "")
    if "..." in equation or "->" not in equation:
        return None
    lhs, out = equation.split("->")
    return lhs.split(","), out


def resolve_minus_one(target):
    """Replaces a -1 entry by (None, power): power 1 exactly when no other entry has it."""
    if target is None:
        return None
    minus = [k for k, d in enumerate(target) if d == (-1, 0)]
    if not minus:
        return target
    if len(minus) > 1:
        return None
    power = 0 if any(p == 1 for _, p in target) else 1
    return [(None, power) if k == minus[0] else d for k, d in enumerate(target)]


class ShapeEvaluator:
    """Evaluates shape values (see the module docstring), memoized. `value_of`: tensor
    -> lattice value."""

    def __init__(self, value_of, seeds=None):
        self.value_of = value_of
        self.memo = lattice.TensorMap()
        # no seed's batch axis is static: no static dimension can hold B
        self.dynamic_batch = bool(seeds) and all(
            isinstance(v, lattice.Rows) and t.shape.rank is not None and 0 <= v.lead <
            t.shape.rank and tf.compat.dimension_value(t.shape[v.lead]) is None
            for t, v in seeds)

    def __call__(self, tensor):
        """A list of (coefficient, power), or None when `tensor` cannot be followed."""
        if tensor in self.memo:
            return self.memo[tensor]
        self.memo[tensor] = None  # guards against cycles
        try:
            value = self._evaluate(tensor, tensor.op)
        except (ValueError, TypeError, IndexError, KeyError, AttributeError):
            value = None
        self.memo[tensor] = value
        return value

    def _evaluate(self, tensor, op):
        if op.type in ("Shape", "Size"):
            x = op.inputs[0]
            value = self.value_of(x)
            if x.shape.rank is None or value is lattice.UNKNOWN:
                return None
            dims = [(d, 0) for d in x.shape.as_list()]
            if isinstance(value, lattice.Rows):
                dims[value.lead] = (value.k, 1)
            elif value is not lattice.INDEPENDENT and None in x.shape.as_list():
                return None   # a SIZE tensor: which axis follows B is not known
            return dims if op.type == "Shape" else _product(dims)
        if op.type in ("Identity", "Cast"):
            return self(op.inputs[0])
        if op.type in ("ExpandDims", "Reshape") and op.outputs[0].shape.rank == 1:
            return self(op.inputs[0])   # a scalar (or vector) as a vector
        if op.type in ("Pack", "ConcatV2"):
            if op.type == "Pack":
                parts, axes, axis = op.inputs, (0,), op.get_attr("axis")
            else:
                parts, axes, axis = op.inputs[:-1], (0, -1), static_value(op.inputs[-1])
            parts = [self(part) for part in parts]
            if axis is None or int(axis) not in axes or None in parts:
                return None
            return [d for part in parts for d in part]
        if op.type in ("StridedSlice", "Slice", "GatherV2", "Prod", "Mul", "FloorDiv"):
            return self._arithmetic(op)
        value = static_value(tensor)
        if value is None or value.dtype.kind not in "iu":
            return None
        return [(int(v), 0) for v in np.reshape(value, [-1])]

    def _arithmetic(self, op):
        source = self(op.inputs[0])
        if source is None:
            return None
        if op.type == "StridedSlice":
            begin, end, strides = (static_value(t) for t in op.inputs[1:4])
            if (begin is None or end is None or strides is None or len(begin) != 1
                    or op.get_attr("ellipsis_mask") or op.get_attr("new_axis_mask")):
                return None
            start = None if op.get_attr("begin_mask") & 1 else int(begin[0])
            stop = None if op.get_attr("end_mask") & 1 else int(end[0])
            if op.get_attr("shrink_axis_mask") & 1:
                start = 0 if start is None else start
                return [source[start]] if -len(source) <= start < len(source) else None
            return source[start:stop:int(strides[0])]
        if op.type == "Slice":
            begin, size = static_value(op.inputs[1]), static_value(op.inputs[2])
            if begin is None or size is None or begin.size != 1:
                return None
            start, length = int(begin.reshape(-1)[0]), int(size.reshape(-1)[0])
            return source[start:] if length == -1 else source[start:start + length]
        if op.type == "FloorDiv":  # a scalar over a constant
            divisor = static_value(op.inputs[1])
            if len(source) != 1 or divisor is None or divisor.size != 1:
                return None
            (coefficient, power), divisor = source[0], int(divisor.reshape(-1)[0])
            if coefficient is None or divisor == 0 or coefficient % divisor:
                return None
            return [(coefficient // divisor, power)]
        if op.type == "GatherV2":
            indices, axis = static_value(op.inputs[1]), static_value(op.inputs[2])
            if indices is None or axis is None or int(axis) != 0:
                return None
            return [source[int(i)] for i in np.reshape(indices, [-1])]
        if op.type == "Prod":
            if op.inputs[0].shape.rank != 1:
                return None
            factors = source
        else:   # Mul of two scalars
            other = self(op.inputs[1])
            if other is None or len(source) != 1 or len(other) != 1:
                return None
            factors = source + other
        return _product(factors)


def _product(factors):
    """[the product of the entries `factors`], or None when it is not c * B**p, p <= 1."""
    coefficient, power = 1, 0
    for c, p in factors:
        coefficient = None if coefficient is None or c is None else coefficient * c
        power += p
    return None if power > 1 else [(coefficient, power)]

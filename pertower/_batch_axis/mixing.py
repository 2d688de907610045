"""Examples that mix: find the ops that couple the examples of a batch.

Notation (as in every core module):
    B   examples in the batch          T   towers (B per-example, M microbatches)
    S   the replayed ops, downstream(batch and weight reads) ∩ upstream(ys)
    batch axis of a tensor: the axis whose index says which example an entry belongs
        to. It may hold several entries per example in a row ("batch-major"): a
        [B, 7, 4] tensor reshaped to [B * 7, 4] keeps its batch axis 0, with 7 rows
        per example.

Per-example gradients are defined when example i's row of `ys` depends on example i
alone. Towers (and per-op rules) compute each example (or microbatch) on its own, so
an op that couples examples (batch normalization in training mode, a reduction over
the batch axis, a matmul that contracts the batch axis, a softmax or cumulative sum
along it, ...) makes them compute a *different function* than `ys`, silently.

`find_couplings` scans S once, in creation order, tracking the batch axis of every
tensor that depends on the batch through the ops it knows (elementwise ops with
broadcasting, reshapes that keep the batch major, transposes, expand/squeeze,
concat/stack/split on other axes, slices, gathers, reductions, matmuls, einsum,
convolutions and pools, fused batch norm, ...). An op that reduces, contracts,
sorts, shifts or picks along the batch axis is a coupling. When the scan loses track
of the batch axis (an op it does not know, a reshape it cannot follow, a py_function,
a control-flow body) it stays silent from there on: it never refuses a graph it
cannot read, except for a reduction over *every* axis of a tensor computed from the
batch, which reduces the batch axis wherever it is. `validate=True` and
`pertower.check_independence` catch at run time what the scan cannot see.

`check_examples_independent(replayed_ops, batch, num_towers, function_name)` raises
a ValueError naming the first coupling; every method calls it with its op set.
"""

import collections
import dataclasses

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import function_def_to_graph

__all__ = ["Coupling", "find_couplings", "check_examples_independent"]


class _Unknown:
    """The batch axis of a tensor that depends on the batch could not be followed."""

    def __repr__(self):
        return "UNKNOWN"


UNKNOWN = _Unknown()

# The batch axis of a tensor: `index` into its shape, `per_example` entries of that
# axis per example (None when not known), e.g. 7 for [B, 7, 4] -> [B * 7, 4].
BatchAxis = collections.namedtuple("BatchAxis", ["index", "per_example"])


@dataclasses.dataclass(frozen=True)
class Coupling:
    """An op that makes one example's value depend on other examples.

    Attributes:
      op: the op.
      reason: what it does along the batch axis, e.g. "reduces (Mean) over axis 0, the
        batch axis of its input 'x:0' (shape (None, 5))".
      advice: what to do instead.
    """

    op: tf.Operation
    reason: str
    advice: str

    def message(self, function_name):
        return (
            f"pertower.{function_name}: the op {self.op.name!r} ({self.op.type}) between "
            f"the batch and `ys` couples the examples of the batch: it {self.reason}. So "
            "each example's value depends on the other examples, its per-example "
            "gradient is not defined, and computing each example on its own (as the "
            f"towers and the per-op rules do) would give another function than `ys`. "
            f"{self.advice}")


_BATCH_NORM_ADVICE = (
    "This is batch normalization in training mode (a tf_keras BatchNormalization "
    "called with training=True, or in the symbolic learning phase, or tf.nn.moments / "
    "fused_batch_norm over the batch): call the layer with training=False (inference "
    "mode, which normalizes with the moving averages and works with pertower), or "
    "normalize each example on its own (LayerNormalization, GroupNormalization).")
_REDUCTION_ADVICE = (
    "Reduce over the non-batch axes only (for example axis=list(range(1, rank))), so "
    "that `ys` keeps one independent row per example; normalize per example "
    "(LayerNormalization) instead of over the batch.")
_POSITION_ADVICE = (
    "Select, order or shift examples before they enter the graph (feed them in the "
    "order you want), and index only the non-batch axes between the batch and `ys`.")
_CONTRACTION_ADVICE = (
    "Contract only non-batch axes (x @ W, not x^T @ x or x @ x^T); a statistic "
    "over the whole batch has no per-example gradient.")

ELEMENTWISE_OP_TYPES = frozenset("""
Abs Acos Acosh Add AddN AddV2 Angle ApproximateEqual Asin Asinh Atan Atan2 Atanh
BesselI0e BesselI1e Betainc BiasAdd BroadcastTo Cast Ceil CheckNumerics ClipByValue
ComplexAbs Conj Cos Cosh DebugIdentity DebugIdentityV2 Digamma Div DivNoNan Elu EluGrad
EnsureShape Equal Erf Erfc Erfinv Exp Expm1 Floor FloorDiv FloorMod Greater
GreaterEqual Identity Igamma Igammac Imag Inv Invert IsFinite IsInf IsNan LeakyRelu
LeakyReluGrad Less LessEqual Lgamma Log Log1p LogicalAnd LogicalNot LogicalOr Maximum
Minimum Mod Mul MulNoNan Ndtri Neg NotEqual PlaceholderWithDefault Polygamma Pow
PreventGradient Real RealDiv Reciprocal ReciprocalGrad Relu Relu6 Relu6Grad ReluGrad
Rint Round Rsqrt RsqrtGrad SelectV2 Selu SeluGrad Sigmoid SigmoidGrad Sign Sin
Sinh Snapshot Softplus SoftplusGrad Softsign SoftsignGrad Sqrt SqrtGrad Square
SquaredDifference StopGradient Sub Tan Tanh TanhGrad TruncateDiv TruncateMod Xdivy
Xlog1py Xlogy Zeta
""".split())
# Outputs that describe a tensor's shape (or are constants shaped like it) rather than
# its values: they do not carry examples.
_METADATA_OP_TYPES = frozenset({"Shape", "ShapeN", "Size", "Rank", "ZerosLike",
                                "OnesLike", "BroadcastGradientArgs", "TensorListLength",
                                "TensorListElementShape"})
_REDUCTION_OP_TYPES = frozenset({"Sum", "Mean", "Max", "Min", "Prod", "All", "Any",
                                 "EuclideanNorm"})
_CONVOLUTION_OP_TYPES = {  # op type -> index of the data input
    "Conv2D": 0, "Conv3D": 0, "DepthwiseConv2dNative": 0, "Conv2DBackpropInput": 2,
    "Conv3DBackpropInputV2": 2, "Dilation2D": 0, "ExtractImagePatches": 0,
    "ResizeBilinear": 0, "ResizeNearestNeighbor": 0, "ResizeBicubic": 0, "ResizeArea": 0,
    "ScaleAndTranslate": 0, "DepthToSpace": 0, "SpaceToDepth": 0, "Conv": 0,
}
_POOL_OP_TYPES = frozenset({"MaxPool", "AvgPool", "MaxPoolV2", "MaxPool3D", "AvgPool3D",
                            "MaxPoolWithArgmax", "LRN"})
_BATCH_NORM_OP_TYPES = frozenset({"FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"})
_INT32_MAX = 2 ** 31 - 1


class _Coupled(Exception):
    """Raised by a rule when its op couples examples."""

    def __init__(self, reason, advice):
        super().__init__(reason)
        self.reason = reason
        self.advice = advice


# Small integer ops folded by `_static` where tf.get_static_value stops (the axis
# arithmetic of tf.nn.softmax(axis=0), tf.sort, ...).
_FOLDED = {
    "Sub": np.subtract, "Add": np.add, "AddV2": np.add, "Mul": np.multiply,
    "FloorMod": np.mod, "Neg": np.negative, "Maximum": np.maximum, "Minimum": np.minimum,
    "Range": lambda start, limit, delta: np.arange(start, limit, delta),
    "Pack": lambda *parts: np.stack(parts), "Identity": lambda v: v,
}


def _static(tensor, depth=0):
    """The value of `tensor` when it is known while building, else None."""
    try:
        value = tf.get_static_value(tensor)
    except (TypeError, ValueError, NotImplementedError):
        value = None
    if value is not None:
        return np.asarray(value)
    op = tensor.op
    if depth > 16 or not (op.type in _FOLDED or op.type == "ConcatV2"):
        return None
    if op.type == "Pack" and op.get_attr("axis") != 0:
        return None
    inputs = [_static(t, depth + 1) for t in op.inputs]
    if any(v is None for v in inputs):
        return None
    if op.type == "ConcatV2":
        return np.concatenate([np.reshape(v, [-1]) for v in inputs[:-1]])
    return np.asarray(_FOLDED[op.type](*inputs))


def _describe(tensor):
    return f"{tensor.name!r} (shape {tensor.shape})"


def _bit(mask, i):
    return bool(mask & (1 << i))


class _BatchAxisScan:
    """Follows the batch axis through S; `couplings` collects what it found."""

    def __init__(self, seeds, depth=0):
        # tensor.ref() -> BatchAxis | UNKNOWN, for the tensors that depend on the batch
        self.axes = {tensor.ref(): axis for tensor, axis in seeds}
        self.shape_values = {}    # tensor.ref() -> list of (coefficient, batch power) or None
        self.depth = depth        # nesting of function bodies being scanned
        self.couplings = []
        self.rules = {}
        for op_type in ELEMENTWISE_OP_TYPES:
            self.rules[op_type] = self._elementwise
        for op_type in _REDUCTION_OP_TYPES:
            self.rules[op_type] = self._reduction
        for op_type in _CONVOLUTION_OP_TYPES:
            self.rules[op_type] = self._convolution
        for op_type in _POOL_OP_TYPES:
            self.rules[op_type] = self._pool
        for op_type in _BATCH_NORM_OP_TYPES:
            self.rules[op_type] = self._fused_batch_norm
        self.rules.update({
            "Reshape": self._reshape, "Transpose": self._transpose,
            "ConjugateTranspose": self._transpose, "ExpandDims": self._expand_dims,
            "Squeeze": self._squeeze, "ConcatV2": self._concat, "Concat": self._concat,
            "Pack": self._pack, "Unpack": self._unpack, "Split": self._split,
            "SplitV": self._split, "Tile": self._tile, "Pad": self._pad, "PadV2": self._pad,
            "MirrorPad": self._pad, "Slice": self._slice, "StridedSlice": self._strided_slice,
            "Gather": self._gather, "GatherV2": self._gather, "ResourceGather": self._gather,
            "GatherNd": self._gather_nd, "ResourceGatherNd": self._gather_nd,
            "OneHot": self._one_hot, "ArgMax": self._arg_reduction,
            "ArgMin": self._arg_reduction, "Softmax": self._last_axis,
            "LogSoftmax": self._last_axis, "TopKV2": self._last_axis,
            "NthElement": self._last_axis, "Cumsum": self._cumulative,
            "Cumprod": self._cumulative, "CumulativeLogsumexp": self._cumulative,
            "ReverseV2": self._reverse, "Roll": self._roll,
            "RandomShuffle": self._random_shuffle, "MatMul": self._matmul,
            "BatchMatMul": self._batch_matmul, "BatchMatMulV2": self._batch_matmul,
            "BatchMatMulV3": self._batch_matmul, "Einsum": self._einsum,
            "SoftmaxCrossEntropyWithLogits": self._cross_entropy,
            "SparseSoftmaxCrossEntropyWithLogits": self._cross_entropy,
            "L2Loss": self._l2_loss, "If": self._cond, "StatelessIf": self._cond,
            "PartitionedCall": self._call, "StatefulPartitionedCall": self._call,
            "While": self._while, "StatelessWhile": self._while,
            "Select": self._select, "IdentityN": self._identity_n,
            "Switch": self._switch, "RefSwitch": self._switch, "Merge": self._merge,
            "RefMerge": self._merge,
            "TensorListFromTensor": self._list_from_tensor,
            "TensorListGetItem": self._list_get_item, "TensorListSetItem": self._list_set_item,
            "TensorListStack": self._list_stack,
        })

    # -- driving -------------------------------------------------------------------

    def run(self, ops):
        for op in _topological(ops):
            in_axes = [self.axis_of(t) for t in op.inputs]
            if all(a is None for a in in_axes) or op.type in _METADATA_OP_TYPES:
                continue
            rule = self.rules.get(op.type)
            try:
                outs = rule(op, in_axes) if rule else [UNKNOWN] * len(op.outputs)
            except _Coupled as coupled:
                self.couplings.append(Coupling(op, coupled.reason, coupled.advice))
                outs = [UNKNOWN] * len(op.outputs)
            except (ValueError, TypeError, IndexError, KeyError, AttributeError):
                # an op whose attributes or shapes a rule cannot read: the scan loses
                # the batch axis here rather than failing the user's call
                outs = [UNKNOWN] * len(op.outputs)
            for tensor, axis in zip(op.outputs, outs):
                if axis is None:
                    continue
                if isinstance(axis, (int, np.integer)):
                    axis = BatchAxis(int(axis), self._common_per_example(in_axes))
                self.axes[tensor.ref()] = axis
        return self.couplings

    def axis_of(self, tensor):
        """The BatchAxis of `tensor`, UNKNOWN, or None when it does not depend on the batch."""
        return self.axes.get(tensor.ref())

    @staticmethod
    def _common_per_example(in_axes):
        known = {a.per_example for a in in_axes if isinstance(a, BatchAxis)}
        return known.pop() if len(known) == 1 else None

    @staticmethod
    def _rank(tensor):
        return tensor.shape.rank

    def _batch_inputs(self, op, in_axes, data=None):
        """[(index, tensor, BatchAxis | UNKNOWN)] of the inputs that depend on the batch."""
        indices = range(len(op.inputs)) if data is None else data
        return [(i, op.inputs[i], in_axes[i]) for i in indices if in_axes[i] is not None]

    def _only_data_input(self, op, in_axes, data_index):
        """The BatchAxis of input `data_index`, UNKNOWN, or None (not from the batch);
        UNKNOWN too when another input depends on the batch (e.g. a computed axis)."""
        others = [a for i, a in enumerate(in_axes) if i != data_index and a is not None]
        axis = in_axes[data_index]
        if others:
            return UNKNOWN
        return axis

    @staticmethod
    def _normalize(axis, rank):
        axis = int(axis)
        return axis + rank if axis < 0 else axis

    def _batch_axis_words(self, op, tensor, axis):
        return f"axis {axis}, the batch axis of its input {_describe(tensor)}"

    # -- elementwise, layout -------------------------------------------------------

    def _elementwise(self, op, in_axes):
        out_rank = self._rank(op.outputs[0])
        if out_rank is None:
            return [UNKNOWN] * len(op.outputs)
        placed = {}
        for _, tensor, axis in self._batch_inputs(op, in_axes):
            rank = self._rank(tensor)
            if axis is UNKNOWN or rank is None:
                return [UNKNOWN] * len(op.outputs)
            # broadcasting aligns shapes on the right
            placed.setdefault(axis.index + out_rank - rank, tensor)
        if len(placed) > 1:
            (p, first), (q, second) = sorted(placed.items())[:2]
            raise _Coupled(
                f"combines the batch axis of {_describe(first)} (output axis {p}) with the "
                f"batch axis of {_describe(second)} (output axis {q}), pairing every example "
                "with every other by broadcasting", _CONTRACTION_ADVICE)
        (index,) = placed
        return [index] * len(op.outputs)

    def _select(self, op, in_axes):
        """v1 Select: a vector condition picks rows (axis 0) of higher-rank operands;
        otherwise the shapes match."""
        condition, rank = op.inputs[0], self._rank(op.inputs[1])
        if in_axes[0] is None or self._rank(condition) != 1 or rank in (None, 1):
            return self._elementwise(op, in_axes)
        indices = {a if a is UNKNOWN else a.index for a in in_axes if a is not None}
        return [0] if indices == {0} else [UNKNOWN]

    def _identity_n(self, op, in_axes):
        return list(in_axes)

    def _switch(self, op, in_axes):
        """TF1 cond: both outputs carry the data; a batch-dependent predicate is lost."""
        if in_axes[1] is not None:
            return [UNKNOWN, UNKNOWN]
        return [in_axes[0], in_axes[0]]

    def _merge(self, op, in_axes):
        """TF1 cond: the value of whichever branch ran (output 1 is its index)."""
        axis = None
        for a in in_axes:
            axis = _merge(axis, a)
        return [axis, None]

    def _transpose(self, op, in_axes):
        axis = self._only_data_input(op, in_axes, 0)
        perm = _static(op.inputs[1])
        if axis is UNKNOWN or perm is None:
            return [UNKNOWN]
        return [list(perm.tolist()).index(axis.index)]

    def _expand_dims(self, op, in_axes):
        axis = self._only_data_input(op, in_axes, 0)
        dim = _static(op.inputs[1])
        rank = self._rank(op.inputs[0])
        if axis is UNKNOWN or dim is None or rank is None:
            return [UNKNOWN]
        dim = int(np.reshape(dim, [-1])[0])
        dim = dim + rank + 1 if dim < 0 else dim
        return [axis.index if axis.index < dim else axis.index + 1]

    def _squeeze(self, op, in_axes):
        axis = in_axes[0]
        rank = self._rank(op.inputs[0])
        if axis is UNKNOWN or rank is None:
            return [UNKNOWN]
        dims = [self._normalize(d, rank) for d in op.get_attr("squeeze_dims")]
        if not dims:
            shape = op.inputs[0].shape.as_list()
            dims = [i for i, size in enumerate(shape) if size == 1]
            if self._rank(op.outputs[0]) != rank - len(dims):
                return [UNKNOWN]
        if axis.index in dims:
            return [UNKNOWN]
        return [axis.index - sum(1 for d in dims if d < axis.index)]

    def _concat(self, op, in_axes):
        if op.type == "ConcatV2":
            data, axis_tensor = list(range(len(op.inputs) - 1)), op.inputs[-1]
        else:
            data, axis_tensor = list(range(1, len(op.inputs))), op.inputs[0]
        axis_index = len(op.inputs) - 1 if op.type == "ConcatV2" else 0
        along = _static(axis_tensor)
        if along is None or in_axes[axis_index] is not None:
            return [UNKNOWN]
        indices = set()
        for _, tensor, axis in self._batch_inputs(op, in_axes, data):
            rank = self._rank(tensor)
            if axis is UNKNOWN or rank is None:
                return [UNKNOWN]
            if self._normalize(along, rank) == axis.index:
                # joined along the batch axis: rows stop following the batch; the
                # towers' row check reports it.
                return [UNKNOWN]
            indices.add(axis.index)
        return [indices.pop()] if len(indices) == 1 else [UNKNOWN]

    def _pack(self, op, in_axes):
        rank = self._rank(op.inputs[0])
        if rank is None:
            return [UNKNOWN]
        along = self._normalize(op.get_attr("axis"), rank + 1)
        indices = set()
        for _, _, axis in self._batch_inputs(op, in_axes):
            if axis is UNKNOWN:
                return [UNKNOWN]
            indices.add(axis.index if axis.index < along else axis.index + 1)
        return [indices.pop()] if len(indices) == 1 else [UNKNOWN]

    def _unpack(self, op, in_axes):
        axis, rank = in_axes[0], self._rank(op.inputs[0])
        if axis is UNKNOWN or rank is None:
            return [UNKNOWN] * len(op.outputs)
        along = self._normalize(op.get_attr("axis"), rank)
        if along == axis.index:
            return [UNKNOWN] * len(op.outputs)
        index = axis.index if axis.index < along else axis.index - 1
        return [index] * len(op.outputs)

    def _split(self, op, in_axes):
        data, axis_index = (1, 0) if op.type == "Split" else (0, 2)
        axis = self._only_data_input(op, in_axes, data)
        along, rank = _static(op.inputs[axis_index]), self._rank(op.inputs[data])
        if axis is UNKNOWN or along is None or rank is None:
            return [UNKNOWN] * len(op.outputs)
        if self._normalize(along, rank) == axis.index:
            return [UNKNOWN] * len(op.outputs)
        return [axis.index] * len(op.outputs)

    def _tile(self, op, in_axes):
        axis = self._only_data_input(op, in_axes, 0)
        multiples = _static(op.inputs[1])
        if axis is UNKNOWN or multiples is None or multiples[axis.index] != 1:
            return [UNKNOWN]
        return [axis.index]

    def _pad(self, op, in_axes):
        axis = self._only_data_input(op, in_axes, 0)
        paddings = _static(op.inputs[1])
        if axis is UNKNOWN or paddings is None or np.any(paddings[axis.index] != 0):
            return [UNKNOWN]
        return [axis.index]

    def _slice(self, op, in_axes):
        axis = self._only_data_input(op, in_axes, 0)
        begin, size = _static(op.inputs[1]), _static(op.inputs[2])
        if axis is UNKNOWN or begin is None or size is None:
            return [UNKNOWN]
        dim = tf.compat.dimension_value(op.inputs[0].shape[axis.index])
        b, s = int(begin[axis.index]), int(size[axis.index])
        if b == 0 and (s == -1 or (dim is not None and s == dim)):
            return [axis.index]
        raise _Coupled(
            f"slices along {self._batch_axis_words(op, op.inputs[0], axis.index)} "
            f"(begin {b}, size {s}), selecting examples by their position in the batch",
            _POSITION_ADVICE)

    def _strided_slice(self, op, in_axes):
        axis = self._only_data_input(op, in_axes, 0)
        x = op.inputs[0]
        rank = self._rank(x)
        begin, end, strides = (_static(t) for t in op.inputs[1:4])
        if axis is UNKNOWN or rank is None or begin is None or end is None or strides is None:
            return [UNKNOWN]
        masks = {name: op.get_attr(name) for name in
                 ("begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask",
                  "shrink_axis_mask")}
        a = axis.index
        dim = tf.compat.dimension_value(x.shape[a])
        in_dim, out_dim, n = 0, 0, len(begin)
        for i in range(n):
            if _bit(masks["ellipsis_mask"], i):
                remaining = sum(1 for j in range(i + 1, n)
                                if not _bit(masks["new_axis_mask"], j))
                stop = rank - remaining
                if in_dim <= a < stop:
                    return [out_dim + a - in_dim]
                out_dim += stop - in_dim
                in_dim = stop
            elif _bit(masks["new_axis_mask"], i):
                out_dim += 1
            else:
                shrink = _bit(masks["shrink_axis_mask"], i)
                if in_dim == a:
                    stride = int(strides[i])
                    starts_at_first = _bit(masks["begin_mask"], i) or int(begin[i]) == 0
                    ends_at_last = _bit(masks["end_mask"], i) or int(end[i]) >= _INT32_MAX or (
                        dim is not None and int(end[i]) >= dim)
                    if not shrink and stride == 1 and starts_at_first and ends_at_last:
                        return [out_dim]
                    what = ("takes one example" if shrink else
                            "reverses the order of the examples" if stride == -1 and
                            _bit(masks["begin_mask"], i) and _bit(masks["end_mask"], i)
                            else "selects examples by their position in the batch")
                    raise _Coupled(
                        f"indexes {self._batch_axis_words(op, x, a)} (begin {int(begin[i])}, "
                        f"end {int(end[i])}, stride {stride}): it {what}", _POSITION_ADVICE)
                if not shrink:
                    out_dim += 1
                in_dim += 1
        return [out_dim + a - in_dim]

    # -- gathers -------------------------------------------------------------------

    def _gather(self, op, in_axes):
        params, indices = op.inputs[0], op.inputs[1]
        p_axis, i_axis = in_axes[0], in_axes[1]
        if op.type == "GatherV2":
            if in_axes[2] is not None:
                return [UNKNOWN]
            along = _static(op.inputs[2])
            batch_dims = op.get_attr("batch_dims")
        else:
            along = 0
            batch_dims = op.get_attr("batch_dims") if op.type == "ResourceGather" else 0
        p_rank = None if op.type == "ResourceGather" else self._rank(params)
        i_rank = self._rank(indices)
        if p_axis is UNKNOWN or i_axis is UNKNOWN or along is None or i_rank is None:
            return [UNKNOWN]
        if op.type != "ResourceGather":
            if p_rank is None:
                return [UNKNOWN]
            along = self._normalize(along, p_rank)
        batch_dims = self._normalize(batch_dims, i_rank) if batch_dims < 0 else batch_dims
        if p_axis is not None:
            a = p_axis.index
            if a < batch_dims:
                if i_axis is None or i_axis.index == a:
                    return [a]
                return [UNKNOWN]
            if a == along:
                raise _Coupled(
                    f"gathers along {self._batch_axis_words(op, params, a)} with the indices "
                    f"{_describe(indices)}, picking examples by index", _POSITION_ADVICE)
            if i_axis is not None:
                return [UNKNOWN]
            return [a if a < along else a + i_rank - 1 - batch_dims]
        q = i_axis.index
        if q < batch_dims:
            return [UNKNOWN]
        return [along + q - batch_dims]

    def _gather_nd(self, op, in_axes):
        if in_axes[0] is not None or in_axes[1] is UNKNOWN:
            return [UNKNOWN]
        rank = self._rank(op.inputs[1])
        if rank is None or in_axes[1].index >= rank - 1:
            return [UNKNOWN]
        return [in_axes[1].index]

    def _one_hot(self, op, in_axes):
        axis = self._only_data_input(op, in_axes, 0)
        rank = self._rank(op.inputs[0])
        if axis is UNKNOWN or rank is None:
            return [UNKNOWN]
        along = op.get_attr("axis")
        along = rank if along == -1 else along
        return [axis.index if axis.index < along else axis.index + 1]

    # -- reductions and ops along one axis -----------------------------------------

    def _reduction(self, op, in_axes):
        axis = self._only_data_input(op, in_axes, 0)
        x = op.inputs[0]
        rank = self._rank(x)
        reduced = _static(op.inputs[1])
        keep = op.get_attr("keep_dims")
        if reduced is None or rank is None:
            return [UNKNOWN]
        reduced = sorted({self._normalize(r, rank) for r in np.reshape(reduced, [-1])})
        if axis is UNKNOWN:
            if rank > 0 and reduced == list(range(rank)):
                raise _Coupled(
                    f"reduces ({op.type}) over every axis of {_describe(x)}, which is "
                    "computed from the batch, so over its batch axis too",
                    _advice_for(op, _REDUCTION_ADVICE))
            return [UNKNOWN]
        if axis.index in reduced:
            raise _Coupled(f"reduces ({op.type}) over {self._batch_axis_words(op, x, axis.index)}",
                           _advice_for(op, _REDUCTION_ADVICE))
        return [axis.index if keep else axis.index - sum(1 for r in reduced if r < axis.index)]

    def _l2_loss(self, op, in_axes):
        raise _Coupled(f"sums the squares of every entry of {_describe(op.inputs[0])}, "
                       "whose rows are the examples", _REDUCTION_ADVICE)

    def _arg_reduction(self, op, in_axes):
        axis = self._only_data_input(op, in_axes, 0)
        rank = self._rank(op.inputs[0])
        along = _static(op.inputs[1])
        if axis is UNKNOWN or rank is None or along is None:
            return [UNKNOWN]
        along = self._normalize(along, rank)
        if along == axis.index:
            raise _Coupled(
                f"takes the {op.type} over {self._batch_axis_words(op, op.inputs[0], along)}",
                _REDUCTION_ADVICE)
        return [axis.index if axis.index < along else axis.index - 1]

    def _last_axis(self, op, in_axes):
        axis = self._only_data_input(op, in_axes, 0)
        rank = self._rank(op.inputs[0])
        if axis is UNKNOWN or rank is None:
            return [UNKNOWN] * len(op.outputs)
        if axis.index == rank - 1:
            what = "normalizes" if "Softmax" in op.type else "sorts or ranks"
            raise _Coupled(
                f"{what} ({op.type}) along its last axis, which is "
                f"{self._batch_axis_words(op, op.inputs[0], axis.index)}",
                _REDUCTION_ADVICE if "Softmax" in op.type else _POSITION_ADVICE)
        return [axis.index] * len(op.outputs)

    def _cumulative(self, op, in_axes):
        axis = self._only_data_input(op, in_axes, 0)
        rank = self._rank(op.inputs[0])
        along = _static(op.inputs[1])
        if axis is UNKNOWN or rank is None or along is None:
            return [UNKNOWN]
        if self._normalize(along, rank) == axis.index:
            raise _Coupled(
                f"accumulates ({op.type}) along "
                f"{self._batch_axis_words(op, op.inputs[0], axis.index)}, so each example's "
                "entry holds the examples before it", _REDUCTION_ADVICE)
        return [axis.index]

    def _reverse(self, op, in_axes):
        return self._along_axes(op, in_axes, 1, "reverses the order of the examples")

    def _roll(self, op, in_axes):
        if in_axes[1] is not None:
            return [UNKNOWN]
        return self._along_axes(op, in_axes, 2, "shifts examples to other positions")

    def _along_axes(self, op, in_axes, axes_index, what):
        axis = self._only_data_input(op, in_axes, 0)
        rank = self._rank(op.inputs[0])
        along = _static(op.inputs[axes_index])
        if axis is UNKNOWN or rank is None or along is None:
            return [UNKNOWN]
        if axis.index in {self._normalize(a, rank) for a in np.reshape(along, [-1])}:
            raise _Coupled(
                f"works along {self._batch_axis_words(op, op.inputs[0], axis.index)}: it "
                f"{what}", _POSITION_ADVICE)
        return [axis.index]

    def _random_shuffle(self, op, in_axes):
        if in_axes[0] is not UNKNOWN and in_axes[0].index == 0:
            raise _Coupled(f"shuffles {_describe(op.inputs[0])} along axis 0, its batch axis",
                           _POSITION_ADVICE)
        return [UNKNOWN]

    def _cross_entropy(self, op, in_axes):
        for _, tensor, axis in self._batch_inputs(op, in_axes):
            if axis is UNKNOWN:
                return [UNKNOWN, UNKNOWN]
            rank = self._rank(tensor)
            if rank is not None and rank >= 2 and axis.index == rank - 1:
                raise _Coupled(
                    f"takes a softmax along the class axis, which is "
                    f"{self._batch_axis_words(op, tensor, axis.index)}", _REDUCTION_ADVICE)
            if axis.index != 0:
                return [UNKNOWN, UNKNOWN]
        return [0, 0]

    # -- products ------------------------------------------------------------------

    def _contracted(self, op, tensor, a):
        raise _Coupled(
            f"contracts (sums over) {self._batch_axis_words(op, tensor, a)}, e.g. x^T x",
            _CONTRACTION_ADVICE)

    def _paired(self, op):
        raise _Coupled(
            f"multiplies two tensors from the batch, {_describe(op.inputs[0])} and "
            f"{_describe(op.inputs[1])}, across examples (e.g. x x^T): each example's "
            "row holds every other example", _CONTRACTION_ADVICE)

    def _matmul(self, op, in_axes):
        a_axis, b_axis = in_axes[0], in_axes[1]
        if a_axis is UNKNOWN or b_axis is UNKNOWN:
            return [UNKNOWN]
        out = set()
        if a_axis is not None:
            rows = 1 if op.get_attr("transpose_a") else 0
            if a_axis.index != rows:
                self._contracted(op, op.inputs[0], a_axis.index)
            out.add(0)
        if b_axis is not None:
            columns = 0 if op.get_attr("transpose_b") else 1
            if b_axis.index != columns:
                self._contracted(op, op.inputs[1], b_axis.index)
            out.add(1)
        if len(out) > 1:
            self._paired(op)
        return [out.pop()]

    def _batch_matmul(self, op, in_axes):
        out_rank = self._rank(op.outputs[0])
        if out_rank is None or UNKNOWN in in_axes[:2]:
            return [UNKNOWN]
        adjoint = {0: op.get_attr("adj_x"), 1: op.get_attr("adj_y")}
        out = set()
        for i, tensor, axis in self._batch_inputs(op, in_axes, [0, 1]):
            rank = self._rank(tensor)
            if rank is None:
                return [UNKNOWN]
            a = axis.index
            if a < rank - 2:
                out.add(a + out_rank - rank)
                continue
            kept = (rank - 1 if adjoint[i] else rank - 2) if i == 0 else (
                rank - 2 if adjoint[i] else rank - 1)
            if a != kept:
                self._contracted(op, tensor, a)
            out.add(out_rank - 2 if i == 0 else out_rank - 1)
        if len(out) > 1:
            self._paired(op)
        return [out.pop()]

    def _einsum(self, op, in_axes):
        equation = op.get_attr("equation")
        equation = (equation.decode() if isinstance(equation, bytes) else equation).replace(" ", "")
        ranks = [self._rank(t) for t in op.inputs]
        if UNKNOWN in in_axes or None in ranks:
            return [UNKNOWN]
        lhs, _, rhs = equation.partition("->")
        subscripts = lhs.split(",")
        if len(subscripts) != len(op.inputs):
            return [UNKNOWN]
        ellipsis = max((r - len(s.replace("...", "")) for s, r in zip(subscripts, ranks)
                        if "..." in s), default=0)

        def labels(subscript, rank):
            if "..." not in subscript:
                return list(subscript)
            before, after = subscript.split("...")
            n = rank - len(before) - len(after)
            return list(before) + [("...", ellipsis - n + j) for j in range(n)] + list(after)

        in_labels = [labels(s, r) for s, r in zip(subscripts, ranks)]
        if "->" in equation:
            out_labels = labels(rhs, len(rhs.replace("...", "")) + ellipsis)
        else:
            counts = collections.Counter(l for ls in in_labels for l in ls if isinstance(l, str))
            out_labels = [("...", j) for j in range(ellipsis)] + sorted(
                l for l, c in counts.items() if c == 1)
        out = {}
        for i, tensor, axis in self._batch_inputs(op, in_axes):
            label = in_labels[i][axis.index]
            if label not in out_labels:
                raise _Coupled(
                    f"sums over the einsum index {label!r} of {equation!r}, which is "
                    f"{self._batch_axis_words(op, tensor, axis.index)}", _CONTRACTION_ADVICE)
            out.setdefault(out_labels.index(label), tensor)
        if len(out) > 1:
            self._paired(op)
        return [next(iter(out))]

    # -- images and normalization --------------------------------------------------

    def _convolution(self, op, in_axes):
        data = _CONVOLUTION_OP_TYPES[op.type]
        axis = self._only_data_input(op, in_axes, data)
        if axis is UNKNOWN:
            return [UNKNOWN] * len(op.outputs)
        if axis.index == 0:
            return [0] * len(op.outputs)
        raise _Coupled(
            f"slides its window (or mixes channels) along "
            f"{self._batch_axis_words(op, op.inputs[data], axis.index)}; the batch axis of an "
            "image op must be axis 0", _CONTRACTION_ADVICE)

    def _pool(self, op, in_axes):
        axis = self._only_data_input(op, in_axes, 0)
        if axis is UNKNOWN:
            return [UNKNOWN] * len(op.outputs)
        try:
            data_format = op.get_attr("data_format")
        except ValueError:  # LRN, MaxPoolWithArgmax: always NHWC
            data_format = "NHWC"
        data_format = data_format.decode() if isinstance(data_format, bytes) else data_format
        rank = self._rank(op.inputs[0]) or 4
        channel = 1 if data_format.startswith("NC") else rank - 1
        if axis.index == 0 or (axis.index == channel and op.type != "LRN") or (
                op.type == "LRN" and axis.index != channel):
            return [axis.index] * len(op.outputs)
        raise _Coupled(
            f"pools ({op.type}) along {self._batch_axis_words(op, op.inputs[0], axis.index)}",
            _REDUCTION_ADVICE)

    def _fused_batch_norm(self, op, in_axes):
        axis = in_axes[0]
        outs = [None] * len(op.outputs)
        if any(a is not None for a in in_axes[1:]) or axis is UNKNOWN:
            # statistics from the batch, or an axis we lost: silent
            return [UNKNOWN] + outs[1:]
        data_format = op.get_attr("data_format")
        data_format = data_format.decode() if isinstance(data_format, bytes) else data_format
        rank = self._rank(op.inputs[0]) or 4
        channel = 1 if data_format.startswith("NC") else rank - 1
        if op.get_attr("is_training") and axis.index != channel:
            raise _Coupled(
                "normalizes each channel with the mean and variance over the whole batch "
                f"(is_training=True), reducing {self._batch_axis_words(op, op.inputs[0], axis.index)}",
                _BATCH_NORM_ADVICE)
        outs[0] = axis.index
        return outs

    # -- function bodies -----------------------------------------------------------

    def _body_axes(self, op, function_attr, inputs, in_axes):
        """Scans the function named by `function_attr` with `inputs` carrying `in_axes`;
        returns the axes of its outputs. A coupling inside is reported on `op`."""
        if self.depth > 8:
            return None
        try:
            name = op.get_attr(function_attr).name
            function = op.graph._get_function(name)  # pylint: disable=protected-access
            body = function_def_to_graph.function_def_to_graph(function.cached_definition)
        except (AttributeError, ValueError, TypeError, KeyError):
            return None
        seeds = [(arg, axis) for arg, axis in zip(body.inputs, in_axes) if axis is not None]
        inner = _BatchAxisScan(seeds, self.depth + 1)
        couplings = inner.run(body.get_operations())
        if couplings:
            first = couplings[0]
            raise _Coupled(
                f"runs the function {name!r}, whose op {first.op.name!r} ({first.op.type}) "
                f"{first.reason}", first.advice)
        return [inner.axis_of(t) for t in body.outputs]

    def _cond(self, op, in_axes):
        if in_axes[0] is not None:  # the branch taken depends on the batch
            return [UNKNOWN] * len(op.outputs)
        branches = [self._body_axes(op, attr, op.inputs[1:], in_axes[1:])
                    for attr in ("then_branch", "else_branch")]
        if any(b is None for b in branches):
            return [UNKNOWN] * len(op.outputs)
        return [a if a == b else UNKNOWN for a, b in zip(*branches)]

    def _call(self, op, in_axes):
        outs = self._body_axes(op, "f", op.inputs, in_axes)
        return [UNKNOWN] * len(op.outputs) if outs is None else outs

    def _while(self, op, in_axes):
        """The body maps loop variables to their next values: iterate its scan until
        the batch axes of the loop variables stop changing."""
        axes = list(in_axes)
        for _ in range(4):
            outs = self._body_axes(op, "body", op.inputs, axes)
            if outs is None or len(outs) != len(axes):
                return [UNKNOWN] * len(op.outputs)
            merged = [_merge(a, b) for a, b in zip(axes, outs)]
            if merged == axes:
                return axes
            axes = merged
        return [UNKNOWN] * len(op.outputs)

    # A TensorList (the variant a while loop carries, e.g. the time steps of a Keras
    # RNN) holds the BatchAxis of its *elements*.

    def _list_from_tensor(self, op, in_axes):
        axis = self._only_data_input(op, in_axes, 0)
        if axis is UNKNOWN or axis.index == 0:  # a list over the examples themselves
            return [UNKNOWN]
        return [BatchAxis(axis.index - 1, axis.per_example)]

    def _list_get_item(self, op, in_axes):
        axis = self._only_data_input(op, in_axes, 0)
        return [UNKNOWN if axis is None else axis]

    def _list_set_item(self, op, in_axes):
        if in_axes[1] is not None:
            return [UNKNOWN]
        return [_merge(in_axes[0], in_axes[2])]

    def _list_stack(self, op, in_axes):
        axis = self._only_data_input(op, in_axes, 0)
        if axis is UNKNOWN:
            return [UNKNOWN]
        return [BatchAxis(axis.index + 1, axis.per_example)]

    # -- reshape -------------------------------------------------------------------

    def _reshape(self, op, in_axes):
        axis = self._only_data_input(op, in_axes, 0)
        x, out = op.inputs[0], op.outputs[0]
        if axis is UNKNOWN or x.shape.rank is None:
            return [UNKNOWN]
        a = axis.index
        in_shape = x.shape.as_list()
        # entries per example: per_example * product of the dims after the batch axis
        after = in_shape[a + 1:]
        N = None if axis.per_example is None or None in after else (
            axis.per_example * int(np.prod(after, dtype=np.int64)))
        target = self._shape_value(op.inputs[1])
        if target is not None:
            target = self._resolve_minus_one(target)
        if target is not None:
            batched = [k for k, (_, power) in enumerate(target) if power == 1]
            if len(batched) == 1:
                k = batched[0]
                if a == 0 or all(s == 1 for s in in_shape[:a]):
                    # batch-major input: the output must be batch-major at k
                    if all(d == (1, 0) for d in target[:k]):
                        return [self._per_example(N, target[k + 1:], k)]
                elif target[:a] == [(s, 0) for s in in_shape[:a]] and k == a:
                    return [BatchAxis(a, None)]
                return [UNKNOWN]
        # static fall-back (e.g. a batch size baked into a constant shape): the dims up
        # to and including the batch axis are unchanged
        out_shape = out.shape.as_list() if out.shape.rank is not None else None
        if (out_shape is not None and len(out_shape) > a and None not in in_shape[:a + 1]
                and in_shape[:a + 1] == out_shape[:a + 1]):
            return [BatchAxis(a, axis.per_example)]
        return [UNKNOWN]

    @staticmethod
    def _per_example(N, after_dims, k):
        """BatchAxis k of a reshape's output; UNKNOWN when rows would straddle examples."""
        if N is None or any(c is None for c, _ in after_dims):
            return BatchAxis(k, None)
        row = int(np.prod([c for c, _ in after_dims], dtype=np.int64))
        if row == 0 or N % row:
            return UNKNOWN
        return BatchAxis(k, N // row)

    @staticmethod
    def _resolve_minus_one(target):
        """Replaces a -1 entry by (coefficient unknown, batch power): it holds the batch
        exactly when no other entry does."""
        minus = [k for k, d in enumerate(target) if d == (-1, 0)]
        if not minus:
            return target
        if len(minus) > 1:
            return None
        power = 0 if any(p == 1 for _, p in target) else 1
        return [(None, power) if k == minus[0] else d for k, d in enumerate(target)]

    def _shape_value(self, tensor):
        """A 1-D int tensor describing a shape, as a list of (coefficient, batch power):
        the entry is coefficient * B ** power; coefficient None when not known. None
        when the tensor cannot be followed."""
        key = tensor.ref()
        if key in self.shape_values:
            return self.shape_values[key]
        self.shape_values[key] = None  # guards against cycles
        value = self._evaluate_shape(tensor)
        self.shape_values[key] = value
        return value

    def _evaluate_shape(self, tensor):
        op = tensor.op
        if op.type == "Shape":
            x = op.inputs[0]
            axis = self.axis_of(x)
            if axis is UNKNOWN or x.shape.rank is None:
                return None
            dims = [(d, 0) for d in x.shape.as_list()]
            if axis is None:
                return dims if all(d is not None for d, _ in dims) else None
            dims[axis.index] = (axis.per_example, 1)
            return [(None, 0) if d[0] is None and d[1] == 0 else d for d in dims]
        if op.type in ("Identity", "Cast"):
            return self._shape_value(op.inputs[0])
        if op.type in ("Pack", "ConcatV2"):
            parts = op.inputs if op.type == "Pack" else op.inputs[:-1]
            if op.type == "ConcatV2" and _static(op.inputs[-1]) not in (0, -1):
                return None
            values = []
            for part in parts:
                v = self._shape_value(part)
                if v is None:
                    return None
                values.extend(v)
            return values
        if op.type in ("StridedSlice", "Slice", "GatherV2", "Prod", "Mul", "FloorDiv"):
            return self._evaluate_shape_arithmetic(op)
        value = _static(tensor)
        if value is None or value.dtype.kind not in "iu":
            return None
        return [(int(v), 0) for v in np.reshape(value, [-1])]

    def _evaluate_shape_arithmetic(self, op):
        source = self._shape_value(op.inputs[0])
        if source is None:
            return None
        if op.type == "StridedSlice":
            begin, end, strides = (_static(t) for t in op.inputs[1:4])
            if (begin is None or end is None or strides is None or len(begin) != 1
                    or op.get_attr("ellipsis_mask") or op.get_attr("new_axis_mask")):
                return None
            start = None if op.get_attr("begin_mask") & 1 else int(begin[0])
            stop = None if op.get_attr("end_mask") & 1 else int(end[0])
            if op.get_attr("shrink_axis_mask") & 1:
                return [source[start]] if start is not None and -len(source) <= start < len(source) else None
            return source[start:stop:int(strides[0])]
        if op.type == "Slice":
            begin, size = _static(op.inputs[1]), _static(op.inputs[2])
            if begin is None or size is None or begin.size != 1:
                return None
            start, length = int(begin.reshape(-1)[0]), int(size.reshape(-1)[0])
            return source[start:] if length == -1 else source[start:start + length]
        if op.type == "FloorDiv":  # a scalar over a constant
            divisor = _static(op.inputs[1])
            if len(source) != 1 or divisor is None or divisor.size != 1:
                return None
            (coefficient, power), divisor = source[0], int(divisor.reshape(-1)[0])
            if coefficient is None or divisor == 0 or coefficient % divisor:
                return None
            return [(coefficient // divisor, power)]
        if op.type == "GatherV2":
            indices = _static(op.inputs[1])
            if indices is None or _static(op.inputs[2]) != 0:
                return None
            return [source[int(i)] for i in np.reshape(indices, [-1])]
        if op.type == "Prod":
            product = (1, 0)
            for d in source:
                product = _multiply(product, d)
            return [product] if product is not None else None
        other = self._shape_value(op.inputs[1])  # Mul of two scalars
        if other is None or len(source) != 1 or len(other) != 1:
            return None
        product = _multiply(source[0], other[0])
        return [product] if product is not None else None


def _topological(ops):
    """`ops` with every op after the ops it reads (creation order breaks ties; a TF1
    cond adds an op's Switch inputs after the op, so creation order alone is not
    enough). Back edges of TF1 loops are ignored."""
    ops = set(ops)
    ordered, done, active = [], set(), set()
    for root in sorted(ops, key=lambda o: o._id):  # pylint: disable=protected-access
        stack = [(root, False)]
        while stack:
            op, expanded = stack.pop()
            if expanded:
                active.discard(op)
                if op not in done:
                    done.add(op)
                    ordered.append(op)
                continue
            if op in done or op in active:
                continue
            active.add(op)
            stack.append((op, True))
            for t in reversed(list(op.inputs)):
                if t.op in ops and t.op not in done and t.op not in active:
                    stack.append((t.op, False))
    return ordered


def _merge(first, second):
    """The batch axis of a value that is `first` or `second` (None: no batch)."""
    if first is None:
        return second
    if second is None or first == second:
        return first
    if UNKNOWN in (first, second) or first.index != second.index:
        return UNKNOWN
    return BatchAxis(first.index, None)


def _multiply(first, second):
    coefficient = (None if first[0] is None or second[0] is None
                   else first[0] * second[0])
    power = first[1] + second[1]
    return None if power > 1 else (coefficient, power)


def _advice_for(op, advice):
    name = op.name.lower()
    if "batch_norm" in name or "batchnorm" in name or "moments" in name:
        return _BATCH_NORM_ADVICE
    return advice


def find_couplings(replayed_ops, batch):
    """The ops among `replayed_ops` that couple the examples of the batch.

    Args:
      replayed_ops: the ops between the batch and `ys` (a method's replayed set S).
      batch: the batch tensors, [B, ...] each; their axis 0 is the batch axis.

    Returns:
      A list of `Coupling` records in graph order (empty when none was found).

    Example:
      couplings = pertower._batch_axis.mixing.find_couplings(ops, [x])
      for c in couplings: print(c.op.name, c.reason)
    """
    return _BatchAxisScan([(b, BatchAxis(0, 1)) for b in batch]).run(replayed_ops)


def check_examples_independent(replayed_ops, batch, num_towers=None,
                               function_name="per_example_gradients"):
    """Raises ValueError naming the first op of `replayed_ops` that couples examples.

    Args:
      replayed_ops: the ops between the batch and `ys` (a method's replayed set S).
      batch: the batch tensors, [B, ...] each.
      num_towers: T, the number of slices computed on their own; with T = 1 (one
        microbatch holding the whole batch) coupling changes nothing and no check runs.
      function_name: the public function named in the message.
    """
    if num_towers == 1:
        return
    couplings = find_couplings(replayed_ops, batch)
    if couplings:
        raise ValueError(couplings[0].message(function_name))

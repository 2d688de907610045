"""Row layouts: which rows of each tensor between the batch and `ys` belong to which example.

Notation (as in every core module):
    B   examples in the batch          k   rows per example on a tensor's batch axis
    E   elements per example           A   a layer's input, dZ the gradient at its output

A per-op rule (see `pertower.rules`) may use the batched activations and the batched
dZ only when both facts below are certain; this module establishes them, or says it
cannot:

1. *Which rows belong to which example.* A tensor has the layout `Rows(lead, k, E)`
   when its flat (row-major) data is B contiguous blocks of E elements, block i
   computed from example i alone, its axes before `lead` have static size 1, and its
   axis `lead` holds k rows per example (rows i*k ... i*k+k-1 are example i's). A
   Keras Dense layer on [B, T, d] lowers to Reshape([B, T, d] -> [B*T, d]), MatMul,
   Reshape back: the MatMul's input has the layout Rows(0, T, T*d).
2. *Row i of `ys` depends on example i alone.* Layouts are propagated forward from the
   batch tensors (Rows(0, 1, ...)) through ops whose row structure is known (pointwise
   ops, broadcasts against batch-independent tensors, reductions and slices off the
   batch axis, convolutions, matmuls with a batch-independent right operand, reshapes
   checked against static shapes, ...). Any other op between the batch and `ys` has no
   layout; then `ys` has none either and the rules are not used. When `ys` has
   Rows(0, 1, .), every tensor on a path from the batch to `ys` was built from its own
   example's block only, so dZ's rows for example i are d ys[i] / dZ.

A functional `If` (tf.cond; Keras Dropout with training=None) whose predicate does not
depend on the batch is analysed through both branch functions; its outputs keep the
layout both branches agree on. Noise drawn with the shape of a batch tensor
(`tf.random.uniform(tf.shape(x))`, dropout) is laid out like x: each example owns its
draws, and the rules differentiate the same draws as `ys` in the same run.

A tensor that carries the batch only through its *shape* (`tf.shape(x)`) gets the
marker META: it may feed the shape argument of a Reshape (whose result is checked
against static shapes) but nothing that computes values.
"""

import collections

import numpy as np
import tensorflow as tf

from pertower import _graph_walk as graph_walk


class Rows(collections.namedtuple("Rows", ["lead", "k", "E"])):
    """The layout of one tensor (see the module docstring); k and E may be None
    (not known statically)."""


# Marker for tensors that depend on the batch only through shapes (e.g. tf.shape(x)).
META = "meta"

_POINTWISE_UNARY = frozenset({
    "Identity", "Snapshot", "StopGradient", "PreventGradient", "CheckNumerics", "Cast",
    "Relu", "Relu6", "Elu", "Selu", "LeakyRelu", "Tanh", "Sigmoid", "Softplus", "Softsign",
    "Exp", "Expm1", "Log", "Log1p", "Neg", "Square", "Sqrt", "Rsqrt", "Abs", "Sign",
    "Sin", "Cos", "Erf", "Erfc", "Reciprocal", "Inv", "Floor", "Ceil", "Round",
    "ZerosLike", "OnesLike", "IsFinite", "IsNan", "LogicalNot",
})
_POINTWISE_BROADCAST = frozenset({
    "Add", "AddV2", "Sub", "Mul", "RealDiv", "Div", "DivNoNan", "Maximum", "Minimum",
    "Pow", "SquaredDifference", "FloorDiv", "FloorMod", "Equal", "NotEqual", "Greater",
    "GreaterEqual", "Less", "LessEqual", "LogicalAnd", "LogicalOr", "SelectV2", "Select",
    "BiasAdd", "AddN",
})
_SHAPE_OPS = frozenset({"Shape", "ShapeN", "Size", "Rank"})
_REDUCTIONS = frozenset({"Sum", "Mean", "Max", "Min", "Prod", "All", "Any", "EuclideanNorm",
                         "ArgMax", "ArgMin"})
_LAST_AXIS_OPS = frozenset({"Softmax", "LogSoftmax"})
_POOLS = frozenset({"MaxPool", "AvgPool", "MaxPool3D", "AvgPool3D"})
_CONVOLUTIONS = frozenset({"Conv2D", "DepthwiseConv2dNative", "Conv3D", "Conv1D"})
_FUSED_BATCH_NORMS = frozenset({"FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"})
_LOSSES = frozenset({"SoftmaxCrossEntropyWithLogits", "SparseSoftmaxCrossEntropyWithLogits"})


class TensorMap:
    """A dict keyed by tensors through `tensor.ref()` (tensors of function graphs are
    not hashable)."""

    def __init__(self):
        self._items = {}

    def __contains__(self, tensor):
        return tensor.ref() in self._items

    def __getitem__(self, tensor):
        return self._items[tensor.ref()]

    def __setitem__(self, tensor, value):
        self._items[tensor.ref()] = value

    def get(self, tensor, default=None):
        return self._items.get(tensor.ref(), default)

    def items(self):
        return [(key.deref(), value) for key, value in self._items.items()]


class Analysis(collections.namedtuple("Analysis", ["layouts", "first_unknown"])):
    """The result of `analyze`.

    Fields:
      layouts: a `TensorMap` {tensor: Rows or META} for the tensors between the batch and `ys`
        whose layout is known (tensors that do not depend on the batch are absent).
      first_unknown: the first op (in graph order) that depends on the batch but whose
        outputs got no layout, or None.
    """

    def rows(self, tensor):
        """The Rows of `tensor` with k and E completed from its static shape, or None."""
        layout = self.layouts.get(tensor)
        if not isinstance(layout, Rows):
            return None
        return complete(layout, tensor.shape)


def _rest_size(shape, axis):
    """prod(shape[axis + 1:]) when static, else None."""
    if shape.rank is None:
        return None
    rest = shape[axis + 1:]
    return int(np.prod(rest.as_list(), dtype=np.int64)) if rest.is_fully_defined() else None


def complete(layout, shape):
    """Fills in k from E (or E from k) with the static shape; None when the rows would
    straddle examples (E not a multiple of the row size)."""
    if shape.rank is None or shape.rank <= layout.lead:
        return None
    rest = _rest_size(shape, layout.lead)
    lead, k, E = layout
    if rest is not None:
        if k is None and E is not None:
            if rest == 0 or E % rest:
                return None
            k = E // rest
        elif E is None and k is not None:
            E = k * rest
        elif k is not None and E is not None and k * rest != E:
            return None
    return Rows(lead, k, E)


def analyze(ys, batch, ys_upstream, static_batch_size, rule_registry=None):
    """Propagates row layouts from `batch` to `ys` over the ops `ys` depends on.

    Args:
      ys: the per-example values.
      batch: the batch tensors, each [B, ...] (layout Rows(0, 1, .)).
      ys_upstream: the ops `ys` depends on (graph_walk.upstream_ops).
      static_batch_size: B when known statically, else None (a leading static 1 axis is
        then never taken for the batch axis).
      rule_registry: a `pertower.rules.RuleRegistry`; ops it has a rule for may define
        their own layout (`Rule.output_layouts`).

    Returns:
      An `Analysis`.
    """
    layouts = TensorMap()
    for b in batch:
        rows = complete(Rows(0, 1, None), b.shape)
        if rows is not None:
            layouts[b] = rows
    batch_ops = {b.op for b in batch}
    region = graph_walk.downstream_ops(batch, ys_upstream)
    first_unknown = _propagate(region, layouts, list(batch), batch_ops, static_batch_size,
                               rule_registry)
    return Analysis(layouts, first_unknown)


def _propagate(region, layouts, seeds, skipped_ops, static_batch_size, rule_registry):
    """Fills `layouts` for the outputs of the ops in `region`, in graph order; returns
    the first op whose outputs got no layout, or None."""
    first_unknown = None
    for op in sorted(region, key=lambda o: o._id):  # pylint: disable=protected-access
        if op in skipped_ops and all(o in layouts for o in op.outputs):
            continue
        inputs = []
        for t in op.inputs:
            if t in layouts:
                inputs.append(layouts[t])
            elif t.op in region or any(t is b for b in seeds):
                inputs.append(None)  # depends on the batch, layout unknown
            else:
                inputs.append(INDEPENDENT)
        outputs = None
        rule = rule_registry.lookup(op.type) if rule_registry is not None else None
        if rule is not None and hasattr(rule, "output_layouts"):
            outputs = rule.output_layouts(op, inputs)
        if outputs is None:
            try:
                if op.type in _IF_OPS:
                    outputs = _if(op, inputs, static_batch_size, rule_registry)
                elif op.type in _RANDOM_OPS:
                    outputs = _random_like(op, inputs, layouts)
                else:
                    outputs = _output_layouts(op, inputs, static_batch_size)
            except (ValueError, TypeError, IndexError, KeyError, AttributeError):
                outputs = None   # an attribute or function this op lacks
        if outputs is None:
            if first_unknown is None:
                first_unknown = op
            continue
        for out, layout in zip(op.outputs, outputs):
            if layout is META:
                layouts[out] = META
            elif layout is not None:
                completed = complete(layout, out.shape)
                if completed is not None:
                    layouts[out] = completed
    return first_unknown


# Functional conditionals (tf.cond, Keras Dropout/BatchNormalization with training=None).
_IF_OPS = frozenset({"If", "StatelessIf"})
# Random ops whose shape argument may be tf.shape(x) of a batch-dependent x.
_RANDOM_OPS = frozenset({"RandomUniform", "RandomStandardNormal", "TruncatedNormal",
                         "StatelessRandomUniform", "StatelessRandomUniformV2",
                         "StatelessRandomNormal", "StatelessRandomNormalV2",
                         "StatelessTruncatedNormal", "StatelessTruncatedNormalV2"})


def _random_like(op, inputs, layouts):
    """Noise drawn with the shape of a batch-dependent x (`tf.random.uniform(tf.shape(x))`,
    Keras dropout): one independent draw per entry, so its rows are laid out like x's
    (and the rules use the same draws as `ys` in the same run)."""
    shape_op = op.inputs[0].op
    if shape_op.type != "Shape" or any(layout is not INDEPENDENT for layout in inputs[1:]):
        return None
    source = layouts.get(shape_op.inputs[0])
    return [source] if isinstance(source, Rows) else None


def _if(op, inputs, static_batch_size, rule_registry):
    """An If whose predicate does not depend on the batch: each output's layout is the
    one both branch functions give it (analysed like the outer graph), if they agree."""
    if inputs[0] is not INDEPENDENT:
        return None
    per_branch = []
    for attr in ("then_branch", "else_branch"):
        branch = op.graph._get_function(op.get_attr(attr).name).graph  # pylint: disable=protected-access
        if len(branch.inputs) != len(op.inputs) - 1:
            return None
        layouts, seeds = TensorMap(), []
        for t, layout in zip(branch.inputs, inputs[1:]):
            if layout is None:
                return None
            if layout is not INDEPENDENT:
                layouts[t] = layout
                seeds.append(t)
        region = graph_walk.downstream_ops(seeds, set(branch.get_operations()))
        _propagate(region, layouts, seeds, set(), static_batch_size, rule_registry)
        per_branch.append([layouts.get(t) for t in branch.outputs])
    outputs = [a if a is not None and a == b else None for a, b in zip(*per_branch)]
    return None if all(o is None for o in outputs) else outputs


# Marker for inputs that do not depend on the batch.
INDEPENDENT = "independent"




def static_value(tensor):
    """The constant value of `tensor` as a numpy array, or None."""
    try:
        value = tf.get_static_value(tensor)
    except (TypeError, ValueError):
        return None
    return None if value is None else np.asarray(value)


def _rows_on_axis_zero(layout, tensor):
    """The Rows of an input that an op treats row by row: lead 0 and k known."""
    if not isinstance(layout, Rows):
        return None
    rows = complete(layout, tensor.shape)
    if rows is None or rows.lead != 0 or rows.k is None:
        return None
    return rows


def _same_rows(op, inputs, data_slots, independent_data=False):
    """Output Rows(0, k, None) when every input among `data_slots` depends on the batch
    (or, with `independent_data`, may not: the caller checked how it broadcasts) with
    lead 0 and the same known k, and the other inputs are batch-independent."""
    k = None
    for j, layout in enumerate(inputs):
        if j not in data_slots:
            if layout is not INDEPENDENT:
                return None
            continue
        if layout is INDEPENDENT:
            if not independent_data:
                return None
            continue
        rows = _rows_on_axis_zero(layout, op.inputs[j])
        if rows is None or (k is not None and rows.k != k):
            return None
        k = rows.k
    return None if k is None else Rows(0, k, None)


def _normalized_axes(values, rank):
    return {int(a) % rank for a in np.atleast_1d(values)}


def _output_layouts(op, inputs, static_batch_size):
    """Layouts of op's outputs from its inputs' layouts; None when unknown."""
    n_out = len(op.outputs)
    dependent = [layout for layout in inputs if layout is not INDEPENDENT]
    if not dependent:
        return None
    if any(layout is None for layout in dependent):
        if op.type == "Reshape" and inputs[0] is not None:
            pass  # the shape argument may be anything; checked with static shapes
        else:
            return None
    if all(layout is META for layout in dependent):
        return [META] * n_out
    if op.type in _SHAPE_OPS:
        return [META] * n_out
    t = op.type
    if t in _POINTWISE_UNARY:
        if not isinstance(inputs[0], Rows) or len(inputs) > 1 and any(
                layout is not INDEPENDENT for layout in inputs[1:]):
            return None
        return [inputs[0]] * n_out
    if t in _POINTWISE_BROADCAST:
        return _broadcast(op, inputs)
    if t == "Reshape":
        return _reshape(op, inputs, static_batch_size)
    if t in _FUSED_BATCH_NORMS:
        return _fused_batch_norm(op, inputs)
    if any(layout is META for layout in dependent):
        return None
    rank = op.inputs[0].shape.rank
    if t in _REDUCTIONS:
        axes = static_value(op.inputs[1])
        if rank is None or axes is None or 0 in _normalized_axes(axes, rank) or rank == 0:
            return None
        return _with(_same_rows(op, inputs, {0}), n_out)
    if t in _LAST_AXIS_OPS:
        return None if rank is None or rank < 2 else _with(_same_rows(op, inputs, {0}), n_out)
    if t in _POOLS:
        if op.get_attr("ksize")[0] != 1 or op.get_attr("strides")[0] != 1:
            return None
        return _with(_same_rows(op, inputs, {0}), n_out)
    if t in _CONVOLUTIONS:
        return _with(_same_rows(op, inputs, {0}), n_out)
    if t == "MatMul":
        if op.get_attr("transpose_a"):
            return None
        return _with(_same_rows(op, inputs, {0}), n_out)
    if t in ("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"):
        return _batch_matmul(op, inputs)
    if t == "Einsum":
        return _einsum(op, inputs)
    if t in _LOSSES:
        if rank != 2:
            return None
        rows = _same_rows(op, inputs, {0, 1})
        return None if rows is None or rows.k != 1 else [rows, rows]
    if t in ("GatherV2", "ResourceGather"):
        return _gather(op, inputs)
    if t == "ExpandDims":
        axis = static_value(op.inputs[1])
        if rank is None or axis is None or int(axis) % (rank + 1) == 0:
            return None
        return _with(_same_rows(op, inputs, {0}), n_out)
    if t == "Squeeze":
        dims = op.get_attr("squeeze_dims")
        if rank is None or not dims or 0 in _normalized_axes(dims, rank):
            return None
        return _with(_same_rows(op, inputs, {0}), n_out)
    if t == "Transpose":
        perm = static_value(op.inputs[1])
        if perm is None or int(perm[0]) != 0:
            return None
        return _with(_same_rows(op, inputs, {0}), n_out)
    if t == "StridedSlice":
        return _strided_slice(op, inputs)
    if t == "Slice":
        begin, size = static_value(op.inputs[1]), static_value(op.inputs[2])
        if begin is None or size is None or int(begin[0]) != 0 or int(size[0]) != -1:
            return None
        return _with(_same_rows(op, inputs, {0}), n_out)
    if t == "ConcatV2":
        axis = static_value(op.inputs[-1])
        if rank is None or axis is None or int(axis) % rank == 0 or INDEPENDENT in inputs[:-1]:
            return None
        return _with(_same_rows(op, inputs, set(range(len(inputs) - 1))), n_out)
    if t == "Pack":
        if rank is None or op.get_attr("axis") % (rank + 1) == 0 or INDEPENDENT in inputs:
            return None
        return _with(_same_rows(op, inputs, set(range(len(inputs)))), n_out)
    if t == "Unpack":
        if rank is None or op.get_attr("axis") % rank == 0:
            return None
        return _with(_same_rows(op, inputs, {0}), n_out)
    if t in ("Split", "SplitV"):
        data, axis_slot = (1, 0) if t == "Split" else (0, 2)
        axis = static_value(op.inputs[axis_slot])
        rank = op.inputs[data].shape.rank
        if rank is None or axis is None or int(axis) % rank == 0:
            return None
        return _with(_same_rows(op, inputs, {data}), n_out)
    if t == "Tile":
        multiples = static_value(op.inputs[1])
        if multiples is None or int(multiples[0]) != 1:
            return None
        return _with(_same_rows(op, inputs, {0}), n_out)
    if t in ("Pad", "PadV2", "MirrorPad"):
        paddings = static_value(op.inputs[1])
        if paddings is None or paddings[0].any():
            return None
        return _with(_same_rows(op, inputs, {0}), n_out)
    return None


def _with(rows, n_out):
    return None if rows is None else [rows] * n_out


def _broadcast(op, inputs):
    """Elementwise ops with broadcasting: every batch-dependent input must have the
    output's rank (its axis 0 is the output's axis 0) and the same rows per example;
    batch-independent inputs must not stretch axis 0 (static size 1, or lower rank)."""
    out = op.outputs[0]
    out_rank = out.shape.rank
    if out_rank is None or out_rank == 0:
        return None
    if op.type == "BiasAdd":
        inputs = [inputs[0], INDEPENDENT if inputs[1] is INDEPENDENT else None]
    same_layout = True
    for j, layout in enumerate(inputs):
        shape = op.inputs[j].shape
        if layout is INDEPENDENT:
            if op.type == "Select" and j == 0:
                return None
            if shape.rank is None or (shape.rank == out_rank and
                                      tf.compat.dimension_value(shape[0]) != 1):
                return None
            continue
        if not isinstance(layout, Rows) or shape.rank != out_rank:
            return None
        if layout != inputs[0] or shape != out.shape:
            same_layout = False
    if same_layout and isinstance(inputs[0], Rows):
        return [inputs[0]]  # flat layout unchanged (pointwise on equal shapes)
    return _with(_same_rows(op, inputs, set(range(len(inputs))), independent_data=True), 1)


def _reshape(op, inputs, static_batch_size):
    """A reshape keeps the flat layout: E is unchanged; k follows from the static
    output shape (refined by evaluating the shape argument where it is computed
    from static shapes, as Keras' Flatten, Tensordot and LayerNormalization do)."""
    layout = inputs[0]
    if not isinstance(layout, Rows):
        return None
    layout = complete(layout, op.inputs[0].shape)
    if layout is None or layout.E is None:
        return None
    shape = refined_reshape_shape(op)
    if shape.rank is None or shape.rank == 0:
        return None
    dims = shape.as_list()
    lead = 0
    if static_batch_size != 1:
        while lead < len(dims) - 1 and dims[lead] == 1:
            lead += 1
    return [complete(Rows(lead, None, layout.E), shape)]


def refined_reshape_shape(op):
    """The static output shape of a Reshape op, merged with what can be computed from
    its shape argument (partial evaluation of Shape/StridedSlice/Prod/Pack/... )."""
    shape = op.outputs[0].shape
    value = _partial_value(op.inputs[1], depth=0)
    if isinstance(value, list) and shape.rank == len(value):
        dims = [d if d is not None else (v if v is not None and v >= 0 else None)
                for d, v in zip(shape.as_list(), value)]
        shape = tf.TensorShape(dims)
    return shape


def _partial_value(tensor, depth):
    """A python int, None (unknown scalar) or list of int|None for small integer
    tensors computed from static shapes; None when not evaluable."""
    if depth > 12:
        return None
    value = static_value(tensor)
    if value is not None:
        return value.tolist() if value.ndim <= 1 else None
    op = tensor.op
    t = op.type
    if t == "Shape":
        shape = op.inputs[0].shape
        return None if shape.rank is None else shape.as_list()
    if t in ("Identity", "Cast"):
        return _partial_value(op.inputs[0], depth + 1)
    if t == "Pack" and op.get_attr("axis") == 0:
        parts = [_partial_value(i, depth + 1) for i in op.inputs]
        return [p if isinstance(p, int) else None for p in parts]
    if t == "ConcatV2":
        axis = static_value(op.inputs[-1])
        if axis is None or int(axis) != 0:
            return None
        parts = [_partial_value(i, depth + 1) for i in op.inputs[:-1]]
        if any(not isinstance(p, list) for p in parts):
            return None
        return [d for p in parts for d in p]
    if t == "Prod":
        vector = _partial_value(op.inputs[0], depth + 1)
        if not isinstance(vector, list) or op.inputs[0].shape.rank != 1:
            return None
        return None if None in vector else int(np.prod(vector, dtype=np.int64))
    if t == "GatherV2":
        vector = _partial_value(op.inputs[0], depth + 1)
        indices, axis = static_value(op.inputs[1]), static_value(op.inputs[2])
        if not isinstance(vector, list) or indices is None or axis is None or int(axis) != 0:
            return None
        picked = [vector[int(i)] for i in np.atleast_1d(indices)]
        return picked if indices.ndim == 1 else picked[0]
    if t == "StridedSlice":
        vector = _partial_value(op.inputs[0], depth + 1)
        begin, end, strides = (static_value(op.inputs[j]) for j in (1, 2, 3))
        if (not isinstance(vector, list) or begin is None or end is None or strides is None
                or len(begin) != 1 or op.get_attr("ellipsis_mask") or op.get_attr("new_axis_mask")):
            return None
        b = None if op.get_attr("begin_mask") & 1 else int(begin[0])
        e = None if op.get_attr("end_mask") & 1 else int(end[0])
        if op.get_attr("shrink_axis_mask") & 1:
            return vector[b if b is not None else 0]
        return vector[slice(b, e, int(strides[0]))]
    return None


def _fused_batch_norm(op, inputs):
    """Inference mode normalizes each entry with batch-independent statistics
    (pointwise). Training mode in NCHW with a leading size-1 axis normalizes each
    channel (axis 1) over H and W: Keras LayerNormalization's form, one row per channel."""
    for j in range(1, len(inputs)):
        if inputs[j] is not INDEPENDENT and not _filled_with_constant(op.inputs[j]):
            return None
    x = inputs[0]
    if not isinstance(x, Rows):
        return None
    n_rest = len(op.outputs) - 1
    if not op.get_attr("is_training"):
        return [x] + [None] * n_rest
    if op.get_attr("data_format") != b"NCHW":
        return None
    rows = complete(x, op.inputs[0].shape)
    if rows is None or rows.lead != 1 or rows.k is None:
        return None
    return [rows] + [None] * n_rest


def _filled_with_constant(tensor):
    """A Fill whose value is a constant (its size may follow the batch), as Keras'
    LayerNormalization makes the unit scale and zero offset of its fused form."""
    return tensor.op.type == "Fill" and static_value(tensor.op.inputs[1]) is not None


def _batch_matmul(op, inputs):
    x, y = inputs[0], inputs[1]
    adj_x = op.get_attr("adj_x")
    x_rank = op.inputs[0].shape.rank
    if adj_x and (x_rank is None or x_rank < 3):
        return None
    if y is INDEPENDENT:
        y_rank = op.inputs[1].shape.rank
        if y_rank is None or (y_rank > 2 and not _leading_ones(op.inputs[1].shape, y_rank - 2)):
            return None
        if x_rank is None or x_rank < 2:
            return None
        if x_rank == 2 and adj_x:
            return None
        return _with(_same_rows(op, inputs, {0}), 1)
    # both batch-dependent: an independent product per batch entry (attention)
    if x_rank is None or x_rank < 3 or op.inputs[1].shape.rank != x_rank:
        return None
    return _with(_same_rows(op, inputs, {0, 1}), 1)


def _leading_ones(shape, n):
    return all(tf.compat.dimension_value(d) == 1 for d in shape[:n])


def parse_einsum(equation):
    """'ab,bc->ac' -> (['ab', 'bc'], 'ac'); None for ellipses or implicit outputs."""
    equation = equation.decode() if isinstance(equation, bytes) else equation
    equation = equation.replace(" ", "")
    if "..." in equation or "->" not in equation:
        return None
    lhs, out = equation.split("->")
    return lhs.split(","), out


def _einsum(op, inputs):
    parsed = parse_einsum(op.get_attr("equation"))
    if parsed is None or len(parsed[0]) != 2:
        return None
    (a, w), out = parsed
    if inputs[0] is INDEPENDENT or inputs[1] is not INDEPENDENT:
        return None
    if not a or not out or a[0] != out[0] or a[0] in w or len(set(a)) != len(a):
        return None
    return _with(_same_rows(op, inputs, {0}), 1)


def _gather(op, inputs):
    """Gather rows of a batch-independent table with batch-dependent indices (an
    embedding lookup): the output's axis 0 is the indices' axis 0. Or gather from a
    batch-dependent tensor along another axis with constant indices."""
    params, indices = inputs[0], inputs[1]
    batch_dims = op.get_attr("batch_dims") if "batch_dims" in op.node_def.attr else 0
    if batch_dims:
        return None
    axis = 0
    if op.type == "GatherV2":
        value = static_value(op.inputs[2])
        if value is None:
            return None
        axis = int(value)
    if params is INDEPENDENT and axis == 0:
        rows = _rows_on_axis_zero(indices, op.inputs[1])
        return None if rows is None or op.inputs[1].shape.rank == 0 else [Rows(0, rows.k, None)]
    if op.type == "GatherV2" and indices is INDEPENDENT and inputs[2] is INDEPENDENT:
        rank = op.inputs[0].shape.rank
        if rank is None or axis % rank == 0:
            return None
        return _with(_same_rows(op, inputs, {0}), 1)
    return None


def _strided_slice(op, inputs):
    if any(layout is not INDEPENDENT for layout in inputs[1:]):
        return None
    begin, end, strides = (static_value(op.inputs[j]) for j in (1, 2, 3))
    if begin is None or end is None or strides is None:
        return None
    if op.get_attr("ellipsis_mask") & 1:
        return _with(_same_rows(op, inputs, {0}), 1)
    if (op.get_attr("new_axis_mask") & 1 or op.get_attr("shrink_axis_mask") & 1
            or int(strides[0]) != 1):
        return None
    full_begin = op.get_attr("begin_mask") & 1 or int(begin[0]) == 0
    full_end = op.get_attr("end_mask") & 1
    if not (full_begin and full_end):
        return None
    return _with(_same_rows(op, inputs, {0}), 1)

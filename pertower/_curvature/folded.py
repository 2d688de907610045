"""The M columns' output gradients by a backward pass of the columns' own, without pfor.

Notation:
    B   examples (axis 0 of the forward tensors)     M   columns
    Z   a tensor the logits depend on                dY  [M, *Y.shape] the columns'
                                                         gradient at a tensor Y

Every op between the rules' outputs Z and the logits gets its input gradients from dY
with the column axis kept in front (backward ops are linear in dY):
  - an op that treats the entries of its axis 0 alike (a convolution, a pooling, the
    rows of a MatMul's first operand) runs ONCE on dY folded to [M*N, ...], its weights
    shared by all M*N entries (folding is exact whichever axis holds the batch);
  - an elementwise op multiplies dY by its local derivative, computed once from the
    forward tensors and broadcast over the M columns (pfor's converters tile them M
    times);
  - a non-overlapping AvgPool or MaxPool spreads each output gradient over its window
    by a broadcast ([.., Ho, 1, Wo, 1, C] -> [.., Ho, k, Wo, k, C]; MaxPool times the
    window's argmax mask), where TensorFlow's CPU AvgPoolGrad is an order of magnitude
    slower;
  - reshapes, reductions and broadcasting additions act on [M, ...], the column axis
    prepended to their shapes and axes.
For an op outside the table (or inside a control-flow frame) `backward` returns None
with the reason; the caller then takes pfor (`pertower._curvature.columns`).
"""

import functools

import tensorflow as tf

from pertower import _op_types as op_types
from pertower import _tf

__all__ = ["backward", "crosses_control_flow"]

_FLOAT = (tf.float16, tf.bfloat16, tf.float32, tf.float64)


class _Unsupported(Exception):
    """An op of the path that this backward does not convert (the message says which)."""


def _shape(t):
    """t's shape as a list: static ints where known, else scalar tensors."""
    dims = t.shape.as_list() if t.shape.rank is not None else None
    if dims is None:
        raise _Unsupported(f"{t.name} has an unknown rank")
    dynamic = tf.shape(t)
    return [d if d is not None else dynamic[i] for i, d in enumerate(dims)]


def _stacked(dims):
    return tf.stack(dims) if any(isinstance(d, tf.Tensor) for d in dims) else dims


def _with_columns(dY, M, like):
    """dY reshaped to [M, *like.shape] (static shape set)."""
    out = tf.reshape(dY, _stacked([M] + _shape(like)))
    out.set_shape([M if isinstance(M, int) else None] + like.shape.as_list())
    return out


def _fold(dY):
    """[M, N, ...] -> [M*N, ...]."""
    dims = _shape(dY)
    return tf.reshape(dY, _stacked([-1] + dims[2:]))


def _unbroadcast(dX, x, M):
    """dX [M, *broadcast shape] summed back to [M, *x.shape] (x was broadcast)."""
    if (x.shape.is_fully_defined() and dX.shape[1:].is_fully_defined() and
            x.shape == dX.shape[1:]):
        return dX
    out_shape = tf.shape(dX)[1:]
    axes, _ = tf.raw_ops.BroadcastGradientArgs(s0=tf.shape(x), s1=out_shape)
    return _with_columns(tf.reduce_sum(dX, axis=axes + 1), M, x)


def _pool_sizes(op):
    """(k, h_out, w_out) of a non-overlapping NHWC pooling (ksize == strides, square
    windows, VALID, static sizes), else None."""
    if op.get_attr("data_format") != b"NHWC" or op.get_attr("padding") != b"VALID":
        return None
    ksize, strides = op.get_attr("ksize"), op.get_attr("strides")
    if ksize != strides or ksize[0] != 1 or ksize[3] != 1 or ksize[1] != ksize[2]:
        return None
    x, y = op.inputs[0], op.outputs[0]
    if None in x.shape.as_list()[1:] or None in y.shape.as_list()[1:]:
        return None
    return ksize[1], y.shape[1], y.shape[2]


def _spread(dY, x, k, h_out, w_out, M):
    """[M, N, Ho, Wo, C] -> [M, N, H, W, C]: each value over its k x k window (zeros
    on the rows and columns a VALID pooling drops)."""
    dims = _shape(dY)
    c = dims[-1]
    wide = tf.broadcast_to(dY[:, :, :, None, :, None, :],
                           _stacked(dims[:3] + [k, w_out, k, c]))
    wide = tf.reshape(wide, _stacked(dims[:2] + [h_out * k, w_out * k, c]))
    height, width = x.shape.as_list()[1:3]
    if height != h_out * k or width != w_out * k:
        wide = tf.pad(wide, [[0, 0], [0, 0], [0, height - h_out * k],
                             [0, width - w_out * k], [0, 0]])
    return _with_columns(wide, M, x)


# op type -> (x, y, op) -> dy/dx, the local derivative of an elementwise op y = f(x)
_DERIVATIVES = {
    "Relu": lambda x, y, op: tf.cast(y > 0, y.dtype),
    "Relu6": lambda x, y, op: tf.cast(tf.logical_and(y > 0, y < 6), y.dtype),
    "Elu": lambda x, y, op: tf.where(y > 0, tf.ones_like(y), y + 1),
    "LeakyRelu": lambda x, y, op: tf.where(
        x > 0, tf.ones_like(x), tf.cast(op.get_attr("alpha"), x.dtype) * tf.ones_like(x)),
    "Sigmoid": lambda x, y, op: y * (1 - y),
    "Tanh": lambda x, y, op: 1 - y * y,
}


class _Backward:
    """The converters, with the per-op local derivatives they compute once."""

    def __init__(self, M, on_path):
        self.M = M
        self.on_path = on_path     # refs of the tensors on the path

    def on(self, x):
        """Whether x is on the path (depends on an output, reaches the logits)."""
        return x.ref() in self.on_path

    def folded_shape(self, x):
        """[rank] int32: x's shape with M*N on axis 0, the shape of a folded dX."""
        dims = _shape(x)
        return tf.stack([self.M * dims[0]] + [tf.convert_to_tensor(d, tf.int32)
                                               for d in dims[1:]])

    # -- elementwise: dY times a local derivative (`_DERIVATIVES`), over the columns -

    def local(self, op, dY):
        derivative = _DERIVATIVES[op.type](op.inputs[0], op.outputs[0], op)
        return [_with_columns(dY * derivative[None], self.M, op.inputs[0])]

    def Identity(self, op, dY):
        return [dY]

    Snapshot = Identity

    def StopGradient(self, op, dY):
        return [None]

    # -- shapes: the first input's gradient, the others (a shape, an axis) none --------

    def Reshape(self, op, dY):
        return [_with_columns(dY, self.M, op.inputs[0])] + [None] * (len(op.inputs) - 1)

    Squeeze = ExpandDims = Reshape

    # -- additions and products, with broadcasting -------------------------------------

    def BiasAdd(self, op, dY):
        if self.on(op.inputs[1]):
            raise _Unsupported(f"{op.name} (BiasAdd): its bias depends on the outputs")
        return [dY, None]

    def AddV2(self, op, dY):
        return [_unbroadcast(dY, x, self.M) if self.on(x) else None
                for x in op.inputs]

    Add = AddV2

    def Sub(self, op, dY):
        a, b = op.inputs
        return [_unbroadcast(dY, a, self.M) if self.on(a) else None,
                _unbroadcast(-dY, b, self.M) if self.on(b) else None]

    def Mul(self, op, dY):
        a, b = op.inputs
        return [_unbroadcast(dY * b[None], a, self.M) if self.on(a) else None,
                _unbroadcast(dY * a[None], b, self.M) if self.on(b) else None]

    def _reduce(self, op, dY, mean):
        x, axes = op.inputs
        dims = _shape(x)
        kept = _tf.reduced_shape(tf.shape(x), axes)        # [rank]: 1 on reduced axes
        dX = tf.broadcast_to(tf.reshape(dY, tf.concat([[self.M], kept], 0)),
                             _stacked([self.M] + dims))
        if mean:
            count = tf.cast(tf.size(x) // tf.maximum(tf.size(op.outputs[0]), 1), dX.dtype)
            dX = dX / count
        return [_with_columns(dX, self.M, x), None]

    Sum = functools.partialmethod(_reduce, mean=False)
    Mean = functools.partialmethod(_reduce, mean=True)

    # -- ops that treat the entries of axis 0 alike: M folded into axis 0 -------------

    def MatMul(self, op, dY):
        a, b = op.inputs
        if self.on(b) or op.get_attr("transpose_a"):
            raise _Unsupported(f"{op.name} (MatMul): its second operand depends on the "
                               "outputs, or its first is transposed")
        dA = tf.matmul(_fold(dY), b, transpose_b=not op.get_attr("transpose_b"))
        return [_with_columns(dA, self.M, a), None]

    def _conv_input(self, op, dY, kernel):
        x, w = op.inputs[:2]
        if self.on(w):
            raise _Unsupported(f"{op.name} ({op.type}): its filter depends on the outputs")
        attrs = {name: op.get_attr(name) for name in
                 ("strides", "padding", "explicit_paddings", "data_format", "dilations")}
        dX = kernel(input_sizes=self.folded_shape(x), filter=w, out_backprop=_fold(dY),
                    **attrs)
        return [_with_columns(dX, self.M, x), None]

    def Conv2D(self, op, dY):
        return self._conv_input(op, dY, tf.raw_ops.Conv2DBackpropInput)

    def DepthwiseConv2dNative(self, op, dY):
        return self._conv_input(op, dY, tf.raw_ops.DepthwiseConv2dNativeBackpropInput)

    def AvgPool(self, op, dY):
        x = op.inputs[0]
        sizes = _pool_sizes(op)
        if sizes is not None:
            k, h_out, w_out = sizes
            return [_spread(dY / (k * k), x, k, h_out, w_out, self.M)]
        dX = tf.raw_ops.AvgPoolGrad(orig_input_shape=self.folded_shape(x), grad=_fold(dY),
                                    **{a: op.get_attr(a) for a in
                                       ("ksize", "strides", "padding", "data_format")})
        return [_with_columns(dX, self.M, x)]

    def MaxPool(self, op, dY):
        x, y = op.inputs[0], op.outputs[0]
        attrs = {a: op.get_attr(a) for a in ("ksize", "strides", "padding")}
        sizes = _pool_sizes(op)
        if sizes is not None and op.get_attr("padding") != b"EXPLICIT":
            k, h_out, w_out = sizes
            # the window's argmax (TensorFlow's MaxPoolGrad picks the same first maximum)
            _, argmax = tf.raw_ops.MaxPoolWithArgmax(input=x, **attrs)
            mask = tf.raw_ops.MaxPoolGradWithArgmax(input=x, grad=tf.ones_like(y),
                                                    argmax=argmax, **attrs)  # [N, H, W, C]
            return [_spread(dY, x, k, h_out, w_out, self.M) * mask[None]]
        tiles = [self.M] + [1] * (x.shape.rank - 1)
        dX = tf.raw_ops.MaxPoolGrad(orig_input=tf.tile(x, tiles), orig_output=tf.tile(y, tiles),
                                    grad=_fold(dY), data_format=op.get_attr("data_format"),
                                    **attrs)
        return [_with_columns(dX, self.M, x)]


def _path(logits, outputs):
    """(the ops between the outputs and the logits, consumers before producers; the refs
    of the tensors on the path): floating tensors that depend on an output and that the
    logits depend on."""
    ahead, stack = set(), list(outputs)
    while stack:                                          # what the outputs reach
        t = stack.pop()
        if t.ref() in ahead:
            continue
        ahead.add(t.ref())
        for consumer in t.consumers():
            stack.extend(o for o in consumer.outputs if o.dtype.base_dtype in _FLOAT)
    if logits.ref() not in ahead:
        return [], set()
    order, on_path, todo = [], set(), [(logits, False)]
    while todo:                                           # depth first, post-order
        t, done = todo.pop()
        if done:
            order.append(t.op)
            continue
        if t.ref() in on_path:
            continue
        on_path.add(t.ref())
        inputs = [i for i in t.op.inputs if i.ref() in ahead]
        if inputs:                                        # (an output's op: no inputs ahead)
            todo.append((t, True))
            todo.extend((i, False) for i in inputs)
    return order[::-1], on_path


def crosses_control_flow(logits, outputs):
    """The first op between `outputs` and `logits` that runs control flow (a TF2 loop,
    conditional or function call, or an op of a TF1 frame), or None."""
    for op in _path(logits, outputs)[0]:
        if (op.type in op_types.CALL_OP_TYPES or op.type in op_types.V1_LOOP_OP_TYPES or
                _tf.control_flow_context(op) is not None):
            return op
    return None


def backward(logits, outputs, S):
    """logits [B, K], tensors Z, S [M, B, K] (M static) -> ([M, *Z.shape] per Z: the
    gradient of sum_n S[m, n] . logits_n for every column m, zeros for a Z the logits do
    not reach; None), or (None, reason) when an op on the path is not converted here."""
    M = S.shape[0]
    if not isinstance(M, int):
        return None, "the number of columns is not static"
    try:
        order, on_path = _path(logits, outputs)
        converters = _Backward(M, on_path)
        grads = {logits.ref(): [S]}
        for op in order:
            if len(op.outputs) != 1:
                raise _Unsupported(f"{op.name} ({op.type}) has several outputs")
            dYs = grads.get(op.outputs[0].ref())
            if not dYs:
                continue
            if _tf.control_flow_context(op) is not None:
                raise _Unsupported(f"{op.name} ({op.type}) is inside a control-flow frame")
            convert = (converters.local if op.type in _DERIVATIVES else
                       getattr(converters, op.type, None) if op.type[0].isupper() else None)
            if convert is None:
                raise _Unsupported(f"{op.name} ({op.type}): no converter for its type")
            dY = dYs[0] if len(dYs) == 1 else tf.add_n(dYs)
            grads[op.outputs[0].ref()] = [dY]
            for x, dX in zip(op.inputs, convert(op, dY)):
                if dX is not None and x.ref() in on_path:
                    grads.setdefault(x.ref(), []).append(dX)
    except _Unsupported as err:
        return None, f"the columns' own backward pass does not convert {err}"
    result = []
    for Z in outputs:
        dZs = grads.get(Z.ref())
        if not dZs:
            result.append(tf.zeros(_stacked([M] + _shape(Z)), Z.dtype))
        else:
            result.append(dZs[0] if len(dZs) == 1 else tf.add_n(dZs))
    return result, None

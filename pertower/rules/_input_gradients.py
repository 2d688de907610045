"""The engine's backward pass for dZ without the weights' own gradients.

Notation: A a weight-consuming op's batch-side input, Z its output, W its weight input
(a function of the weights alone).

The engine takes dZ for every covered use with ONE `tf.gradients` with respect to the
uses' outputs Z (`pertower._engine.passes`). A weight-consuming op between two of them
would also build W's gradient, which nothing reads. While the pass is built
(`input_side_only`), each such op gets a gradient function that builds A's gradient
only, as its registered gradient does (`_Conv2DGrad`, `_DepthwiseConv2dNativeGrad`,
`_MatMulGradAgainstFirstOnly`, `_BiasAddGrad`), and None for W. With oneDNN off, where
TensorFlow's kernels for those forms are the slower (docs/benchmark.md), a stride-1
Conv2D with a large filter takes dA as ONE forward Conv2D of dZ with the filter turned
(`as_forward_convolution`), and a MatMul A W with one row per example and a large W
takes dZ W^T as (W dZ^T)^T (`_turned_matmul`).

An op is handled only when its type and W's slot are in `_ONE_SIDED`, it is in the
graph of `ys`, its gradient is TensorFlow's registered one, its dtype is real, and W is
not downstream of the batch. The functions are set on the ops for the pass only.
"""

import contextlib
import functools

import tensorflow as tf

from pertower import _tf
from pertower._convolution import geometry as _geometry
from pertower._convolution import options as _conv_options
from pertower._layout import _shapes
from pertower.rules import conv2d

__all__ = ["FORWARD_MIN_CHANNELS", "FORWARD_MIN_FILTER", "FORWARD_FEW_POSITIONS",
           "TURNED_MIN_SIDE", "forward_padding", "as_forward_convolution", "input_side_only",
           "one_sided_ops"]

# A stride-1 Conv2D's input gradient is one forward Conv2D (`forward_padding`) when the
# filter has at least FORWARD_MIN_FILTER numbers, Cin >= FORWARD_MIN_CHANNELS and
# Cin >= Cout / 2 or at most FORWARD_FEW_POSITIONS output positions.
FORWARD_MIN_FILTER = 1 << 16
FORWARD_MIN_CHANNELS = 16
FORWARD_FEW_POSITIONS = 64
# A MatMul A W with one row per example and both sides of W at least this long takes its
# input gradient as (W dZ^T)^T (`_turned_matmul`).
TURNED_MIN_SIDE = 256


def _convolution(op, grad, pads=None):
    """Conv2D or DepthwiseConv2dNative: the input's gradient only (`_Conv2DGrad`'s and
    `_DepthwiseConv2dNativeGrad`'s first output); with `pads` a forward convolution."""
    if pads is not None:
        return [as_forward_convolution(op, grad, pads), None]
    if op.type == "Conv2D":
        backprop = functools.partial(tf.raw_ops.Conv2DBackpropInput,
                                     use_cudnn_on_gpu=op.get_attr("use_cudnn_on_gpu"))
    else:
        backprop = tf.raw_ops.DepthwiseConv2dNativeBackpropInput
    return [backprop(input_sizes=tf.shape(op.inputs[0]), filter=op.inputs[1],
                     out_backprop=grad, dilations=op.get_attr("dilations"),
                     strides=op.get_attr("strides"), padding=op.get_attr("padding"),
                     explicit_paddings=op.get_attr("explicit_paddings"),
                     data_format=op.get_attr("data_format")), None]


def forward_padding(op):
    """[(top, bottom), (left, right)]: the padding of dZ for which the input gradient
    of the Conv2D `op` is a forward convolution (`as_forward_convolution`), or None
    (a stride > 1, channel groups, NCHW, sizes not static, or the thresholds above)."""
    if (op.get_attr("data_format") != b"NHWC" or list(op.get_attr("strides")) != [1] * 4
            or not op.inputs[1].shape.is_fully_defined()):
        return None
    kh, kw, c_in, c_out = op.inputs[1].shape.as_list()
    x_shape, z_shape = op.inputs[0].shape, op.outputs[0].shape
    if (x_shape.rank != 4 or z_shape.rank != 4
            or tf.compat.dimension_value(x_shape[-1]) != c_in
            or c_in < FORWARD_MIN_CHANNELS or kh * kw * c_in * c_out < FORWARD_MIN_FILTER):
        return None
    outputs = [tf.compat.dimension_value(z_shape[i]) for i in (1, 2)]
    pads = _geometry.spatial_pads(op, kh, kw)   # the input's (before, after) per axis
    if pads is None or (2 * c_in < c_out and outputs[0] * outputs[1] > FORWARD_FEW_POSITIONS):
        return None
    dilations = list(op.get_attr("dilations"))
    spans = [(k - 1) * dilations[axis + 1] for axis, k in enumerate((kh, kw))]
    if not all(0 <= p <= span for (before, after), span in zip(pads, spans)
               for p in (before, after)):
        return None
    return [(span - before, span - after) for (before, after), span in zip(pads, spans)]


def as_forward_convolution(op, grad, pads):
    """dX for the stride-1 Conv2D `op` (x [N, H, W, Cin], W [kh, kw, Cin, Cout], input
    padding (t, b), (l, r), dilation d): z[n, i, j] = sum_{u,v,c} x[n, i + u*d - t,
    j + v*d - l, c] W[u, v, c, o], so dX[n, a, b, c] = sum_{u,v,o} dz[n, a + t - u*d,
    b + l - v*d, o] W[u, v, c, o]: the convolution of dZ padded by `pads`, ((kh-1)*d - t,
    (kh-1)*d - b) and ((kw-1)*d - l, (kw-1)*d - r), with the filter turned
    (W[kh-1-u, kw-1-v, c, o] as [kh, kw, Cout, Cin])."""
    w = op.inputs[1]
    kh, kw = w.shape.as_list()[:2]
    if kh * kw > 1:
        w = tf.reverse(w, _shapes.constant([0, 1]))
    w = tf.transpose(w, _shapes.constant([0, 1, 3, 2]))           # [kh, kw, Cout, Cin]
    (top, bottom), (left, right) = pads
    same = [(span // 2, span - span // 2) for span in
            ((kh - 1) * op.get_attr("dilations")[1], (kw - 1) * op.get_attr("dilations")[2])]
    if pads == [(0, 0), (0, 0)]:
        padding, explicit = "VALID", []
    elif pads == same:
        padding, explicit = "SAME", []
    else:
        padding, explicit = "EXPLICIT", [0, 0, top, bottom, left, right, 0, 0]
    return tf.raw_ops.Conv2D(input=grad, filter=w, strides=[1, 1, 1, 1], padding=padding,
                             explicit_paddings=explicit,
                             dilations=op.get_attr("dilations"),
                             use_cudnn_on_gpu=op.get_attr("use_cudnn_on_gpu"),
                             data_format="NHWC")


def _bias_add(_, grad):
    """BiasAdd / BiasAddV1: the value's gradient is the received one."""
    return [grad, None]


def _matmul(op, grad, turned=False):
    """MatMul A W or A W^T: A's gradient only, dZ W^T or dZ W; `turned`: dZ W^T as
    (W dZ^T)^T."""
    if turned:
        return [tf.transpose(tf.raw_ops.MatMul(a=op.inputs[1], b=grad, transpose_b=True)),
                None]
    return [tf.raw_ops.MatMul(a=grad, b=op.inputs[1],
                              transpose_b=not op.get_attr("transpose_b"), grad_a=True), None]


def _turned_matmul(use):
    """Whether the MatMul `use` (A W, W [d, n]) takes dA = dZ W^T as (W dZ^T)^T (a
    transpose of the small [d, B] result): with one row per example, min(d, n) >=
    `TURNED_MIN_SIDE` and oneDNN off."""
    k = getattr(use.rows, "k", None)
    if (use.op.get_attr("transpose_b") or not (isinstance(k, int) and k == 1)
            or conv2d.onednn_enabled()):
        return False
    return (use.weight_shape.is_fully_defined()
            and min(use.weight_shape.as_list()) >= TURNED_MIN_SIDE)


# (op type, W's input slot) -> the gradient function of the other input alone
_ONE_SIDED = {("Conv2D", 1): _convolution, ("DepthwiseConv2dNative", 1): _convolution,
              ("BiasAdd", 1): _bias_add, ("BiasAddV1", 1): _bias_add,
              ("MatMul", 1): _matmul}


def _has_registered_gradient(op):
    if _tf.has_own_gradient_function(op):
        return False
    try:
        op.get_attr("_gradient_op_type")
    except ValueError:
        return True
    return False


def one_sided_ops(plan, indices, loop_uses=()):
    """{op: gradient function} for the uses of the weights `indices` of `plan` that
    `input_side_only` handles (see the module docstring for the conditions), but
    `loop_uses` (reads inside loops, `pertower._loops`)."""
    request = plan.request
    found = {}
    in_loops = {id(use) for use in loop_uses}
    for k in indices:
        for use in plan.uses[k] or ():
            if id(use) in in_loops:
                continue
            op, slot = use.op, use.slot
            function = _ONE_SIDED.get((op.type, slot))
            if (function is None or op in found or op.graph is not request.graph
                    or not op.outputs[0].dtype.is_floating
                    or op.inputs[slot].op in request.batch_downstream
                    or not _has_registered_gradient(op)
                    or (op.type == "MatMul" and op.get_attr("transpose_a"))):
                continue
            if op.type == "Conv2D":   # a forward convolution where oneDNN is off
                options = (use.rule.options if isinstance(use.rule, conv2d.ConvolutionRule)
                           else None)
                pads = None if _conv_options.onednn_runs(options) else forward_padding(op)
                function = functools.partial(_convolution, pads=pads)
            elif op.type == "MatMul" and _turned_matmul(use):
                function = functools.partial(_matmul, turned=True)
            found[op] = function
    return found


@contextlib.contextmanager
def input_side_only(plan, indices, loop_uses=()):
    """While the body runs, the ops of `one_sided_ops(plan, indices, loop_uses)`
    differentiate their batch-side input only."""
    ops = one_sided_ops(plan, indices, loop_uses) if _tf.one_sided_gradients() else {}
    for op, function in ops.items():
        _tf.set_gradient_function(op, function)
    try:
        yield
    finally:
        for op in ops:
            _tf.set_gradient_function(op, None)

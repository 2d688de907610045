"""The engine's backward pass for dZ without the weights' own gradients.

Notation:
    A   a weight-consuming op's batch-side input     Z   its output
    W   its weight input (a function of the weights alone)

The engine takes dZ for every covered use with ONE `tf.gradients` of sum(grad_ys * ys)
with respect to the uses' outputs Z (`rules._engine._output_gradients`). A
weight-consuming op between two of them (layer k's convolution reads what layer k-1's
made) is differentiated by its registered gradient, which builds the gradient of EVERY
input: for W a whole op (Conv2DBackpropFilter, DepthwiseConv2dNativeBackpropFilter, a
MatMul, BiasAddGrad) whose value nothing reads, since the pass stops at the Z's and W is
not downstream of any of them (every Z is downstream of the batch, W is not): 31 of the
87 ops the pass builds on VGG16.

While the pass is built (`input_side_only`), each such op gets a gradient function that
builds its A's gradient only, the same op with the same attributes as the registered
gradient builds for A (TensorFlow's `_Conv2DGrad`, `_DepthwiseConv2dNativeGrad`,
`_MatMulGradAgainstFirstOnly`, `_BiasAddGrad`), and None for W, which
`tf.gradients` leaves out as it would the unread result. An op is handled only when: its
type and W's slot are in `_ONE_SIDED` (a MatMul: A not transposed); it is in the graph
of `ys` (not in a function or loop body); its gradient is TensorFlow's registered one
(no `_gradient_op_type` override, no gradient function of its own); its dtype is real;
and W is not downstream of the batch (`Request.batch_downstream`), so that no Z's
gradient can flow through W. Every op gets its own gradient function back when the pass
is built (also on error). The functions are set on the ops' Python objects, as the
graph's `_override_gradient_function` does: a `tf.gradients` another thread builds
through the same ops meanwhile would see them too.
"""

import contextlib

import tensorflow as tf

from pertower.rules import _loop_uses

__all__ = ["input_side_only", "one_sided_ops"]


def _conv2d(op, grad):
    """Conv2D: the input's gradient (`_Conv2DGrad`'s first output)."""
    return [tf.raw_ops.Conv2DBackpropInput(
        input_sizes=tf.shape(op.inputs[0]), filter=op.inputs[1], out_backprop=grad,
        dilations=op.get_attr("dilations"),
        strides=op.get_attr("strides"), padding=op.get_attr("padding"),
        explicit_paddings=op.get_attr("explicit_paddings"),
        use_cudnn_on_gpu=op.get_attr("use_cudnn_on_gpu"),
        data_format=op.get_attr("data_format")), None]


def _depthwise(op, grad):
    """DepthwiseConv2dNative: the input's gradient (`_DepthwiseConv2dNativeGrad`'s
    first output)."""
    return [tf.raw_ops.DepthwiseConv2dNativeBackpropInput(
        input_sizes=tf.shape(op.inputs[0]), filter=op.inputs[1], out_backprop=grad,
        dilations=op.get_attr("dilations"),
        strides=op.get_attr("strides"), padding=op.get_attr("padding"),
        explicit_paddings=op.get_attr("explicit_paddings"),
        data_format=op.get_attr("data_format")), None]


def _bias_add(_, grad):
    """BiasAdd / BiasAddV1: the value's gradient is the received one."""
    return [grad, None]


def _matmul(op, grad):
    """MatMul A W or A W^T (the rule's cases: A not transposed): A's gradient only,
    dZ W^T or dZ W (`_MatMulGradAgainstFirstOnly`)."""
    return [tf.raw_ops.MatMul(a=grad, b=op.inputs[1],
                              transpose_b=not op.get_attr("transpose_b"), grad_a=True), None]


# (op type, W's input slot) -> the gradient function of the other input alone
_ONE_SIDED = {("Conv2D", 1): _conv2d, ("DepthwiseConv2dNative", 1): _depthwise,
              ("BiasAdd", 1): _bias_add, ("BiasAddV1", 1): _bias_add,
              ("MatMul", 1): _matmul}


def _has_registered_gradient(op):
    # pylint: disable-next=protected-access
    if op._gradient_function is not None:
        return False
    try:
        op.get_attr("_gradient_op_type")
    except ValueError:
        return True
    return False


def one_sided_ops(plan, indices):
    """{op: gradient function} for the uses of the weights `indices` of `plan` that
    `input_side_only` handles (see the module docstring for the conditions)."""
    request = plan.request
    found = {}
    for k in indices:
        for use in plan.uses[k] or ():
            if isinstance(use, _loop_uses.LoopUse):
                continue
            op, slot = use.op, use.slot
            function = _ONE_SIDED.get((op.type, slot))
            if (function is None or op in found or op.graph is not request.graph
                    or not op.outputs[0].dtype.is_floating
                    or op.inputs[slot].op in request.batch_downstream
                    or not _has_registered_gradient(op)
                    or (op.type == "MatMul" and op.get_attr("transpose_a"))):
                continue
            found[op] = function
    return found


@contextlib.contextmanager
def input_side_only(plan, indices):
    """While the body runs, the ops of `one_sided_ops(plan, indices)` differentiate
    their batch-side input only."""
    ops = one_sided_ops(plan, indices)
    for op, function in ops.items():
        op._gradient_function = function   # pylint: disable=protected-access
    try:
        yield
    finally:
        for op in ops:
            op._gradient_function = None   # pylint: disable=protected-access

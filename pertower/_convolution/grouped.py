"""Grouped Conv2D with one input channel per group: a depthwise convolution (`conv2d`).

Notation (as in `conv2d`): C input channels, g channel groups, M = Cout / g outputs per
group, W the filter [kh, kw, C/g, Cout].

Identity: a Conv2D with g = C groups (Keras' `Conv2D(groups=channels)`, ConvNeXt's 7x7
stages) has a filter [kh, kw, 1, C*M]; output channel o reads only input channel
o // M (TensorFlow's grouping: group j holds outputs j*M ... j*M + M - 1), so
    conv2d(x, W) = depthwise_conv2d(x, reshape(W, [kh, kw, C, M])),
the depthwise convolution's output channel c*M + m being filter [u, v, c, m] applied to
input channel c: the same order. The per-example filter gradients are the depthwise
rule's (`depthwise_conv2d`, whose ways take every group at once: one
DepthwiseConv2dNativeBackpropFilter of the batch folded into channels, or one
contraction of the patches) reshaped back, [G, kh, kw, C, M] -> [G, kh, kw, 1, C*M]; the
grouped Conv2D's own ways take one contraction per tap over every group.
"""

import tensorflow as tf

from pertower._layout import _shapes
from pertower.rules import registry as registry_lib
from pertower._convolution.geometry import groups, group_target

__all__ = ["depthwise_like", "as_depthwise", "to_grouped"]


def depthwise_like(op):
    """Whether `op` is a Conv2D whose every group has one input channel (g = C > 1)."""
    if op.type != "Conv2D" or not op.inputs[1].shape.is_fully_defined():
        return False
    g = groups(op)
    return g is not None and g > 1 and op.inputs[1].shape.as_list()[2] == 1


def as_depthwise(use, rule):
    """The `Use` (for the depthwise `rule`) of a DepthwiseConv2dNative (never run: its
    input, attributes and static output shape are read) on `use`'s input, with the
    filter reshaped to [kh, kw, C, M] and `use.op`'s strides, padding and dilations."""
    op = use.op
    kh, kw, _, c_out = use.weight_shape.as_list()
    c = groups(op)
    shape = [kh, kw, c, c_out // c]
    depthwise = tf.raw_ops.DepthwiseConv2dNative(
        input=use.activation,
        filter=tf.reshape(op.inputs[1], _shapes.constant(shape)),
        strides=list(op.get_attr("strides")), padding=op.get_attr("padding"),
        explicit_paddings=list(op.get_attr("explicit_paddings")),
        dilations=list(op.get_attr("dilations")), data_format="NHWC").op
    return registry_lib.Use(depthwise, 1, rule, use.activation, depthwise.outputs[0],
                            tf.TensorShape(shape), use.rows)


def to_grouped(gradients, use, leading):
    """Depthwise filter gradients [*leading, kh, kw, C, M] as the grouped Conv2D's,
    [*leading, kh, kw, 1, C*M] (`leading`: [] or [G])."""
    kh, kw, c_in, c_out = use.weight_shape.as_list()
    if not leading:
        return tf.reshape(gradients, _shapes.constant([kh, kw, c_in, c_out]))
    return tf.reshape(gradients, group_target(leading[0], [kh, kw, c_in, c_out]))

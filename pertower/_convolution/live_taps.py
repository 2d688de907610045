"""The filter taps that read only padding: their gradient is zero.

Notation (as in `rules.conv2d`): H an input side, Ho the output's, k the filter's side
along it, s the stride, pb the padding before (`geometry.spatial_pads`).

Tap u of a spatial axis multiplies the input rows i*s + u - pb, i = 0 ... Ho-1; where
none of them lies in 0 ... H-1 it multiplies only the zeros of the padding, so
grad_i(W)[u, ...] = 0 for every example. A filter larger than its map (a 5x5 SAME filter
on a 2x2 map: taps 0 and 4 of each axis; on a 1x1 map only the centre tap lives) then
needs the per-example gradients of the live taps u0 ... u1-1 only: those of the
convolution with the filter W[u0:u1] and the padding pb - u0 (the same output positions),
zero-padded back to k. The ways then never form the k^2/(u1-u0)^2 times larger patches or
taps of padding.
"""

import dataclasses

import tensorflow as tf

from pertower._convolution.geometry import attributes, convolution_like, spatial_pads

__all__ = ["live_range", "per_group_of_live_taps"]


def live_range(op, kernel):
    """[(u0, u1)] per spatial axis: the taps that read some input value, or None where
    every tap does (or the sizes are not static, or the filter is dilated)."""
    strides, dilations, _, _ = attributes(op)
    pads = spatial_pads(op, *kernel)
    if pads is None or any(d != 1 for d in dilations):
        return None
    ranges = []
    for axis, (k, (before, _)) in enumerate(zip(kernel, pads)):
        size = tf.compat.dimension_value(op.inputs[0].shape[axis + 1])
        out = tf.compat.dimension_value(op.outputs[0].shape[axis + 1])
        s = strides[axis + 1]
        live = [u for u in range(k)
                if any(0 <= i * s + u - before < size for i in range(out))]
        ranges.append((live[0], live[-1] + 1) if live else (0, k))
    if all(r == (0, k) for r, k in zip(ranges, kernel)):
        return None
    return ranges


def per_group_of_live_taps(per_group, use, dZ, G):
    """`per_group(use, dZ, G)` ([G, *W.shape]) computed on the live taps of `use` (a
    Conv2D or DepthwiseConv2dNative, NHWC) and zero-padded back, or None where every tap
    lives."""
    kernel = use.weight_shape.as_list()[:-2]
    ranges = live_range(use.op, kernel) if len(kernel) == 2 else None
    if ranges is None:
        return None
    op = use.op
    strides, _, _, _ = attributes(op)
    pads = spatial_pads(op, *kernel)
    explicit = [0, 0]
    for (u0, u1), (before, _), axis in zip(ranges, pads, (1, 2)):
        size = tf.compat.dimension_value(op.inputs[0].shape[axis])
        out = tf.compat.dimension_value(op.outputs[0].shape[axis])
        explicit += [before - u0, max((out - 1) * strides[axis] + u1 - before - size, 0)]
    (u0, u1), (v0, v1) = ranges
    live = convolution_like(op, op.inputs[0], op.inputs[1][u0:u1, v0:v1],
                            padding="EXPLICIT", explicit_paddings=explicit + [0, 0])
    if live.outputs[0].shape[1:3] != op.outputs[0].shape[1:3]:
        return None
    shape = tf.TensorShape([u1 - u0, v1 - v0] + use.weight_shape.as_list()[2:])
    grad = per_group(dataclasses.replace(use, op=live, output=live.outputs[0],
                                         weight_shape=shape), dZ, G)  # [G, u1-u0, v1-v0, ..]
    return tf.pad(grad, [[0, 0], [u0, kernel[0] - u1], [v0, kernel[1] - v1], [0, 0],
                         [0, 0]])                                 # [G, kh, kw, ...]

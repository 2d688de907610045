"""A convolution's geometry in N spatial dimensions (2-D: Conv2D, depthwise; 3-D:
Conv3D), channels last: padding, patches, filter taps, channel groups, live taps,
reshape targets. Notation as in `rules.conv2d`; [N, Ho, Wo, C] stands for [N, Do, Ho,
Wo, C] in 3-D.
"""

import dataclasses
import itertools

import tensorflow as tf

from pertower._layout import _rows
from pertower._layout import _shapes

__all__ = ["attributes", "convolution_like", "explicitly_padded", "patches", "groups",
           "fold_groups", "mul", "sizes", "spatial_pads", "padded_input", "taps", "window",
           "filter_gradient", "group_target", "split_channels", "live_range",
           "per_group_of_live_taps"]

_CHANNELS_LAST = {4: "NHWC", 5: "NDHWC"}
_FORWARD = {"Conv2D": tf.raw_ops.Conv2D, "Conv2DBackpropInput": tf.raw_ops.Conv2D,
            "DepthwiseConv2dNative": tf.raw_ops.DepthwiseConv2dNative,
            "DepthwiseConv2dNativeBackpropInput": tf.raw_ops.DepthwiseConv2dNative,
            "Conv3D": tf.raw_ops.Conv3D, "Conv3DBackpropInputV2": tf.raw_ops.Conv3D}
_BACKPROP_FILTER = {"Conv2D": tf.raw_ops.Conv2DBackpropFilter,
                    "DepthwiseConv2dNative": tf.raw_ops.DepthwiseConv2dNativeBackpropFilter,
                    "Conv3D": tf.raw_ops.Conv3DBackpropFilterV2}


def attributes(op):
    """(strides, dilations, padding, explicit pairs) of `op`."""
    padding = op.get_attr("padding").decode()
    pairs = op.get_attr("explicit_paddings") if padding == "EXPLICIT" else None
    return list(op.get_attr("strides")), list(op.get_attr("dilations")), padding, pairs


def convolution_like(op, x, w, op_type=None, **changed):
    """A channels-last convolution of `op_type` (default: the forward op of `op`'s type)
    on `x` with filter `w` and `op`'s attributes, or those in `changed` (never run: its
    input, attributes and static output shape are read)."""
    rank = len(op.get_attr("strides"))
    attrs = dict(strides=list(op.get_attr("strides")), padding=op.get_attr("padding"),
                 dilations=list(op.get_attr("dilations")), data_format=_CHANNELS_LAST[rank])
    if rank == 4:
        attrs["explicit_paddings"] = list(op.get_attr("explicit_paddings"))
    attrs.update(changed)
    return _FORWARD[op_type or op.type](input=x, filter=w, **attrs).op


def explicitly_padded(op):
    """(x, padding): op's input with any explicit padding applied by `tf.pad`, and the
    padding ("SAME"/"VALID") that then gives op's output positions."""
    x = op.inputs[0]
    _, _, padding, pairs = attributes(op)
    if padding == "EXPLICIT":
        x = tf.pad(x, [pairs[2 * a:2 * a + 2] for a in range(len(pairs) // 2)])
        padding = "VALID"
    return x, padding


def patches(op, *kernel):
    """[N, Ho, Wo, prod(kernel)*Cin]: the input patch each output position of `op` sees,
    in the filter's order (one `ExtractImagePatches` in 2-D; the taps side by side in
    3-D, where `tf.extract_volume_patches` has no dilations)."""
    if len(kernel) != 2:
        return tf.concat(taps(op, list(kernel)), axis=-1)
    x, padding = explicitly_padded(op)
    strides, dilations, _, _ = attributes(op)
    return tf.image.extract_patches(
        x, sizes=[1, kernel[0], kernel[1], 1], strides=[1, strides[1], strides[2], 1],
        rates=[1, dilations[1], dilations[2], 1], padding=padding)


def groups(op):
    """g, the channel groups of `op` (1 for an ordinary or a depthwise convolution), or
    None when the input's channels are not static or not g times the filter's, or the
    output channels not a multiple of g."""
    if op.type.startswith("DepthwiseConv2dNative"):
        return 1
    channels = op.inputs[0].shape.with_rank_at_least(1)[-1]
    c_in, c_out = op.inputs[1].shape.as_list()[-2:]
    channels = tf.compat.dimension_value(channels)
    if channels is None or channels % c_in or c_out % (channels // c_in):
        return None
    return channels // c_in


def fold_groups(tensor, G, k=None):
    """[G*T, H, W, C] -> [T, H, W, G*C]: each group's images side by side in channels
    (group g's channels are g*C ... g*C + C - 1). k: the rows per example (T when G is
    a tensor), which makes the reshape targets static."""
    h, w, c = (_rows.dim(tensor, axis) for axis in (1, 2, 3))
    static = _shapes.static_sizes([h, w, c])
    if static is not None and _shapes.rows_are_groups(tensor, G, k):   # T = 1: no split
        moved = tf.transpose(tensor, _shapes.constant([1, 2, 0, 3]))  # [H, W, N, C]
        return tf.reshape(moved, _shapes.constant([1] + static[:2] + [-1]))  # [1, H, W, N*C]
    split = tf.reshape(tensor, group_target(G, [-1, h, w, c], k))    # [G, T, H, W, C]
    moved = tf.transpose(split, _shapes.constant([1, 2, 3, 0, 4]))  # [T, H, W, G, C]
    if static is not None and isinstance(G, int):
        return tf.reshape(moved, [-1] + static[:2] + [G * static[2]])
    if static is not None and isinstance(k, int):
        return tf.reshape(moved, [k] + static[:2] + [-1])
    return tf.reshape(moved, sizes([-1, h, w, mul(G, c)]))           # [T, H, W, G*C]


def mul(G, c):
    """G*c: an int when both are, else one Mul (by a shared constant when c is an int)."""
    if isinstance(c, tf.Tensor):
        return tf.cast(G, c.dtype) * c
    return G * c if isinstance(G, int) else G * _shapes.constant(c, G.dtype)


def sizes(dims):
    """`dims` (ints or scalar int32 tensors) as a 1-D int32 tensor: one shared constant
    when every entry is an int, else ONE `Pack`."""
    if not any(isinstance(d, tf.Tensor) for d in dims):
        return _shapes.constant([int(d) for d in dims])
    return tf.stack([d if isinstance(d, tf.Tensor) else _shapes.constant(int(d))
                     for d in dims])


def spatial_pads(op, *kernel):
    """[(before, after)] per spatial axis such that a VALID convolution of the padded
    input with op's strides and dilations gives op's output positions exactly, cropping
    what no output position reads (after < 0); None unless the spatial sizes are static.
    `kernel`: the filter's spatial sizes."""
    strides, dilations, padding, pairs = attributes(op)
    spatial = range(1, len(kernel) + 1)
    ins = [tf.compat.dimension_value(op.inputs[0].shape[a]) for a in spatial]
    outs = [tf.compat.dimension_value(op.outputs[0].shape[a]) for a in spatial]
    if None in ins or None in outs:
        return None
    pads = []
    for axis, size, out, k in zip(spatial, ins, outs, kernel):
        needed = (out - 1) * strides[axis] + (k - 1) * dilations[axis] + 1  # what is read
        if padding == "EXPLICIT":
            before = pairs[2 * axis]
        elif padding == "SAME":
            before = max(needed - size, 0) // 2
        else:
            before = 0
        pads.append((before, needed - size - before))     # after < 0: crop
    return pads


def padded_input(op, *kernel, crop=True, x=None):
    """[N, H', W', C]: op's input (or `x`, a re-layout of it) padded by `spatial_pads`
    (a `Pad` only where a side is padded) and, with `crop`, cropped (one strided slice)."""
    pads = spatial_pads(op, *kernel)
    x = op.inputs[0] if x is None else x
    if max(max(p) for p in pads) > 0:
        x = tf.pad(x, _shapes.constant([[0, 0]] + [[max(b, 0), max(a, 0)] for b, a in pads]
                                       + [[0, 0]]))
    if crop and min(a for _, a in pads) < 0:
        ends = x.shape.as_list()[1:len(kernel) + 1]    # ints in both shape modes
        x = _shapes.strided_slice(x, (slice(None),) + tuple(
            slice(None, end + min(a, 0)) for end, (_, a) in zip(ends, pads)))
    return x


def taps(op, kernel, tensor=None, axes=None):
    """prod(kernel) x [N, Ho, Wo, C], one per filter tap (u, v, ...), u-major: the input
    values each output position of `op` (static spatial sizes) multiplies by that tap,
    the strided slice x'[:, u*d : : s, v*d : : s, ...] of `padded_input` (default
    `tensor`; or a transpose of it whose spatial axes are `axes`)."""
    strides, dilations, _, _ = attributes(op)
    axes = tuple(range(1, len(kernel) + 1)) if axes is None else tuple(axes)
    if tensor is None:   # (uncropped: every slice below stops before what a crop drops)
        tensor = padded_input(op, *kernel, crop=False)
    outs = [tf.compat.dimension_value(op.outputs[0].shape[a])
            for a in range(1, len(kernel) + 1)]
    unit = all(strides[a] == 1 for a in range(1, len(kernel) + 1))
    result = []
    for tap in itertools.product(*(range(k) for k in kernel)):
        firsts = [t * dilations[a + 1] for a, t in enumerate(tap)]
        if (unit and not any(firsts) and
                [tf.compat.dimension_value(tensor.shape[a]) for a in axes] == outs):
            result.append(tensor)                 # the whole tensor (no op)
        elif unit:
            result.append(window(tensor, {a: (f, o) for a, f, o in zip(axes, firsts, outs)}))
        else:
            index = [slice(None)] * tensor.shape.rank
            for j, (a, f, o) in enumerate(zip(axes, firsts, outs)):
                index[a] = slice(f, f + (o - 1) * strides[j + 1] + 1, strides[j + 1])
            result.append(_shapes.strided_slice(tensor, tuple(index)))
    return result


def window(tensor, spans):
    """`tensor` cut to `spans` ({axis: (start, size)}, every other axis whole): ONE
    `Slice` whose begin and size are shared constants."""
    rank = tensor.shape.rank
    begin = [spans[a][0] if a in spans else 0 for a in range(rank)]
    size = [spans[a][1] if a in spans else -1 for a in range(rank)]
    return tf.slice(tensor, _shapes.constant(begin), _shapes.constant(size))


def filter_gradient(use, out_backprop, x=None):
    """[*w.shape]: the batch filter gradient of `use.op` (Conv2D, DepthwiseConv2dNative
    or Conv3D) for the output gradient `out_backprop` and the input `x` (default the
    op's), with the op's own attributes."""
    op = use.op
    attrs = dict(strides=op.get_attr("strides"), padding=op.get_attr("padding"),
                 data_format=op.get_attr("data_format"), dilations=op.get_attr("dilations"))
    if op.type != "Conv3D":
        attrs["explicit_paddings"] = op.get_attr("explicit_paddings")
    if op.type == "Conv2D":
        attrs["use_cudnn_on_gpu"] = op.get_attr("use_cudnn_on_gpu")
    x = op.inputs[0] if x is None else x
    grad = _BACKPROP_FILTER[op.type](input=x, out_backprop=out_backprop,
                                     filter_sizes=use.weight_shape.as_list(), **attrs)
    grad.set_shape(use.weight_shape)
    return grad


def group_target(G, dims, unknown=None):
    """[G, *dims] as a reshape target, static wherever it can be (`_shapes.group_target`):
    `dims` may hold one -1 when G is an int; with G a tensor, that -1 is taken to be
    `unknown` (an int: e.g. T = k rows per example when G is B) where given."""
    if not isinstance(G, int) and unknown is not None:
        dims = [unknown if d == -1 else d for d in dims]
    return _shapes.group_shape(G, dims)


def split_channels(tensor, G, dims):
    """[G, R, C] -> [G, R, *dims] (prod(dims) = C), with a static target when R is."""
    rows = tf.compat.dimension_value(tensor.shape[1])
    if isinstance(G, int):
        return tf.reshape(tensor, [G, -1] + list(dims))
    if rows is not None:
        return tf.reshape(tensor, [-1, rows] + list(dims))
    return tf.reshape(tensor, tf.concat([tf.shape(tensor)[:2], dims], axis=0))


def live_range(op, kernel):
    """[(u0, u1)] per spatial axis: the live taps, those that read some input value, or
    None where every tap does (or the sizes are not static, or the filter is dilated).
    Tap u multiplies the input rows i*s + u - pb, i < Ho (pb the padding before); where
    none lies in 0 ... H-1, grad_i(W)[u, ...] = 0 (a 5x5 SAME filter on a 2x2 map: taps
    0 and 4)."""
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
    """`per_group(use, dZ, G)` ([G, *W.shape]) of a 2-D `use`, computed on the live taps
    only (the convolution with the filter W[u0:u1] and the padding pb - u0 has the same
    output positions) and zero-padded back; None where every tap lives."""
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

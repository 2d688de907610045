"""The ways of the convolution rule's per-group filter gradients [G, *kernel, Cin, Cout]
(identities and choice: `rules.conv2d`, `rules.depthwise_conv2d`; the same notation, M
the depthwise multiplier). Each writes them with ONE op where it can (a batched matmul
or a backward-filter kernel whose output is reshaped, not copied); only "shifts" with
one matmul per tap stacks its K results, and "examples" its G.
"""

import math

import numpy as np
import tensorflow as tf

from pertower._convolution.options import onednn_runs
from pertower._layout import _rows
from pertower._layout import _shapes
from pertower._convolution.geometry import (
    attributes, explicitly_padded, filter_gradient, fold_groups, group_target, groups, mul,
    padded_input, patches, sizes, split_channels, taps, window)
from pertower._layout._shapes import to_groups

__all__ = ["EXAMPLE_POSITIONS", "EXAMPLE_FLOATS", "FEW_POSITIONS", "CHUNK_FLOATS",
           "GUESSED_G", "per_example_calls_pay", "positions_per_example", "tap_layout", "by_patches", "by_shifts",
           "by_thin_taps", "by_grouped", "by_examples"]

# "auto" takes "examples" from this many positions T*P (Conv2D, oneDNN off) or numbers
# K*C*M per example (depthwise, oneDNN on): `per_example_calls_pay`
EXAMPLE_POSITIONS = 64
EXAMPLE_FLOATS = 2048
FEW_POSITIONS = 512     # `ConvOptions.few_positions` None (`tap_layout`)
# depthwise "grouped" under oneDNN: at most CHUNK_FLOATS numbers per call (G unknown:
# GUESSED_G)
CHUNK_FLOATS = 8192
GUESSED_G = 32


def per_example_calls_pay(use, options):
    """Whether "auto" takes "examples" (`by_examples`) for `use` (2-D, one group, no
    dilation): a depthwise filter of K >= 25 taps, without oneDNN or with K*C*M >=
    `EXAMPLE_FLOATS` (the depthwise backward-filter kernels are slow on large filters
    over G*C channels); a Conv2D without oneDNN, K > 1, Cin >= `thin_channels` and T*P
    >= `EXAMPLE_POSITIONS` (Eigen reads the input in place where "shifts" writes
    T*P*K*Cin numbers per example)."""
    shape = use.weight_shape.as_list()
    kernel, c_in = shape[:-2], shape[-2]
    if (len(kernel) != 2 or groups(use.op) != 1 or
            any(d != 1 for d in attributes(use.op)[1])):
        return False
    onednn = onednn_runs(options)
    if use.op.type == "DepthwiseConv2dNative":
        return math.prod(kernel) >= 25 and (not onednn or math.prod(shape) >= EXAMPLE_FLOATS)
    rows = positions_per_example(use)
    return (not onednn and math.prod(kernel) > 1 and c_in >= options.thin_channels and
            rows is not None and rows >= EXAMPLE_POSITIONS)


def positions_per_example(use):
    """T*P: the output positions P of one row times the rows T per example (T = 1 where
    it is known only at run time), or None where P is not static."""
    positions = use.output.shape[1:-1].num_elements()
    if positions is None:
        return None
    return positions * (use.rows.k if use.rows is not None and
                        isinstance(use.rows.k, int) else 1)


def tap_layout(options, use):
    """How "shifts" lays out the taps of `use` (`options`: a `ConvOptions`): "one" (a
    1x1 filter, no groups: one matmul of the input, strided by ExtractImagePatches in
    2-D), "thin" (Cin < `thin_channels` in 2-D: `by_thin_taps`), "channels" (P <
    `few_positions`, default `FEW_POSITIONS`, or T*P < Cout, or thin in 3-D: the taps side
    by side, `geometry.patches`, one matmul) or "per_tap" (one matmul per tap, the K
    results stacked; always for groups)."""
    shape = use.weight_shape.as_list()
    kernel, c_in, c_out = shape[:-2], shape[-2], shape[-1]
    if groups(use.op) != 1:
        return "per_tap"
    if all(k == 1 for k in kernel):
        return "one"
    if c_in < options.thin_channels:
        return "thin" if len(kernel) == 2 else "channels"
    positions = use.output.shape[1:-1].num_elements()
    k = use.rows.k if isinstance(use.rows.k, int) else 1
    few = FEW_POSITIONS if options.few_positions is None else options.few_positions
    if positions < few or k * positions < c_out:
        return "channels"
    return "per_tap"


def by_patches(use, dZ, G):
    """"patches": the patches (`geometry.patches`) and one batched contraction per group
    (a depthwise convolution's: C channel groups of one input channel and M outputs)."""
    shape = use.weight_shape.as_list()
    kernel, c_in, c_out = shape[:-2], shape[-2], shape[-1]
    g, k = groups(use.op), use.rows.k
    if use.op.type == "DepthwiseConv2dNative":
        g, c_in, c_out = c_in, 1, c_in * c_out
    x_patches = to_groups(patches(use.op, *kernel), G, k)  # [G, T*P, K*g*Cin]
    dZ_g = to_groups(dZ, G, k)                             # [G, T*P, Cout]
    if g == 1:
        grad = tf.matmul(x_patches, dZ_g, transpose_a=True)    # [G, K*Cin, Cout]
        return tf.reshape(grad, group_target(G, shape))
    # [G, P, K*g*Cin] -> [G, P, K, g, Cin]; [G, P, Cout] -> [G, P, g, Cout/g]
    x_patches = split_channels(x_patches, G, [math.prod(kernel), g, c_in])
    dZ_g = split_channels(dZ_g, G, [g, c_out // g])
    grad = tf.einsum("gpkjc,gpjo->gkcjo", x_patches, dZ_g)    # [G, K, Cin, g, Cout/g]
    return tf.reshape(grad, group_target(G, shape))


def by_shifts(options, use, dZ, G):
    """"shifts": the filter taps as strided slices of the padded input (`geometry.taps`),
    contracted with dZ as `tap_layout` says."""
    shape = use.weight_shape.as_list()
    kernel, c_in, c_out = shape[:-2], shape[-2], shape[-1]
    g, k = groups(use.op), use.rows.k
    layout = tap_layout(options, use)
    if layout == "thin":
        return by_thin_taps(use, dZ, G)
    if layout != "per_tap" or g == 1:
        if layout == "one" and len(kernel) == 2 and max(attributes(use.op)[0]) > 1:
            x = patches(use.op, *kernel)                       # [N, Ho, Wo, Cin]
        elif layout == "one":
            x = taps(use.op, kernel)[0]                        # [N, Ho, Wo, Cin]
        elif layout == "channels":
            x = patches(use.op, *kernel)                       # [N, Ho, Wo, K*Cin]
        else:
            x = None
        if len(kernel) == 2 and _shapes.rows_are_groups(dZ, G, k):   # Einsums in place
            return _one_image_per_group(use, x, dZ, G)
        dZ_g = to_groups(dZ, G, k)                            # [G, T*P, Cout]
        if x is not None:
            grad = tf.matmul(to_groups(x, G, k), dZ_g, transpose_a=True)  # [G, K*Cin, Cout]
            return tf.reshape(grad, group_target(G, shape))
    else:
        dZ_g = split_channels(to_groups(dZ, G, k), G, [g, c_out // g])  # [G, T*P, g, Cout/g]
    per_tap = []                                              # K x [G, Cin, Cout]
    for x_tap in taps(use.op, kernel):                          # [G*T, Ho, Wo, g*Cin]
        x_g = to_groups(x_tap, G, k)                           # [G, T*P, g*Cin]
        if g == 1:
            per_tap.append(tf.matmul(x_g, dZ_g, transpose_a=True))
            continue
        x_g = split_channels(x_g, G, [g, c_in])
        tap = tf.einsum("gpjc,gpjo->gcjo", x_g, dZ_g)         # [G, Cin, g, Cout/g]
        per_tap.append(tf.reshape(tap, group_target(G, [c_in, c_out])))
    grad = tf.stack(per_tap, axis=1)                          # [G, K, Cin, Cout]
    return tf.reshape(grad, group_target(G, shape))


def _one_image_per_group(use, x, dZ, G):
    """"shifts" with one image per group (T = 1, no channel groups, 2-D): ONE Einsum of
    the [N, Ho, Wo, C] tensors as they are (`x`, or each tap where None) per contraction."""
    contract = "nhwc,nhwo->nco"
    if x is not None:
        grad = tf.einsum(contract, x, dZ)                      # [N, K*Cin, Cout]
    else:
        grad = tf.stack([tf.einsum(contract, x_tap, dZ)
                         for x_tap in taps(use.op, use.weight_shape.as_list()[:-2])],
                        axis=1)                                # [N, K, Cin, Cout]
    return tf.reshape(grad, group_target(G, use.weight_shape.as_list()))


def by_grouped(options, use, dZ, G):
    """"grouped" (2-D): the batch folded into channels, x as [T, H, W, G*Cin] and dZ as
    [T, Ho, Wo, G*Cout], one backward-filter kernel: Conv2DBackpropFilter of filter size
    [kh, kw, Cin, G*Cout], or a depthwise one of [kh, kw, G*c, M] per chunk of c input
    channels (oneDNN: G*c*kh*kw*M <= CHUNK_FLOATS, G unknown taken as GUESSED_G)."""
    kh, kw, c_in, c_out = use.weight_shape.as_list()
    strides, dilations, _, _ = attributes(use.op)
    x, padding = explicitly_padded(use.op)
    depthwise = use.op.type == "DepthwiseConv2dNative"
    per_call = c_in if not (depthwise and onednn_runs(options)) else max(
        1, CHUNK_FLOATS // (kh * kw * c_out * (G if isinstance(G, int) else GUESSED_G)))
    count = -(-c_in // per_call)
    chunks = [c_in // count + (1 if j < c_in % count else 0) for j in range(count)]
    channels = _shapes.constant(3)
    xs = tf.split(x, _shapes.constant(chunks), channels) if count > 1 else [x]
    dZs = (tf.split(dZ, _shapes.constant([c * c_out for c in chunks]), channels)
           if count > 1 else [dZ])
    grads = []
    for c, x_part, dZ_part in zip(chunks, xs, dZs):
        folded = dict(input=fold_groups(x_part, G, use.rows.k),         # [T, H, W, G*c]
                      out_backprop=fold_groups(dZ_part, G, use.rows.k),  # [T, Ho, Wo, ..]
                      strides=strides, padding=padding, data_format="NHWC")
        if depthwise:
            grad = tf.raw_ops.DepthwiseConv2dNativeBackpropFilter(
                filter_sizes=sizes([kh, kw, mul(G, c), c_out]), **folded)  # [kh, kw, G*c, M]
            grads.append(tf.reshape(grad, _shapes.constant([kh, kw, -1, c, c_out])))
        else:
            grad = tf.raw_ops.Conv2DBackpropFilter(
                filter_sizes=sizes([kh, kw, c_in, mul(G, c_out)]), dilations=dilations,
                **folded)                                            # [kh, kw, Cin, G*Cout]
            grads.append(tf.reshape(grad, _shapes.constant([kh, kw, c_in, -1, c_out])))
    grad = tf.concat(grads, channels) if count > 1 else grads[0]  # [kh, kw, G, Cin, M]
    return tf.transpose(grad, _shapes.constant([2, 0, 1, 3, 4] if depthwise else
                                               [3, 0, 1, 2, 4]))  # [G, kh, kw, Cin, Cout]


def _tap_index(taps, dilation, out, stride):
    """[taps, out] int32 as nested lists: tap t's input index at output position i,
    t*dilation + i*stride."""
    index = np.arange(taps)[:, None] * dilation + np.arange(out)[None, :] * stride
    return index.astype(np.int32).tolist()


def by_thin_taps(use, dZ, G):
    """"shifts", "thin" (2-D, no groups): grad(W)[u, v, c, o] = sum_p rows[(c, u, v), p]
    dz_p[o], the rows [N, Cin*kh*kw, P] built from the channels-first padded input
    [N, Cin, H', W'] by ops that do not grow with the taps: ONE GatherV2 of the kh row
    taps (index u*d + i*s), then kw column slices stacked (column stride 1) or ONE
    GatherV2 of whole columns (strided: [N, Cin, kh, kw, Wo, Ho], dZ as [N, Wo, Ho, Cout]);
    one batched matmul per image, summed per group, moved to the filter's order."""
    kh, kw, c_in, c_out = use.weight_shape.as_list()
    strides, dilations, _, _ = attributes(use.op)
    out_h, out_w = use.op.outputs[0].shape.as_list()[1:3]
    positions = out_h * out_w
    x = padded_input(use.op, kh, kw, crop=False)   # [N, >= H', >= W', Cin] (taps stop before)
    x = tf.transpose(x, _shapes.constant([0, 3, 1, 2]))               # [N, Cin, H', W']
    x = tf.gather(x, _shapes.constant(_tap_index(kh, dilations[1], out_h, strides[1])),
                  axis=_shapes.constant(2))                           # [N, Cin, kh, Ho, W']
    if strides[2] == 1:
        columns = [window(x, {4: (v * dilations[2], out_w)}) for v in range(kw)]
        x = tf.stack(columns, axis=3)                           # [N, Cin, kh, kw, Ho, Wo]
        dz = dZ                                                 # [N, Ho, Wo, Cout]
    else:
        x = tf.transpose(x, _shapes.constant([0, 1, 2, 4, 3]))  # [N, Cin, kh, W', Ho]
        x = tf.gather(x, _shapes.constant(_tap_index(kw, dilations[2], out_w, strides[2])),
                      axis=_shapes.constant(3))                 # [N, Cin, kh, kw, Wo, Ho]
        dz = tf.transpose(dZ, _shapes.constant([0, 2, 1, 3]))   # [N, Wo, Ho, Cout]
    rows = tf.reshape(x, _shapes.constant([-1, c_in * kh * kw, positions]))
    grad = tf.matmul(rows, tf.reshape(dz, _shapes.constant([-1, positions, c_out])))
    size = c_in * kh * kw                                       # grad: [N, size, Cout]
    if not _shapes.rows_are_groups(dZ, G, use.rows.k):          # T images per group
        grad = tf.reshape(grad, group_target(G, [-1, size, c_out], use.rows.k))
        grad = tf.reduce_sum(grad, axis=_shapes.constant(1))    # [G, Cin*kh*kw, Cout]
    if c_in > 1:                                                # (c, u, v) -> (u, v, c)
        grad = tf.reshape(grad, group_target(G, [c_in, kh * kw, c_out]))
        grad = tf.transpose(grad, _shapes.constant([0, 2, 1, 3]))
    return tf.reshape(grad, group_target(G, [kh, kw, c_in, c_out]))


def by_examples(use, dZ, G):
    """"examples": the one-example loop in the graph, TensorFlow's batch filter-gradient
    kernel (`geometry.filter_gradient`) on each group's rows, x [T, H, W, Cin] and dZ
    [T, Ho, Wo, Cout], one call per group (`tf.map_fn`): the batch gradient's FLOPs in G
    calls, no patches or taps written."""
    def grouped(tensor):                        # [G*T, H, W, C] -> [G, T, H, W, C]
        dims = [_rows.dim(tensor, axis) for axis in range(1, tensor.shape.rank)]
        return tf.reshape(tensor, group_target(G, [-1] + dims, use.rows.k))

    x = use.op.inputs[0]
    return tf.map_fn(lambda pair: filter_gradient(use, pair[1], x=pair[0]),
                     (grouped(x), grouped(dZ)), fn_output_signature=x.dtype)  # [G, *w]

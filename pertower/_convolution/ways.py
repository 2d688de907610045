"""The three ways of `conv2d.Conv2DRule.per_group` ("shifts", "patches", "grouped";
the identities and the choice are in `conv2d`'s docstring).

Notation (as in `conv2d`):
    N   images in the batch (N = G*T)        G   groups of contiguous examples
    T   images per group (k per example)     P = Ho*Wo  output positions per image
    kh, kw  filter size    Cin, Cout  input, output channels    g  channel groups

Every way writes the per-group gradients [G, kh, kw, Cin, Cout] with ONE op where it
can (a batched matmul or a backward-filter kernel whose output is reshaped, not copied);
only "shifts" with one matmul per tap stacks its kh*kw results, and only where those
results are smaller than the taps they would be stacked from (`tap_layout`).
"""

import tensorflow as tf

from pertower._convolution import taps as _conv_taps
from pertower._layout import _rows
from pertower._layout import _shapes
from pertower._convolution.geometry import (
    attributes, explicitly_padded, fold_groups, group_target, groups, mul,
    patches, sizes, split_channels, taps, to_groups)

__all__ = ["FEW_POSITIONS", "tap_layout", "by_patches", "by_shifts", "by_grouped"]

# `ConvOptions.few_positions` None: below this many output positions per image the
# per-example gradients take "channels" (one ExtractImagePatches, one matmul: the
# per-tap matmuls are too small to run well; docs/conv_ways.md)
FEW_POSITIONS = 512


def tap_layout(options, use):
    """How "shifts" lays out the taps of `use` (a `ConvOptions` `options`):

        "one"       a 1x1 filter (one tap, no groups): one matmul of the (strided) input;
        "thin"      Cin < `thin_channels`: the taps stacked along the contracted rows,
                    the input channels-first, one matmul;
        "channels"  few positions (P < `few_positions`; None: `FEW_POSITIONS`) or
                    per-tap results larger than the taps (T*P < Cout, so stacking
                    kh*kw results of [Cin, Cout] would copy more than the taps hold): the taps side by side in channels,
                    [G, T*P, kh*kw*Cin] in the filter's order (the patches, written by
                    ONE `ExtractImagePatches`), one matmul straight into [G, kh*kw*Cin,
                    Cout];
        "per_tap"   one matmul per tap, the kh*kw results stacked (grouped filters
                    always: one contraction per tap and group).
    """
    kh, kw, c_in, c_out = use.weight_shape.as_list()
    if groups(use.op) != 1:
        return "per_tap"
    if kh * kw == 1:
        return "one"
    if c_in < options.thin_channels:
        return "thin"
    positions = _rows.static_size(use.output.shape[1:3])
    k = use.rows.k if isinstance(use.rows.k, int) else 1
    few = FEW_POSITIONS if options.few_positions is None else options.few_positions
    if positions < few or k * positions < c_out:
        return "channels"
    return "per_tap"


def by_patches(use, dZ, G):
    """"patches": `tf.image.extract_patches` and one batched contraction per group."""
    kh, kw, c_in, c_out = use.weight_shape.as_list()
    g = groups(use.op)
    k = use.rows.k
    x_patches = to_groups(patches(use.op, kh, kw), G, k)  # [G, T*Ho*Wo, kh*kw*g*Cin]
    dZ_g = to_groups(dZ, G, k)                      # [G, T*Ho*Wo, Cout]
    if g == 1:
        grad = tf.matmul(x_patches, dZ_g, transpose_a=True)    # [G, kh*kw*Cin, Cout]
        return tf.reshape(grad, group_target(G, [kh, kw, c_in, c_out]))
    # the patches' channels (kh, kw, g*Cin) and the outputs by group:
    # [G, P, kh*kw*g*Cin] -> [G, P, kh*kw, g, Cin]; [G, P, Cout] -> [G, P, g, Cout/g]
    x_patches = split_channels(x_patches, G, [kh * kw, g, c_in])
    dZ_g = split_channels(dZ_g, G, [g, c_out // g])
    grad = tf.einsum("gpkjc,gpjo->gkcjo", x_patches, dZ_g)    # [G, kh*kw, Cin, g, Cout/g]
    return tf.reshape(grad, group_target(G, [kh, kw, c_in, c_out]))


def by_shifts(options, use, dZ, G):
    """"shifts": the filter taps as strided slices of the padded input (or, laid out
    side by side, as the patches; thin: gathered, `_conv_taps`), contracted with dZ by
    `tap_layout`."""
    kh, kw, c_in, c_out = use.weight_shape.as_list()
    g, k = groups(use.op), use.rows.k
    layout = tap_layout(options, use)
    if layout in ("one", "channels", "per_tap") and g == 1 and _shapes.rows_are_groups(
            dZ, G, k):
        return _one_image_per_group(use, dZ, G, layout)
    if layout == "thin":
        # the taps stacked along the contracted rows, the input moved channels-first
        # (a concat along a thin last axis runs slowly), by one gather of the row taps
        # and kw column slices or one gather (`_conv_taps`), not one slice per tap
        return _conv_taps.thin_gradients(use, dZ, G)
    dZ_g = to_groups(dZ, G, k)                     # [G, T*Ho*Wo, Cout]
    if layout == "one":
        x_g = to_groups(taps(use.op, [1, 1])[0], G, k)   # [G, T*Ho*Wo, Cin]
        grad = tf.matmul(x_g, dZ_g, transpose_a=True)         # [G, Cin, Cout]
        return tf.reshape(grad, group_target(G, [1, 1, c_in, c_out]))
    if layout == "channels":
        # the taps side by side in channels: the patches ([N, Ho, Wo, kh*kw*Cin], the
        # filter's order), one op where kh*kw slices and a concat would be kh*kw + 1
        rows = to_groups(patches(use.op, kh, kw), G, k)        # [G, T*P, kh*kw*Cin]
        grad = tf.matmul(rows, dZ_g, transpose_a=True)        # [G, kh*kw*Cin, Cout]
        return tf.reshape(grad, group_target(G, [kh, kw, c_in, c_out]))
    if g > 1:
        dZ_g = split_channels(dZ_g, G, [g, c_out // g])     # [G, T*Ho*Wo, g, Cout/g]
    per_tap = []                                              # kh*kw x [G, Cin, Cout]
    for x_tap in taps(use.op, [kh, kw]):                        # [G*T, Ho, Wo, g*Cin]
        x_g = to_groups(x_tap, G, k)               # [G, T*Ho*Wo, g*Cin]
        if g == 1:
            per_tap.append(tf.matmul(x_g, dZ_g, transpose_a=True))
            continue
        x_g = split_channels(x_g, G, [g, c_in])
        tap = tf.einsum("gpjc,gpjo->gcjo", x_g, dZ_g)         # [G, Cin, g, Cout/g]
        per_tap.append(tf.reshape(tap, group_target(G, [c_in, c_out])))
    grad = tf.stack(per_tap, axis=1)                          # [G, kh*kw, Cin, Cout]
    return tf.reshape(grad, group_target(G, [kh, kw, c_in, c_out]))


def _one_image_per_group(use, dZ, G, layout):
    """"shifts" with one image per group (T = 1, G = N, no channel groups): each
    contraction over the positions is ONE Einsum of the [N, Ho, Wo, C] tensors as they
    are (no reshape of the taps or of dZ; the kernel contracts Ho, Wo in place)."""
    kh, kw, c_in, c_out = use.weight_shape.as_list()
    if layout == "one":
        grad = tf.einsum("nhwc,nhwo->nco", taps(use.op, [1, 1])[0], dZ)     # [N, Cin, Cout]
    elif layout == "channels":
        grad = tf.einsum("nhwc,nhwo->nco", patches(use.op, kh, kw), dZ)   # [N, kh*kw*Cin, Cout]
    else:
        grad = tf.stack([tf.einsum("nhwc,nhwo->nco", x_tap, dZ)
                         for x_tap in taps(use.op, [kh, kw])], axis=1)   # [N, kh*kw, Cin, Cout]
    return tf.reshape(grad, group_target(G, [kh, kw, c_in, c_out]))


def by_grouped(use, dZ, G):
    """"grouped": the batch folded into channels, one Conv2DBackpropFilter."""
    kh, kw, c_in, c_out = use.weight_shape.as_list()
    strides, dilations, _, _ = attributes(use.op)
    x, padding = explicitly_padded(use.op)
    filter_sizes = sizes([kh, kw, c_in, mul(G, c_out)])
    grad = tf.raw_ops.Conv2DBackpropFilter(
        input=fold_groups(x, G, use.rows.k),      # [T, H, W, G*Cin]
        filter_sizes=filter_sizes,
        out_backprop=fold_groups(dZ, G, use.rows.k),   # [T, Ho, Wo, G*Cout]
        strides=strides, padding=padding, dilations=dilations,
        data_format="NHWC")                       # [kh, kw, Cin, G*Cout]
    grad = tf.reshape(grad, _shapes.constant([kh, kw, c_in, -1, c_out]))
    return tf.transpose(grad, _shapes.constant([3, 0, 1, 2, 4]))    # [G, kh, kw, Cin, Cout]

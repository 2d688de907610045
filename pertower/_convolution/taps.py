"""The "thin" layout of the 2-D "shifts" (`ways.by_shifts`, Cin <
`ConvOptions.thin_channels`) with a number of ops that does not grow with the taps.

Notation as in `rules.conv2d`; H', W' the padded input's sizes (`geometry.padded_input`).

Per image, the rows of the contraction are the input values every tap (u, v) and input
channel c multiplies, [Cin*kh*kw, Ho, Wo], and
    grad(W)[u, v, c, o] = sum_p rows[(c, u, v), p] dz_p[o].
They are built from the channels-first padded input [N, Cin, H', W'] without one slice
per tap:
  - the kh row taps by ONE `GatherV2` of its rows (index [kh, Ho]: u*d + i*s), each
    gathered item a whole row of W' values: [N, Cin, kh, Ho, W'];
  - with a column stride of 1, the kw column taps as kw contiguous slices stacked:
    [N, Cin, kh, kw, Ho, Wo] (kw slices, not kh*kw);
  - with a column stride > 1 (where a strided slice copies value by value), the rows
    moved last ([N, Cin, kh, W', Ho]) and ONE `GatherV2` of the columns (index [kw, Wo])
    takes whole columns of Ho values: [N, Cin, kh, kw, Wo, Ho], contracted with dZ as
    [N, Wo, Ho, Cout].
Then one batched matmul per image, [N, Cin*kh*kw, P] x [N, P, Cout], summed over each
group's T images where a group holds several, and the small result moved to the filter's
order [G, kh, kw, Cin, Cout].

Ops built: about 3*kw + 12 (stride 1) or about 14 (strided), not one slice per tap.
"""

import numpy as np
import tensorflow as tf

from pertower._layout import _rows
from pertower._layout import _shapes
from pertower._convolution.geometry import attributes, group_target, padded_input, window

__all__ = ["thin_gradients"]


def _tap_index(taps, dilation, out, stride):
    """[taps, out] int32 as nested lists: tap t's input index at output position i,
    t*dilation + i*stride."""
    index = np.arange(taps)[:, None] * dilation + np.arange(out)[None, :] * stride
    return index.astype(np.int32).tolist()


def thin_gradients(use, dZ, G):
    """[G, kh, kw, Cin, Cout]: the per-group filter gradients of `use` (a Conv2D
    without channel groups, static heights and widths) for its output gradient `dZ`
    [N, Ho, Wo, Cout] (`use.rows.k` images per example), built as the module docstring
    says."""
    kh, kw, c_in, c_out = use.weight_shape.as_list()
    strides, dilations, _, _ = attributes(use.op)
    out_h, out_w = _rows.static_dims(use.op.outputs[0])[1:3]
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

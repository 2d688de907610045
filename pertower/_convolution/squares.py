"""Sums of squared per-example filter gradients over C columns (the rules' cheap
`sum_squared`), for Conv2D and DepthwiseConv2dNative, in one contraction.

Notation as in `rules.conv2d`; B examples, C columns, R = k*P rows per example,
I = kh*kw*Cin, dz_ipc column c's output gradient:
    squares_i(W) = sum_c grad_{i,c}(W)^2,   grad_{i,c}(W) = sum_p x_ip ⊗ dz_ipc.

    "formed"  the columns folded into the output channels (c*Cout + o; depthwise
              ch*(C*M) + c*M + j) make ONE call of the rule's `per_group` with C*Cout
              outputs, [B, kh, kw, Cin, C*Cout], squared and summed over c (and i unless
              per example). Cost ~2 B R I C Cout, holds B I C Cout numbers.
    "ghost"   (Conv2D, one group) the ghost norm (Bu, Mao, Xu 2022, arXiv 2205.10683):
                  squares_i(W)[t, o] = sum_{p,q} x_ip[t] x_iq[t] D_i[p, q, o],
                  D_i[p, q, o] = sum_c dz_ipc[o] dz_iqc[o],
              cost ~2 B R^2 (C Cout + I Cout + I), holds B R^2 (I + Cout) numbers.

`choose` takes the cheaper. Grouped Conv2D, Conv3D and shapes that are not static have
no cheap form (None: the caller takes the rule per column).
"""

import dataclasses

import tensorflow as tf

from pertower._convolution import geometry
from pertower._layout import _rows

__all__ = ["WAYS", "choose", "sum_squared", "formed_size"]

WAYS = ("formed", "ghost")


def _sizes(use, C):
    """(R, I, Cout) as static ints (Cout: the multiplier for depthwise), or None."""
    if (not isinstance(C, int) or use.through or not use.weight_shape.is_fully_defined()
            or use.weight_shape.rank != 4):
        return None
    if use.op.type == "Conv2D" and geometry.groups(use.op) != 1:
        return None
    out = use.output.shape
    spatial = out[2:4] if _nchw(use) else out[1:3]
    positions = tf.TensorShape(spatial).num_elements()
    if positions is None or use.rows.k is None:
        return None
    kh, kw, c_in, c_out = use.weight_shape.as_list()
    return use.rows.k * positions, kh * kw * c_in, c_out


def _nchw(use):
    """Whether `use` is a view of an NCHW convolution (`_convolution.views`)."""
    return getattr(getattr(use, "view", None), "nchw", False)


def choose(use, C):
    """"formed" or "ghost", the cheaper by the module docstring's counts, or None."""
    sizes = _sizes(use, C)
    if sizes is None:
        return None
    R, I, c_out = sizes
    if use.op.type != "Conv2D":
        return "formed"
    formed = R * I * C * c_out
    ghost = R * R * (C * c_out + I * c_out + I)
    return "ghost" if ghost < formed else "formed"


def formed_size(use, C, per_example):
    """Numbers per example that `sum_squared` holds for C columns (the memory guard's),
    or None when it has no cheap form."""
    way = choose(use, C)
    if way is None:
        return None
    R, I, c_out = _sizes(use, C)
    result = I * c_out if per_example else 0
    if way == "ghost":
        return R * R * (I + c_out) + result
    return I * C * c_out + result


def _wide_columns(use, dZ_columns, C):
    """dZ_columns [C, N, ...] as one output gradient with the columns in its channels:
    [N, Ho, Wo, C*Cout] (NCHW views: [N, C*Cout, Ho, Wo]); depthwise [N, ..., Cin*C*mult]."""
    rank = dZ_columns.shape.rank                    # 5: [C, N, Ho, Wo, Ch] or [C, N, Ch, Ho, Wo]
    channel = 2 if _nchw(use) else rank - 1               # the channel axis of the columns
    dims = [_rows.dim(dZ_columns, a) for a in range(rank)]
    if use.op.type == "DepthwiseConv2dNative":
        c_in, mult = use.weight_shape.as_list()[2:]
        split = dims[:channel] + [c_in, mult] + dims[channel + 1:]
        dZ_columns = tf.reshape(dZ_columns, _rows.group_shape(split[0], split[1:]))
        # [C, N, .., Cin, mult, ..] -> [N, .., Cin, C, mult, ..]
        order = list(range(1, channel)) + [channel, 0] + list(range(channel + 1, rank + 1))
    else:
        # [C, N, .., Cout, ..] -> [N, .., C, Cout, ..] (a C axis moved last transposes slowly)
        order = list(range(1, channel)) + [0] + list(range(channel, rank))
    moved = tf.transpose(dZ_columns, order)
    wide = dims[1:channel] + [-1] + dims[channel + 1:]
    return tf.reshape(moved, _rows.group_shape(wide[0], wide[1:]))


def sum_squared(rule, use, dZ_columns, B, per_example=False, way=None):
    """sum_c grad_{i,c}(W)^2 of `use`'s filter for dZ_columns [C, N, ...] (C static):
    [B, *W.shape] when per_example, else [*W.shape]; None when there is no cheap form
    (the caller then runs the rule per column). `rule.per_group` computes the wide
    filter gradient; `way`: None for `choose`'s pick, or "formed"/"ghost" (tests)."""
    C = tf.compat.dimension_value(dZ_columns.shape[0])
    picked = choose(use, C)
    if picked is None:
        return None
    way = way or picked
    if way not in WAYS or (way == "ghost" and use.op.type != "Conv2D"):
        raise ValueError(f"`way` must be one of {WAYS} (ghost for Conv2D only), but "
                         f"received {way!r}.")
    kh, kw, c_in, c_out = use.weight_shape.as_list()
    wide_use = dataclasses.replace(use, weight_shape=tf.TensorShape([kh, kw, c_in,
                                                                     C * c_out]))
    dZ = _wide_columns(use, dZ_columns, C)
    if getattr(use, "view", None) is not None:
        wide_use, dZ = wide_use.inner(dZ)                # NHWC, example-major rows
    if way == "ghost":
        squares = _ghost(wide_use, dZ, B, C, c_out, per_example)
        return tf.reshape(squares, _rows.group_shape(B, [kh, kw, c_in, c_out])
                          if per_example else [kh, kw, c_in, c_out])
    grads = rule.per_group(wide_use, dZ, B)                      # [B, kh, kw, Cin, C*Cout]
    grads = tf.reshape(grads, _rows.group_shape(B, [kh, kw, c_in, C, c_out]))
    squares = tf.reduce_sum(tf.square(grads), axis=4)            # [B, kh, kw, Cin, Cout]
    return squares if per_example else tf.reduce_sum(squares, axis=0)


def _ghost(use, dZ, B, C, c_out, per_example):
    """[B, I, Cout] or [I, Cout]: sum_{p,q} (x_p ⊙ x_q) ⊗ D[p, q] per example, from the
    NHWC `use` and its wide dZ [N, Ho, Wo, C*Cout]."""
    kh, kw = use.weight_shape.as_list()[:2]
    x = _rows.to_groups(geometry.patches(use.op, kh, kw), B)            # [B, R, I]
    dZ = tf.reshape(_rows.to_groups(dZ, B), _rows.group_shape(B, [-1, C, c_out]))
    gram_dz = tf.einsum("bpco,bqco->bpqo", dZ, dZ)                         # [B, R, R, Cout]
    gram_x = x[:, :, None, :] * x[:, None, :, :]                           # [B, R, R, I]
    if per_example:
        return tf.einsum("bpqi,bpqo->bio", gram_x, gram_dz)                # [B, I, Cout]
    I = _rows.dim(x, 2)
    return tf.matmul(tf.reshape(gram_x, [-1, I]), tf.reshape(gram_dz, [-1, c_out]),
                     transpose_a=True)                                     # [I, Cout]

"""The squared norms of a Conv2D's per-example filter gradients where
`rules.conv2d.ConvolutionRule.norm_strategy` forms them ("formed"), kept for the
clipped sum (`registry.FormedNorms`). Notation as in `rules.conv2d`.

The padded input moved channels-first once, [G, Cin, T, H', W'], its kh*kw taps
concatenated into the rows [G, kh*kw*Cin, T*P], times dZ [G, T*P, Cout]: the per-group
gradients [G, kh*kw*Cin, Cout], their squared norms one sum of squares. With G and T*P
static the rows are built in chunks of whole groups of at most CHUNK_FLOATS numbers
(`chunk_sizes`); with G <= FEW_GROUPS and oneDNN off each group's product is one MatMul
(on all threads), else one batched matmul per chunk (docs/conv_ways.md).
"""

import tensorflow as tf

from pertower._layout import _shapes
from pertower._convolution.options import onednn_runs
from pertower._convolution.geometry import (
    group_target, groups, padded_input, spatial_pads, taps)
from pertower._layout._shapes import to_groups

__all__ = ["FEW_GROUPS", "CHUNK_FLOATS", "chunk_sizes", "formed_norms", "squares_of"]

FEW_GROUPS = 128
CHUNK_FLOATS = 2 ** 20


def chunk_sizes(G, floats_per_group):
    """The sizes of the chunks of whole groups that `formed_norms` builds the rows in:
    [G] for a tensor G or an unknown `floats_per_group` (None), else as few near-equal
    chunks as keep each at most CHUNK_FLOATS numbers (one group at least)."""
    if not isinstance(G, int) or floats_per_group is None:
        return [G]
    count = min(G, max(1, -(-G * floats_per_group // CHUNK_FLOATS)))
    return [G // count + (1 if j < G % count else 0) for j in range(count)]


def squares_of(per_group):
    """[G]: the squared Frobenius norm of each [G, R, C] slice, a sum of squares over
    its R*C entries (an einsum "grc,grc->g" would be a batched matmul of [G, 1, R*C] by
    [G, R*C, 1], one long dot product per group)."""
    size = per_group.shape[1:].num_elements()                     # R*C (the filter's)
    flat = tf.reshape(per_group, _shapes.constant([-1, size]))    # [G, R*C]
    return tf.reduce_sum(tf.square(flat), axis=1, name="formed_squares")


def formed_norms(options, use, dZ, G):
    """(squares [G], per-group gradients [G, kh*kw*Cin, Cout], their map to [*w.shape])
    of a `registry.FormedNorms` for the NHWC Conv2D `use` and dZ [N, Ho, Wo, Cout], in
    the layout of the module notes; None where that does not apply (not 2-D, channel
    groups, a 1x1 filter, sizes not static, or a forced way other than "shifts")."""
    if use.weight_shape.rank != 4:
        return None
    kh, kw, c_in, c_out = use.weight_shape.as_list()
    if (options.strategy not in ("auto", "shifts") or groups(use.op) != 1 or
            kh * kw == 1 or spatial_pads(use.op, 1, 1) is None):
        return None
    positions = use.output.shape[1:3].num_elements()
    k = use.rows.k
    x = padded_input(use.op, kh, kw)                                 # [N, H', W', Cin]
    height, width = x.shape.as_list()[1:3]
    x = tf.reshape(x, group_target(G, [-1, height, width, c_in], k))  # [G, T, H', W', Cin]
    x = tf.transpose(x, _shapes.constant([0, 4, 1, 2, 3]))            # [G, Cin, T, H', W']
    dZ = to_groups(dZ, G, k)                                         # [G, T*P, Cout]
    columns = k * positions if isinstance(k, int) else None          # T*P
    sizes = chunk_sizes(G, kh * kw * c_in * columns if columns else None)
    if len(sizes) > 1:   # (an op's output split along axis 0 shares its buffer)
        x, dZ = tf.split(x, sizes), tf.split(dZ, sizes)
    else:
        x, dZ = [x], [dZ]
    one_by_one = isinstance(G, int) and G <= FEW_GROUPS and not onednn_runs(options)
    products = []
    for n, x_part, dZ_part in zip(sizes, x, dZ):
        rows = tf.concat(taps(use.op, [kh, kw], x_part, axes=(3, 4)), axis=1)
        rows = tf.reshape(rows, group_target(n, [kh * kw * c_in, -1], columns))  # [n, R, T*P]
        if one_by_one:   # one MatMul per group on the unstacked operands (shared buffers)
            products += [tf.matmul(r, c) for r, c in zip(tf.unstack(rows, n),
                                                          tf.unstack(dZ_part, n))]
        else:
            products.append(tf.matmul(rows, dZ_part))              # [n, kh*kw*Cin, Cout]
    per_group = (tf.stack(products) if one_by_one else               # [G, kh*kw*Cin, Cout]
                 products[0] if len(products) == 1 else tf.concat(products, 0))

    def to_weight(total):   # [kh*kw*Cin, Cout] -> [kh, kw, Cin, Cout]
        return tf.reshape(total, [kh, kw, c_in, c_out])
    return squares_of(per_group), per_group, to_weight

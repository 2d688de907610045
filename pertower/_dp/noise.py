"""Gaussian noise for DP-SGD: N(0, 1) draws by the Box–Muller transform.

Notation:
    n   draws wanted        h = ceil(n / 2) pairs (rounded up to a multiple of 16)
    u   [2, h] stateless Philox uniforms in [0, 1) (`uniform_pairs`)

Box and Muller (1958), "A note on the generation of random normal deviates": for u0,
u1 independent and uniform on (0, 1],

    r = sqrt(-2 ln u0),   z0 = r cos(2π u1),   z1 = r sin(2π u1)

are two independent N(0, 1) draws (`box_muller`; 1 - u lies in (0, 1], so the logarithm
is finite). Each number uses one 32-bit Philox word (float32: 23 of its bits; float64
draws use two words per uniform). TensorFlow's own normal kernels use the same transform
on the same kind of uniforms; the largest |z| it reaches is sqrt(-2 ln 2^-23) = 5.65 σ
from float32 uniforms (8.49 σ from float64). Here it is a few elementwise ops over all h
pairs at once, where `tf.random.stateless_normal`'s kernel transforms one number at a
time; the noise over every weight is most of a DP-SGD step's extra cost on large models.

Copies. TensorFlow slices a tensor along its first axis without copying only when the
slice starts and ends on its 64-byte alignment, so h is rounded up to a multiple of 16
(u[0], u[1] and the two halves of the [2h] draws are then views), and `add_noise`
splits the [2h] draws into the weights' pieces and an unused tail in ONE split, rather
than cutting [n] first (a copy of all n draws when n is odd).

The inverse CDF z = Φ⁻¹(u) (Devroye 1986, "Non-Uniform Random Variate Generation", ch. 2)
on the midpoints u + 2^-24 = (k + 1/2) 2^-23 would reach only |Φ⁻¹(2^-24)| = 5.29 σ, where
a coordinate shifted by its sensitivity lands beyond the unshifted noise's support about
five times as often (for a shift of 1 σ: 8.9e-6 against 1.7e-6 per coordinate). The draw
is the same bits on one thread and on a pool (the Philox op and the elementwise ops shard
by position). What this draw and the ways tried instead cost: docs/benchmark.md, "The
noise draw".
"""

import math

import tensorflow as tf

__all__ = ["ALIGNED_PAIRS", "uniform_pairs", "box_muller", "standard_normal", "normal_pairs",
           "add_noise"]

# pairs per row are a multiple of this: 16 float32 (or more float64) = 64 bytes, the
# alignment at which TensorFlow slices along the first axis without a copy
ALIGNED_PAIRS = 16


def uniform_pairs(n, key, dtype=tf.float32):
    """[2, h] stateless Philox uniforms in [0, 1), h = ceil(n / 2) rounded up to a
    multiple of 16: the uniforms `normal_pairs` transforms.

    Args:
      n: the number of draws wanted (an int or a scalar int32 tensor).
      key: [2] int64, the stateless Philox key.
      dtype: float64 uniforms for float64; any other floating dtype gives float32.

    Returns:
      [2, h] of float32 or float64.
    """
    work = tf.float64 if tf.as_dtype(dtype) == tf.float64 else tf.float32
    pairs = ((n + 1) // 2 + ALIGNED_PAIRS - 1) // ALIGNED_PAIRS * ALIGNED_PAIRS
    return tf.random.stateless_uniform(tf.stack([2, pairs]), seed=key, dtype=work)


def box_muller(u):
    """[2h] N(0, 1) draws from [2, h] uniforms in [0, 1): z0 = r cos(2π u1) first, then
    z1 = r sin(2π u1), r = sqrt(-2 ln(1 - u0)) (finite for every u0 < 1).

    Args:
      u: [2, h] uniforms in [0, 1), float32 or float64.

    Returns:
      [2h] of u's dtype.
    """
    radius = tf.sqrt(-2.0 * tf.math.log1p(-u[0]))                    # [h], 1 - u0 in (0, 1]
    angle = (2.0 * math.pi) * u[1]                                   # [h]
    return tf.concat([radius * tf.cos(angle), radius * tf.sin(angle)], axis=0)  # [2h]


def normal_pairs(n, key, dtype=tf.float32):
    """[2h] independent N(0, 1) draws of `dtype` (computed in float64 for float64, else
    in float32 and cast), a function of `key` and h alone; n and key as in
    `uniform_pairs` (`standard_normal` and `add_noise` take the first n)."""
    return tf.cast(box_muller(uniform_pairs(n, key, dtype)), dtype)     # [2h]


def standard_normal(n, key, dtype=tf.float32):
    """[n] independent N(0, 1) draws, the first n of `normal_pairs` (the same key gives
    the same draws)."""
    return normal_pairs(n, key, dtype)[:n]                          # [n]


def add_noise(gradients, stddevs, key):
    """g_x + s_x N(0, 1) per entry of each weight x, from ONE draw of P numbers over all
    weights (so that one key gives every weight its own noise).

    Args:
      gradients: one tensor per weight, [*x.shape].
      stddevs: one stddev s_x per weight (a float or a scalar tensor).
      key: [2] int64, the stateless key of the draw.

    Returns:
      The noised gradients, [*x.shape] each.
    """
    dtype = gradients[0].dtype
    # static sizes where known, so that the draw need not wait for the gradients
    sizes = [g.shape.num_elements() if g.shape.is_fully_defined() else tf.size(g)
             for g in gradients]
    with tf.name_scope("noise"):
        total = sum(sizes) if all(isinstance(s, int) for s in sizes) else tf.add_n(
            [tf.convert_to_tensor(s, tf.int32) for s in sizes])
        noise = normal_pairs(total, key, dtype)                           # [2h], 2h >= P
        tail = tf.size(noise) - total                                     # unused draws
    # [2h] -> [P_x] each (and the tail), in one split
    pieces = tf.split(noise, tf.stack(sizes + [tail]), num=len(gradients) + 1)[:-1]
    # [P_x] -> [*x.shape]
    return [g + tf.cast(s * tf.reshape(p, g.shape if g.shape.is_fully_defined()
                                       else tf.shape(g)), g.dtype)
            for g, p, s in zip(gradients, pieces, stddevs)]

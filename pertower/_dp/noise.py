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
from float32 uniforms (8.49 σ from float64). Done as a few elementwise ops over all h
pairs at once, it runs about 1.6 times as fast as `tf.random.stateless_normal` (whose
kernel does it one number at a time), and the noise over every weight is most of a
DP-SGD step's extra cost on large models.

Copies. TensorFlow slices a tensor along its first axis without copying only when the
slice starts and ends on its 64-byte alignment, so h is rounded up to a multiple of 16
(u[0], u[1] and the two halves of the [2h] draws are then views), and `add_noise`
splits the [2h] draws into the weights' pieces and an unused tail in ONE split, rather
than cutting [n] first (a copy of all n draws when n is odd). On a loaded 2-core AVX2
CPU the unaligned slices were about half the draw's time for 2.1 M draws.

Cost (2-core AVX2 CPU, 2026-12-02, load 5-14: CPU ms per draw, medians of 15-25
interleaved runs of 10 chained draws; torch's `normal_` in its own process). At P =
57 k / 92 k / 2.1 M, on one intra-op thread: the Philox uniforms alone 0.51 / 0.72 /
14.0, this draw 0.76 / 1.11 / 25-27, torch's whole draw 0.37 / 0.73 / 12.4; with
TensorFlow's default threads (two) the uniforms cost 0.67 / 0.90 / 14.3 and the draw
1.30 / 1.78 / 28-29 (the elementwise ops shard small tensors at a loss). The transform
is per-number work, about 10 ns of CPU per pair on one thread (each of log1p, cos and
sin about 2 ns per number, sqrt, the multiplies and the concat 0.4-1.4), not per-op
overhead: TensorFlow's grappler already drops the multiply and add of 1 and 0 that
`stateless_uniform` puts after the raw Philox op (the raw op alone measures the same)
and fuses -log1p(-u) into one `_UnaryOpsComposition`. So on one thread the uniforms
alone cost about torch's whole draw, and 1.2× of torch's time is out of reach of any
transform made of TensorFlow ops over these uniforms.

Tried and not better (same runs, beyond the noise of ±5%): one `cos` of [2, h] phases
instead of cos, sin and the concat; log(1 - u) in place of log1p(-u); one broadcast
multiply of the stacked [2, h] cos and sin by r; √2 moved out of the fused radius.
Slower: the inverse CDF z = Φ⁻¹(u) (Devroye 1986, "Non-Uniform Random Variate
Generation", ch. 2) as ONE `tf.math.ndtri` op (Eigen's Cephes ndtri) on the midpoints
u + 2^-24 = (k + 1/2) 2^-23, 4 ops in all but 8.9-10 ns of CPU per number on one
thread against this transform's 4.5-6 (2.1 M: 33 against 26 ms), `tf.math.erfinv` the
same (36 ms); it would also reach only |Φ⁻¹(2^-24)| = 5.29 σ, where a coordinate
shifted by its sensitivity lands beyond the unshifted noise's support about five times
as often (for a shift of 1 σ: 8.9e-6 against 1.7e-6 per coordinate); TensorFlow's
`StatelessRandomNormalV2` (2 ops, scalar Box–Muller: 1.27 / 1.9 / 42 ms); the whole
draw under XLA (`jit_compile`, about 60×: its Philox expansion), the transform alone
under XLA (1.5-2.2×). The draw is the same bits on one thread and on a pool (the Philox
op and the elementwise ops shard by position).
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
    """[2h] independent N(0, 1) draws, h = ceil(n / 2) rounded up to a multiple of 16:
    at least n, a function of the [2] int64 `key` and h alone (`standard_normal` and
    `add_noise` take their first n).

    Args:
      n: the number of draws wanted (an int or a scalar int32 tensor).
      key: [2] int64, the stateless Philox key.
      dtype: float64 draws are computed in float64; any other floating dtype in float32
        and cast.

    Returns:
      [2h] of `dtype`.
    """
    return tf.cast(box_muller(uniform_pairs(n, key, dtype)), dtype)     # [2h]


def standard_normal(n, key, dtype=tf.float32):
    """[n] independent N(0, 1) draws, a function of the [2] int64 `key` alone (the
    first n of `normal_pairs`).

    Args:
      n: the number of draws (an int or a scalar int32 tensor).
      key: [2] int64, the stateless Philox key (the same key gives the same draws).
      dtype: float64 draws are computed in float64; any other floating dtype in float32
        and cast.

    Returns:
      [n] of `dtype`.
    """
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

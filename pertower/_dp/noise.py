"""Gaussian noise for DP-SGD: N(0, 1) draws by the Box–Muller transform.

Notation:
    n   draws wanted        h = ceil(n / 2) pairs (rounded up to a multiple of 16)
    u   [2, h] stateless Philox uniforms in [0, 1) (`uniform_pairs`)

Box and Muller (1958), "A note on the generation of random normal deviates": for u0,
u1 independent and uniform on (0, 1],

    r = sqrt(-2 ln u0),   z0 = r cos(2π u1),   z1 = r sin(2π u1)

are two independent N(0, 1) draws (1 - u lies in (0, 1], so the logarithm is finite).
The largest |z| is sqrt(-2 ln 2^-23) = 5.65 σ from float32 uniforms (8.49 σ from
float64). The draw is the same bits on one thread and on a pool. h is a multiple of 16
(64 bytes of float32, where TensorFlow slices without a copy), so that `add_noise` cuts
the [2h] draws into the weights' pieces in ONE split (docs/benchmark.md, "The noise
draw"). `GaussianNoise` is the noise of a DP step; another mechanism is another object
with `key` and `add`.
"""

import math

import tensorflow as tf

__all__ = ["ALIGNED_PAIRS", "uniform_pairs", "box_muller", "standard_normal", "normal_pairs",
           "normal_like", "add_noise", "GaussianNoise"]

# 16 float32 = 64 bytes, the alignment at which TensorFlow slices without a copy
ALIGNED_PAIRS = 16


def uniform_pairs(n, key, dtype=tf.float32):
    """[2, h] stateless Philox uniforms in [0, 1); n an int or a scalar int32 tensor,
    key [2] int64; float64 for float64, else float32."""
    work = tf.float64 if tf.as_dtype(dtype) == tf.float64 else tf.float32
    pairs = ((n + 1) // 2 + ALIGNED_PAIRS - 1) // ALIGNED_PAIRS * ALIGNED_PAIRS
    return tf.random.stateless_uniform(tf.stack([2, pairs]), seed=key, dtype=work)


def box_muller(u):
    """[2, h] uniforms in [0, 1) -> [2h] N(0, 1) draws: z0 = r cos(2π u1) first, then
    z1 = r sin(2π u1), r = sqrt(-2 ln(1 - u0))."""
    radius = tf.sqrt(-2.0 * tf.math.log1p(-u[0]))                    # [h], 1 - u0 in (0, 1]
    angle = (2.0 * math.pi) * u[1]                                   # [h]
    return tf.concat([radius * tf.cos(angle), radius * tf.sin(angle)], axis=0)  # [2h]


def normal_pairs(n, key, dtype=tf.float32):
    """[2h] independent N(0, 1) draws of `dtype`, a function of `key` and h alone."""
    return tf.cast(box_muller(uniform_pairs(n, key, dtype)), dtype)     # [2h]


def standard_normal(n, key, dtype=tf.float32):
    """[n] N(0, 1) draws, the first n of `normal_pairs`."""
    return normal_pairs(n, key, dtype)[:n]                          # [n]


def normal_like(gradients, key):
    """[*x.shape] N(0, 1) draws per weight x, cut from ONE draw over all weights
    (`normal_pairs` of `key`, [2] int64) in one split."""
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
    return [tf.reshape(p, g.shape if g.shape.is_fully_defined() else tf.shape(g))
            for g, p in zip(gradients, pieces)]


def add_noise(gradients, stddevs, key):
    """[*x.shape] per weight x -> g_x + s_x N(0, 1) per entry, from ONE draw over all
    weights (`normal_like`); `stddevs` one float or scalar tensor per weight, `key` [2]
    int64."""
    return [g + tf.cast(s * z, g.dtype)
            for g, z, s in zip(gradients, normal_like(gradients, key), stddevs)]


class GaussianNoise:
    """N(0, s_x^2) per entry of weight x, a fresh key per `sess.run`. `seed`: None, or
    an int: the k-th key built (from 0) is a stateful draw with op seed `seed + k`, so
    that the same graph built again gives the same sequence."""

    def __init__(self, seed):
        self.seed = seed
        self.draws = 0

    def key(self):
        """[2] int64, a fresh stateless key per sess.run."""
        seed = None if self.seed is None else self.seed + self.draws
        self.draws += 1
        return tf.random.uniform([2], maxval=2 ** 62, dtype=tf.int64, seed=seed,
                                 name="noise_key")                              # [2]

    def add(self, gradients, stddevs):
        """`add_noise` with a new key; the gradients as they are when every s_x is 0."""
        if all(isinstance(s, float) and s == 0 for s in stddevs):
            return list(gradients)
        return add_noise(gradients, stddevs, self.key())

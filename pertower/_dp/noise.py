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
with `key` and `add` (`_dp.mechanism`).
"""

import math

import tensorflow as tf

__all__ = ["ALIGNED_PAIRS", "uniform_pairs", "box_muller", "standard_normal", "normal_pairs",
           "normal_like", "add_noise", "home_graph", "GaussianNoise"]

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


def home_graph():
    """The graph a mechanism's variables live in: the default graph, or None in a
    `tf.function` of TF2 (its variables are made once, eagerly, and kept by retraces)."""
    with tf.init_scope():
        return None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()


class GaussianNoise:
    """N(0, s_x^2) per entry of weight x, fresh at each draw, keyed by variables.

    The k-th key built in a graph (k = 0, 1, ... in the order `key` is called; one per
    release, one for adaptive clipping's count) is, at its r-th draw in that graph,

        key = fold_in(fold_in(seed_variable, stream · 2^32 + k), r)

    (stateless Philox fold-ins), r read from the variable `draws` ([] int64), which the
    key moves by one when it is computed (once per noised release: every k-th run with
    gradient accumulation, once per global step at a distributed chief). `seed_variable`
    ([2] int64) is [seed, salt], or drawn when the variables are initialized (seed None;
    from the graph-level seed when one is set). Both are non-trainable resource
    variables under "dp_noise/", made on the first key in a graph: a checkpoint holds
    them, so a restored session continues the stream and never replays a released
    draw; the same graph built again with the same seed gives the same sequence from
    a fresh initialization. `stream`: a distinct int per worker sharing the variables
    (noise="split": the task index), so that no two workers draw the same numbers.
    """

    _SALT = 0x6A05

    def __init__(self, seed, stream=0):
        self.seed = seed
        self.stream = stream
        self.seed_variable = self.draws = None
        self._graph, self._keys, self._home = None, 0, None

    def _state(self):
        """The variables in the default graph, made on its first key."""
        graph = tf.compat.v1.get_default_graph()
        if self._graph is graph:
            return
        # out of a tf.cond's branch (gradient accumulation releases in one); in a
        # tf.function (TF2), made once, outside it, and kept by its retraces
        home = home_graph()
        if self.seed_variable is None or self._home is not home:
            with tf.init_scope(), tf.compat.v1.variable_scope(None, default_name="dp_noise"):
                seed = (tf.random.uniform([2], maxval=2 ** 62, dtype=tf.int64)
                        if self.seed is None
                        else tf.constant([self.seed, self._SALT], tf.int64))
                self.seed_variable = tf.compat.v1.Variable(
                    seed, name="seed", trainable=False, use_resource=True)
                self.draws = tf.compat.v1.Variable(tf.zeros([], tf.int64), name="draws",
                                                   trainable=False, use_resource=True)
            self._home = home
        self._graph, self._keys = graph, 0

    def _key(self, after=()):
        """([2] int64 key, the op moving `draws`, run after the key and `after`)."""
        self._state()
        purpose = tf.constant((self.stream << 32) + self._keys, tf.int64)
        self._keys += 1
        with tf.name_scope("noise_key"):
            r = self.draws.read_value()                                    # [] int64
            key = tf.random.experimental.stateless_fold_in(
                tf.random.experimental.stateless_fold_in(
                    self.seed_variable.read_value(), purpose, alg="philox"), r, alg="philox")
            with tf.control_dependencies([key] + list(after)):
                return key, self.draws.assign_add(1, read_value=False)

    def key(self):
        """[2] int64, a new stateless key at each computation (the class docstring);
        computing it moves `draws` by one."""
        key, counted = self._key()
        with tf.control_dependencies([counted]):
            return tf.identity(key)                                       # [2]

    def add(self, gradients, stddevs):
        """`add_noise` with a new key; the gradients as they are when every s_x is 0.
        `draws` moves once the gradients are there too (a distributed chief's draw may
        run while its take of the workers' pushes waits)."""
        if all(isinstance(s, float) and s == 0 for s in stddevs):
            return list(gradients)
        key, counted = self._key(after=gradients)
        noised = add_noise(gradients, stddevs, key)
        with tf.control_dependencies([counted]):
            return [tf.identity(g) for g in noised]

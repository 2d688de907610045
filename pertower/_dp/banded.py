"""Banded matrix-factorization noise: DP training noise correlated across steps, C⁻¹ z.

Notation:
    t   the step, from 0                    n   the steps a factorization covers
    b   bands                               P   a weight's entries
    C   [n, n] lower-triangular and b-banded: C[t, r] = 0 unless 0 <= t - r < b; C[t, t] > 0
    z_t [P] fresh N(0, 1) draws of step t   w_t [P] the correlated noise of step t
    s   σ · l2_norm_clip, the scale of z    x   one weight

The matrix mechanism (Denisov et al. 2022, arXiv 2202.08312; Choquette-Choo et al. 2023,
"Multi-Epoch Matrix Factorization Mechanisms", arXiv 2211.06530): the iterates of SGD are
prefix sums A g of the gradients; factor A = L C and release C g + s z, i.e. the noised
gradients g + s C⁻¹ z, so that the iterates carry the noise A C⁻¹ z = L z. Step t releases

    ĝ_t = g_t + s w_t,    C w = z:    w_t = (z_t - sum_{j=1}^{b-1} C[t, t-j] w_{t-j}) / C[t, t]

from a buffer of the b - 1 previous w per weight ((b - 1) P values, in variables, with the
step counter: a session restored from a checkpoint continues the same stream). z_t is
`noise.normal_like`'s draw keyed by (seed, t). Per entry, Cov(w) = C⁻¹ C⁻ᵀ; entries are
independent. b = 1 gives C = I: DP-SGD's independent noise.

Sensitivity: one example joining steps t_1 < ... < t_k with clipped gradients moves C g by
C u, u its gradients in those steps. When t_{i+1} - t_i >= b, the columns C[:, t_i] have
disjoint rows, so ||C u||_2 <= l2_norm_clip · sqrt(k) · max_t ||C[:, t]||_2 ("Amplified
Banded Matrix Factorization", Choquette-Choo et al. 2023, arXiv 2306.08153, Sec. 3). C is
stored scaled to max column norm 1: the release is the Gaussian mechanism of multiplier
σ / sqrt(k), with zero-out or add/remove neighbours (`compute_epsilon(...,
mechanism="banded_mf")`).

The default C is the banded square root (Kalinin and Lampert 2024, arXiv 2405.13763): the
prefix-sum matrix A (ones on and below the diagonal) has the Toeplitz square root with
c_j = binom(2j, j) / 4^j (1, 1/2, 3/8, 5/16, ...: the series of (1 - x)^(-1/2)); its first
b bands, divided by ||c_0..c_{b-1}||_2 (the largest column norm). It needs no optimization
and holds for any number of steps. c is positive and decreasing, so the roots of
sum_j c_j x^j lie outside the open unit disk (Eneström-Kakeya) and the recursion does not
grow exponentially.
"""

import math

import numpy as np
import tensorflow as tf

from pertower import _checks
from pertower import _context
from pertower._dp import noise as noise_lib

__all__ = ["BandedMFNoise", "square_root_coefficients"]

# the second word of the base key of an int seed (any constant: it names this stream)
_SALT = 0x62616e646564


def square_root_coefficients(bands):
    """[b] float64: c_j = binom(2j, j) / 4^j for j < b, the first b coefficients of the
    Toeplitz square root of the prefix-sum matrix, divided by their L2 norm."""
    c = np.ones(bands)
    for j in range(1, bands):
        c[j] = c[j - 1] * (2 * j - 1) / (2 * j)          # binom(2j, j)/4^j recursively
    return c / np.linalg.norm(c)


def _band_rows(matrix, bands):
    """[n, n] lower-triangular b-banded C -> [n, b] rows: row t = C[t, t], C[t, t-1], ...,
    C[t, t-b+1] (0 where t - j < 0); raises ValueError for any other matrix."""
    n = matrix.shape[0]
    t, r = np.indices(matrix.shape)
    outside = (t - r < 0) | (t - r >= bands)
    if np.any(matrix[outside] != 0):
        raise _context.error(
            ValueError, f"`factorization` must be lower-triangular with {bands} bands "
            f"(C[t, r] = 0 unless 0 <= t - r < {bands}), but has "
            f"{int(np.count_nonzero(matrix[outside]))} nonzero entries outside them. Pass "
            "`bands` equal to its number of bands.")
    diagonal = np.diagonal(matrix)
    if not np.all(diagonal > 0):
        raise _context.error(
            ValueError, "`factorization` must have a positive diagonal (C is inverted "
            f"step by step), but C[{int(np.argmin(diagonal > 0))}, "
            f"{int(np.argmin(diagonal > 0))}] is {float(np.min(diagonal))!r}.")
    rows = np.zeros([n, bands])
    for j in range(min(bands, n)):
        rows[j:, j] = np.diagonal(matrix, -j)
    return rows


class BandedMFNoise:
    """Banded matrix-factorization noise for `pertower.DPOptimizer(..., mechanism=)`.

    Step t (counted in a variable) adds s·w_t, w = C⁻¹ z (the module docstring), to the
    clipped sum, s = noise_multiplier · l2_norm_clip, instead of DP-SGD's s·z_t. The
    factorization C has max column norm 1: one example joining k steps at least b apart
    has sensitivity sqrt(k) · l2_norm_clip (`sensitivity`), and the run is accounted by
    `pertower.compute_epsilon(..., mechanism="banded_mf", epochs=k, bands=b)`. One
    object serves one training op.

    Args:
      bands: b >= 1, the number of bands of C (b = 1: DP-SGD's independent noise). The
        noise keeps (b - 1) · P values of state, P the number of trained weights.
      steps: None (default: no limit; the banded square root holds for any number of
        steps) or n, the number of steps the run may take (a step beyond fails at run
        time). With `factorization`, its size n.
      factorization: None (default: the banded square root of Kalinin and Lampert 2024),
        or an [n, n] lower-triangular array with b bands and a positive diagonal (e.g. an
        optimized banded factorization, Choquette-Choo et al. 2023); it is divided by its
        largest column norm.
      seed: an int making the draws repeatable (step t's draw is keyed by (seed, t)), or
        None: a key drawn when the variables are initialized (and saved with them).

    Raises:
      ValueError: for a bad argument.

    Example:
      dp = pertower.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                l2_norm_clip=1.0, noise_multiplier=2.0,
                                mechanism=pertower.BandedMFNoise(bands=8))
      train_op = dp.minimize(loss, var_list=model.trainable_weights)
      eps = pertower.compute_epsilon(steps, 2.0, 1.0, 1e-5, mechanism="banded_mf",
                                     epochs=epochs, bands=8)
    """

    @_context.public("BandedMFNoise")
    def __init__(self, bands, steps=None, factorization=None, seed=None):
        self.bands = _checks.positive_int(bands, "bands")
        self.seed = _checks.optional_seed(seed)
        self.steps = None if steps is None else _checks.positive_int(steps, "steps")
        self._factorized = factorization is not None
        if factorization is None:
            self._rows = square_root_coefficients(self.bands)[None]         # [1, b]
        else:
            matrix = np.asarray(factorization, dtype=np.float64)
            if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1]:
                raise _context.error(ValueError, "`factorization` must be a square [n, n] "
                                     f"array, but has shape {matrix.shape}.")
            if not np.all(np.isfinite(matrix)):
                raise _context.error(ValueError, "`factorization` has entries that are not "
                                     "finite.")
            if self.steps is not None and self.steps != matrix.shape[0]:
                raise _context.error(
                    ValueError, f"`steps` ({self.steps}) must be the size of "
                    f"`factorization` ({matrix.shape[0]}), or None.")
            self.steps = matrix.shape[0]
            self._rows = _band_rows(matrix / np.linalg.norm(matrix, axis=0).max(),
                                    self.bands)                              # [n, b]
        self._keys = noise_lib.GaussianNoise(self.seed)   # other noise (adaptive clipping)
        self.state = None

    def matrix(self, steps=None):
        """[n, n] float64 C (max column norm 1); `steps` n defaults to the object's."""
        n = self.steps if steps is None else _checks.positive_int(steps, "steps")
        if n is None:
            raise _context.error(ValueError, "pass `steps`: the banded square root has "
                                 "no size of its own.")
        rows = self._rows if len(self._rows) > 1 else np.repeat(self._rows, n, axis=0)
        C = np.zeros([n, n])
        for j in range(min(self.bands, n)):
            C += np.diag(rows[j:n, j], -j)
        return C

    def get_config(self):
        """The constructor's arguments (the factorization as the normalized C, a list)."""
        return dict(bands=self.bands, steps=self.steps, seed=self.seed,
                    factorization=self.matrix().tolist() if self._factorized else None)

    def sensitivity(self, participations=1):
        """sqrt(k) · max_t ||C[:, t]||_2: the L2 sensitivity of C g per unit of clip norm,
        for one example in k >= 1 steps at least `bands` apart (1.0 up to rounding for
        k = 1: C is stored normalized)."""
        k = _checks.positive_int(participations, "participations")
        column = (np.linalg.norm(self._rows[0]) if len(self._rows) == 1
                  else np.linalg.norm(self.matrix(), axis=0).max())
        return math.sqrt(k) * float(column)

    def key(self):
        """[2] int64, a fresh key per sess.run, for noise other than the gradient's (the
        count of adaptive clipping), as `GaussianNoise.key`."""
        return self._keys.key()

    def key_at(self, step):
        """[2] int64: the key of step t's draw z_t, a function of the seed and t alone."""
        if self.state is None:
            raise _context.error(RuntimeError, "the noise has no state yet: build the "
                                 "training op first (DPOptimizer.compute_gradients).")
        return tf.random.experimental.stateless_fold_in(self.state.base_key, step)

    def add(self, gradients, stddevs):
        """[*x.shape] per weight -> g_x + s_x w_t (the module docstring), advancing the
        step and the buffer when the result is computed (once per sess.run)."""
        graph = gradients[0].graph
        if self.state is not None and self.state.graph is graph:
            raise _context.error(
                ValueError, "a BandedMFNoise serves one training op, and this one was "
                "already used in this graph; make one BandedMFNoise per optimizer (two "
                "releases with the same draws would not be private).")
        home = noise_lib.home_graph()
        if self.state is None or self.state.home is not home:
            with tf.init_scope():   # the variables outside any tf.cond (accumulation)
                self.state = _State(graph, gradients, self.bands, self.seed)
            self.state.home = home
        self.state.graph = graph    # (a tf.function's retrace: a new graph, the same state)
        b, state = self.bands, self.state
        with tf.name_scope("banded_mf_noise"):
            t = state.step.read_value()                                        # [] int64
            checks = [] if self.steps is None else [tf.debugging.assert_less(
                t, tf.constant(self.steps, tf.int64), message=(
                    f"pertower: the BandedMFNoise covers {self.steps} steps, and this run "
                    "would be one more; make one with more `steps`."))]
            with tf.control_dependencies(checks):
                z = noise_lib.normal_like(gradients, self.key_at(t))      # [*x.shape] each
                rows = tf.constant(self._rows, gradients[0].dtype)             # [n or 1, b]
                row = rows[0] if len(self._rows) == 1 else tf.gather(rows, t)  # [b]
            if b == 1:
                w, writes = [zx / row[0] for zx in z], []
            else:
                # slot t mod (b-1) holds w_t; at step t slot r holds w_{t-j}, j as below
                slot = tf.math.floormod(t, b - 1)
                j = tf.math.floormod(t - 1 - tf.range(b - 1, dtype=tf.int64), b - 1) + 1
                weights = tf.unstack(tf.gather(row, j), num=b - 1)      # b-1 scalars
                # a sum of whole reads: neither a [b-1, *x.shape] contraction (slow in
                # Eigen without oneDNN) nor a sparse write (copy-on-read mode after it)
                w = [(zx - tf.add_n([weights[r] * past.read_value()
                                    for r, past in enumerate(slots)])) / row[0]
                     for zx, slots in zip(z, state.buffers)]                   # [*x.shape]
                # the state moves once the sums are there too (a distributed chief's
                # draw may run while its take of the workers' pushes waits)
                with tf.control_dependencies(list(gradients)):
                    writes = [_write(state.buffers, slot, w)]
            with tf.control_dependencies(writes + w + list(gradients)):
                advanced = state.step.assign_add(1)
            with tf.control_dependencies([advanced]):
                return [g + tf.cast(s * wx, g.dtype)
                        for g, wx, s in zip(gradients, w, stddevs)]


def _write(buffers, slot, w):
    """The op assigning w_x to variable number `slot` ([] int64) of weight x's buffer,
    for every x: one switch over the slots."""
    def assign(r):
        return lambda: tf.group([slots[r].assign(wx) for slots, wx in zip(buffers, w)])
    if len(buffers[0]) == 1:
        return assign(0)()
    return tf.switch_case(tf.cast(slot, tf.int32), [assign(r) for r in range(len(buffers[0]))])


class _State:
    """The noise's variables in `graph`: the step t ([] int64), the base key ([2] int64)
    and per weight x a buffer of b - 1 variables [*x.shape], slot r holding the w_t with
    t mod (b - 1) = r (none for b = 1)."""

    def __init__(self, graph, gradients, bands, seed):
        self.graph = graph
        for g in gradients:
            if not g.shape.is_fully_defined():
                raise _context.error(ValueError, "banded MF noise keeps a buffer per "
                                     f"weight, but a gradient has shape {g.shape}.")
        with tf.compat.v1.variable_scope(None, default_name="banded_mf_noise"):
            self.step = tf.compat.v1.get_variable(
                "step", shape=[], dtype=tf.int64, trainable=False, use_resource=True,
                initializer=tf.compat.v1.zeros_initializer())
            key = (tf.compat.v1.constant_initializer([seed, _SALT]) if seed is not None
                   else tf.compat.v1.random_uniform_initializer(0, 2 ** 62, dtype=tf.int64))
            self.base_key = tf.compat.v1.get_variable(
                "base_key", shape=[2], dtype=tf.int64, trainable=False, use_resource=True,
                initializer=key)
            self.buffers = [[tf.compat.v1.get_variable(
                f"past_{k}_{r}", shape=g.shape, dtype=g.dtype.base_dtype, trainable=False,
                use_resource=True, initializer=tf.compat.v1.zeros_initializer())
                for r in range(bands - 1)] for k, g in enumerate(gradients)] if bands > 1 else []
        self.variables = [self.step, self.base_key] + [v for slots in self.buffers
                                                         for v in slots]

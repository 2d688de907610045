"""Tree aggregation: the noise of DP-FTRL's prefix sums, drawn per tree node.

Notation:
    t   the release (optimizer step) within the current tree, from 1
    g_t the step's clipped sum [*x.shape]        S_t = g_1 + ... + g_t, its prefix sum
    s   the noise's stddev σ C                   z_v ~ N(0, I), the draw of tree node v
    (l, k) the node at level l covering leaves [k 2^l, (k + 1) 2^l) (the leaves, l = 0,
        are the steps); tz(t) the trailing zero bits of t

The binary mechanism (Dwork et al. 2010; Chan, Shi and Song 2011) as DP-FTRL uses it
(Kairouz et al. 2021, "Practical and Private (Deep) Learning without Sampling or
Shuffling", arXiv 2103.00039; TensorFlow Privacy's `tree_aggregation` and
`TreeResidualSumQuery`): the noisy prefix sum is

    S_t + N_t,     N_t = s * sum over the set bits l of t of z_(l, (t >> l) - 1),

the O(log t) nodes of t's binary decomposition, so Var(N_t) = s² popcount(t) per entry;
one example changes one leaf, i.e. one node per level. What a step releases is the
residual (S_t + N_t) - (S_(t-1) + N_(t-1)) = g_t + N_t - N_(t-1), and the nodes of t and
t - 1 differ only below level l0 = tz(t):

    N_t - N_(t-1) = s * (z_(l0, (t >> l0) - 1) - sum_(l < l0) z_(l, ((t-1) >> l) - 1)),

1 + l0 draws, 2 per step on average. A node's draw is stateless Philox keyed by (seed,
tree, node): nothing per node is stored, and a session restored from a checkpoint (the
release counter and the seed are variables) continues the same stream.

Efficient tree (Honaker 2015, "Efficient use of differentially private binary trees";
TensorFlow Privacy's `EfficientTreeAggregator`): a node's estimate combines its own draw
with its children's by inverse variance. Unnormalized, e_(l) = (e_left + e_right)/2 + z
(e_leaf = z), whose estimate e / w_l, w_l = 2 - 2^-l, has variance s² / w_l; so
Var(N_t) = s² * sum over the set bits l of t of 1 / (2 - 2^-l) (< popcount(t)). The
estimate of the last completed node of each level is kept in a buffer variable, one row
per level (log2(t) + 1 copies of the weights). With restart_period p a tree has t <= p,
so L = bit_length(p) rows, allocated up front (L copies of the weights, fixed shape:
pertower.keras saves it as an optimizer weight); without restarts the buffer grows.

Restarts (TensorFlow Privacy's `PeriodicRoundRestartIndicator`): after release r with
r % restart_period == restart_warmup (r >= 1; warmup 0 without one) the next release
starts a new tree (t = 1, fresh nodes): the noise released so far stays in the weights
(the new θ_0), the new tree's prefix noise starts from 0. With s = 0 nothing is drawn
and no state is made.
"""

import numbers

import tensorflow as tf

from pertower import _checks
from pertower import _context
from pertower._dp import noise as noise_lib

__all__ = ["TreeNoise", "prefix_nodes", "prefix_variance", "node_id", "check_restarts"]


def node_id(level, index):
    """The in-order number of node (level, index), k 2^(l+1) + 2^l - 1: leaves are the
    even numbers, no two nodes share one. Python ints or int64 tensors."""
    if isinstance(level, numbers.Integral) and isinstance(index, numbers.Integral):
        return (index << (level + 1)) + (1 << level) - 1
    one = tf.constant(1, tf.int64)
    return (tf.bitwise.left_shift(index, level + 1) + tf.bitwise.left_shift(one, level) - 1)


def prefix_nodes(t):
    """The nodes (level, index) whose draws make N_t, highest level first (t >= 1)."""
    return [(l, (t >> l) - 1) for l in reversed(range(t.bit_length())) if t >> l & 1]


def prefix_variance(t, efficient=False):
    """Var(N_t) / s² per entry: popcount(t), or sum_l 1 / (2 - 2^-l) for the efficient
    tree (module docstring)."""
    return sum(1.0 / (2.0 - 0.5 ** l) if efficient else 1.0 for l, _ in prefix_nodes(t))


def check_restarts(restart_period, restart_warmup):
    """(period or None, warmup 0..period-1) checked as TensorFlow Privacy checks them."""
    if restart_period is None:
        if restart_warmup is not None:
            raise _context.error(
                ValueError, f"`restart_warmup` ({restart_warmup!r}) needs `restart_period`, "
                "but restart_period is None. Pass restart_period (the steps between "
                "restarts after the first), or leave restart_warmup None.")
        return None, 0
    period = _checks.positive_int(restart_period, "restart_period")
    if restart_warmup is None:
        return period, 0
    if (isinstance(restart_warmup, bool) or not isinstance(restart_warmup, numbers.Integral)
            or not 1 <= restart_warmup < period):
        raise _context.error(
            ValueError, f"`restart_warmup` must be an integer in [1, restart_period - 1 = "
            f"{period - 1}] (the release after which the first restart happens), but "
            f"received {restart_warmup!r}. Leave it None to restart every restart_period.")
    return period, int(restart_warmup)


def _trees_before(c, period, warmup):
    """[] int64 each: (the tree index, the releases before its start) for release c + 1,
    c releases having been made; restarts follow releases r = w', w' + p, ...
    (w' = warmup or p)."""
    if period is None:
        return tf.zeros([], tf.int64), tf.zeros([], tf.int64)
    first = warmup or period
    started = tf.maximum(c - first, -1) // period + 1          # restarts so far, >= 0
    start = tf.where(started > 0, first + (started - 1) * period, tf.zeros_like(started))
    return started, start


def _popcount(n):
    return tf.cast(tf.raw_ops.PopulationCount(x=n), tf.int64)


def _trailing_zeros(n):
    """tz(n) for n >= 1: the ones below n's lowest set bit."""
    return _popcount(tf.bitwise.bitwise_and(n, -n) - 1)


class TreeNoise:
    """The tree's residual noise for `_dp.optimizer.DPOptimizer._release` (the module
    docstring): `add(sums, stddevs)` returns sums + N_t - N_(t-1) and counts the release.

    A node's draw is `_dp.noise.normal_pairs` of P numbers (all weights, [2h] >= P),
    split into the weights' pieces once, after the residual is formed. Its state, made
    on the first `add` in that graph (non-trainable resource variables under
    "dp_tree_noise/"): `releases` [] int64, the releases made (restarts follow from
    it); `seed_variable` [2] int64, `seed` or drawn once at initialization; the
    efficient tree's `buffer`, row l the estimate of the last completed node at level
    l: with restart_period p, [L, 2h] zeros, L = p.bit_length() (t <= p in every tree,
    so l0 < L; memory L copies of the weights, fixed shape, a Keras weight under
    pertower.keras); without restarts [levels, 2h], rows growing when t reaches a power
    of 2 (log2(t) + 1 copies; shape [None, 2h], not a Keras weight, so pertower.keras
    does not save it). A checkpoint (tf.compat.v1.train.Saver) holds them all.
    """

    def __init__(self, seed, restart_period=None, restart_warmup=None, efficient=False):
        self.seed = _checks.optional_seed(seed)
        self.period, self.warmup = check_restarts(restart_period, restart_warmup)
        self.efficient = bool(efficient)
        self.releases = self.seed_variable = self.buffer = None
        self._shapes = None
        self._keys = noise_lib.GaussianNoise(seed)   # noise beside the gradient's

    def get_config(self):
        """The constructor's arguments."""
        return dict(seed=self.seed, restart_period=self.period,
                    restart_warmup=self.warmup or None, efficient=self.efficient)

    def key(self):
        """[2] int64, a fresh key per computation (`_dp.noise.GaussianNoise.key`)."""
        return self._keys.key()

    def _state(self, gradients):
        """The variables, made on the first call; later calls must match its weights."""
        shapes = [g.shape for g in gradients]
        if any(not s.is_fully_defined() for s in shapes):
            raise _context.error(
                ValueError, "the tree's noise needs weights of static shape, but received "
                f"gradients of shapes {[str(s) for s in shapes]}.")
        if self._shapes is not None:
            if self._home is not noise_lib.home_graph() or shapes != self._shapes:
                raise _context.error(
                    ValueError, "this optimizer's tree already serves other weights (a tree "
                    "counts the releases of one sum): make one optimizer per training op.")
            return
        self._shapes, self._home = shapes, noise_lib.home_graph()
        # out of a tf.cond's branch (gradient accumulation releases in one)
        with tf.init_scope(), tf.compat.v1.variable_scope(None, default_name="dp_tree_noise"):
            def variable(name, initializer, shape=None):
                return tf.compat.v1.Variable(initializer, name=name, trainable=False,
                                             use_resource=True, shape=shape)
            self.releases = variable("releases", tf.zeros([], tf.int64))
            seed = (tf.random.uniform([2], maxval=2 ** 62, dtype=tf.int64) if self.seed is None
                    else tf.constant([self.seed, 0x5EED], tf.int64))
            self.seed_variable = variable("seed", seed)
            if self.efficient:
                width, dtype = self._width(), gradients[0].dtype
                if self.period is None:      # grows: rows appended as t reaches 2^l
                    self.buffer = variable("buffer", tf.zeros([0, width], dtype),
                                           shape=tf.TensorShape([None, width]))
                else:                        # t <= p: levels 0 .. bit_length(p) - 1
                    self.buffer = variable(
                        "buffer", tf.zeros([self.period.bit_length(), width], dtype))

    def _width(self):
        """2h, the length of one node's draw of P numbers (`_dp.noise.uniform_pairs`)."""
        P = sum(s.num_elements() for s in self._shapes)
        pairs = -(-((P + 1) // 2) // noise_lib.ALIGNED_PAIRS) * noise_lib.ALIGNED_PAIRS
        return 2 * pairs

    def add(self, gradients, stddevs):
        """[*x.shape] per weight x -> g_x + s_x (N_t - N_(t-1)) per entry; the returned
        tensors run the state's update (one release per `sess.run`)."""
        if all(isinstance(s, float) and s == 0 for s in stddevs):
            return list(gradients)
        self._state(gradients)
        dtype = gradients[0].dtype
        sizes = [s.num_elements() for s in self._shapes]
        with tf.name_scope("tree_noise"):
            c = self.releases.read_value()
            tree, start = _trees_before(c, self.period, self.warmup)
            t = c - start + 1                                   # this release's leaf, >= 1
            l0 = _trailing_zeros(t)
            base = tf.random.experimental.stateless_fold_in(
                self.seed_variable.read_value(), tree, alg="philox")

            def draw(level, index):   # [2h], z of node (level, index)
                key = tf.random.experimental.stateless_fold_in(
                    base, node_id(level, index), alg="philox")
                return noise_lib.normal_pairs(sum(sizes), key, dtype)

            if self.efficient:
                residual, store = self._efficient_residual(t, l0, draw)
            else:
                residual, store = self._residual(t, l0, draw), None
            # the state moves once the sums are there too (a chief's draw may run while
            # its take of the workers' pushes waits)
            with tf.control_dependencies([residual] + list(gradients)):
                stored = [] if store is None else [store()]
                with tf.control_dependencies(stored):
                    counted = self.releases.assign_add(1)
            # [2h] -> [P_x] each (and the tail), in one split
            pieces = tf.split(residual, sizes + [self._width() - sum(sizes)],
                              num=len(sizes) + 1)[:-1]
            with tf.control_dependencies([counted]):
                return [tf.identity(g + tf.cast(s, dtype) * tf.reshape(p, shape))
                        for g, s, p, shape in zip(gradients, stddevs, pieces, self._shapes)]

    @staticmethod
    def _residual(t, l0, draw):
        """[2h] (N_t - N_(t-1)) / s: z_(l0, (t >> l0) - 1) - sum_(l < l0) z_(l, ((t-1) >> l) - 1)."""
        def body(level, total):
            return level + 1, total - draw(level, tf.bitwise.right_shift(t - 1, level) - 1)

        _, total = tf.while_loop(lambda level, _: level < l0, body,
                                 [tf.zeros([], tf.int64),
                                  draw(l0, tf.bitwise.right_shift(t, l0) - 1)])
        return total

    def _efficient_residual(self, t, l0, draw):
        """([2h] (N_t - N_(t-1)) / s, () -> the op storing the new node in row l0): the
        node at level l0 merges the buffered left siblings, rows 0 .. l0 - 1 (t - 1's
        nodes below l0; TensorFlow Privacy's EfficientTreeAggregator)."""
        growing = self.period is None
        checks = []
        if growing:
            # rows 0 .. l0 - 1 are read: a buffer a restore did not fill (a Keras weight
            # cannot grow, so pertower.keras does not save it) fails here, before any
            # release
            levels = tf.shape(self.buffer, out_type=tf.int64)[0]
            checks.append(tf.debugging.assert_less_equal(l0, levels, message=(
                "pertower: the efficient tree's buffer holds fewer levels than this "
                "release needs: it was not restored with the release counter. Without "
                "restart_period, pertower.keras' DPFTRLTreeAggregationOptimizer does not "
                "save that growing buffer (save_weights and model.save keep the counter "
                "and the seed only): pass restart_period (its buffer has a fixed shape "
                "and is saved), resume with efficient_tree=False, or restore every "
                "global variable (tf.compat.v1.train.Saver).")))
        with tf.control_dependencies(checks):
            buffered = self.buffer.read_value()                            # [levels, 2h]
        dtype = buffered.dtype

        def weight(level):   # w_l = 2 - 2^-l
            return 2.0 - tf.pow(tf.constant(0.5, dtype), tf.cast(level, dtype))

        def body(level, new, minus):
            left = tf.gather(buffered, level)                              # [2h]
            above = draw(level + 1, tf.bitwise.right_shift(t, level + 1) - 1)
            return level + 1, 0.5 * (left + new) + above, minus + left / weight(level)

        _, new, minus = tf.while_loop(
            lambda level, *_: level < l0, body,
            [tf.zeros([], tf.int64), draw(0, t - 1), tf.zeros([self._width()], dtype)])

        def store():
            def put():
                with tf.control_dependencies([self.buffer.scatter_update(
                        tf.IndexedSlices(new[None], l0[None]))]):
                    return tf.constant(False)
            if not growing:                  # [L, 2h], l0 < L
                return put()

            def grow():      # t = 2^l0, the first node at level l0
                with tf.control_dependencies([self.buffer.assign(
                        tf.concat([buffered, new[None]], axis=0), read_value=False)]):
                    return tf.constant(True)
            return tf.cond(tf.equal(l0, tf.shape(buffered, out_type=tf.int64)[0]), grow, put)

        return new / weight(l0) - minus, store

"""Poisson batches with weights on the towers (issue 19): `DPOptimizer`'s
`max_batch_size` builds the towers for N examples and pads each fed batch of b <= N
examples; the padding's gradients are dropped. Checked against the one-example loop
`pertower.oracle`: the clipped sum and a σ = 0 step on the real examples, an empty
batch (noise only), a batch above the capacity (refused at run time), and
`poisson_capacity` against SciPy's binomial tail.
"""

import numpy as np
import pytest
import scipy.stats
import tensorflow as tf

import pertower
from pertower import oracle
from tests import cases
from tests import common

N = 5            # the capacity
CLIP = 0.8
LEARNING_RATE = 0.1
EXPECTED = 3.0   # expected_batch_size, the divisor


def _sgd():
    return tf.compat.v1.train.GradientDescentOptimizer(LEARNING_RATE)


@pytest.fixture(scope="module")
def model():
    """The `mixed` model (k1, k2 on rules, `scale` on towers), one graph: the σ = 0
    gradients of method "auto" (rules + towers) and "towers" (towers alone), a σ = 0
    training op, a σ = 1 gradient (auto); all with max_batch_size=N."""
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(0)
        x = tf.compat.v1.placeholder(tf.float32, [None, 4], name="x")
        ys, xs = cases.mixed(x)
        built = {}
        for method in ("auto", "towers"):
            dp = pertower.DPOptimizer(_sgd(), CLIP, 0.0, expected_batch_size=EXPECTED,
                                      method=method)
            built[method] = [g for g, _ in dp.compute_gradients(ys, xs, max_batch_size=N)]
        noisy = pertower.DPOptimizer(_sgd(), CLIP, 1.0, expected_batch_size=EXPECTED,
                                     seed=3)
        built["noisy"] = [g for g, _ in noisy.compute_gradients(ys, xs, max_batch_size=N)]
        step = pertower.DPOptimizer(_sgd(), CLIP, 0.0, expected_batch_size=EXPECTED)
        train_op = step.minimize(ys, var_list=xs, max_batch_size=N)
        loop = oracle.SliceLoop(ys, xs)   # the one-example loop's gradient ops
        sess = tf.compat.v1.Session(graph=graph)
        sess.run(tf.compat.v1.global_variables_initializer())
    yield dict(sess=sess, x=x, ys=ys, xs=xs, built=built, train_op=train_op,
               loop=loop)
    sess.close()


def _loop_clipped_sum(m, images):
    """sum_i clip(g_i) per weight from the loop's per-example gradients (zeros for 0)."""
    if len(images) == 0:
        return [np.zeros(w.shape.as_list(), np.float32) for w in m["xs"]]
    b = len(images)
    grads = m["loop"].run(m["sess"], {m["x"]: images}, b)               # [b, *x.shape]
    norms = np.sqrt(sum(np.sum(g.reshape(b, -1) ** 2, axis=1) for g in grads))   # [b]
    factors = CLIP / np.maximum(norms, CLIP)                                        # [b]
    return [np.tensordot(factors, g, axes=1) for g in grads]


@pytest.mark.parametrize("b", [0, 2, N])
def test_clipped_sums_of_a_padded_batch_equal_the_loop_s(model, b):
    images = np.random.RandomState(b).randn(b, 4).astype(np.float32)
    want = [s / EXPECTED for s in _loop_clipped_sum(model, images)]
    for method in ("auto", "towers"):
        got = model["sess"].run(model["built"][method], {model["x"]: images})
        common.assert_all_close(got, want, what=f"{method} b={b}")


def test_a_sigma_0_step_on_a_padded_batch_equals_the_loop_s(model):
    sess, xs = model["sess"], model["xs"]
    images = np.random.RandomState(7).randn(3, 4).astype(np.float32)
    before = sess.run(xs)
    sums = _loop_clipped_sum(model, images)
    sess.run(model["train_op"], {model["x"]: images})
    after = sess.run(xs)
    sess.run([w.assign(v) for w, v in zip(xs, before)])
    want = [w - LEARNING_RATE * s / EXPECTED for w, s in zip(before, sums)]
    common.assert_all_close(after, want, what="σ = 0 step")


def test_an_empty_batch_gives_the_noise_alone(model):
    empty = np.zeros([0, 4], np.float32)
    noisy = model["sess"].run(model["built"]["noisy"], {model["x"]: empty})
    quiet = model["sess"].run(model["built"]["auto"], {model["x"]: empty})
    assert all(np.all(q == 0) for q in quiet)
    # noise of stddev σ C / EXPECTED on every entry: none zero, none wild
    values = np.concatenate([n.ravel() for n in noisy])
    assert np.all(values != 0) and np.all(np.abs(values) < 7 * CLIP / EXPECTED)


def test_a_batch_above_the_capacity_fails_at_run_time_naming_it(model):
    images = np.zeros([N + 1, 4], np.float32)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=f"at most {N} examples \\(max_batch_size={N}\\).*has {N + 1}"):
        model["sess"].run(model["built"]["towers"], {model["x"]: images})


def test_max_batch_size_is_refused_with_batch_size_or_microbatches():
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 4])
        ys, xs = cases.mixed(x)
        dp = pertower.DPOptimizer(_sgd(), 1.0, 0.0)
        with pytest.raises(ValueError, match="DPOptimizer.compute_gradients: "
                                             "`max_batch_size` is for batches of varying"):
            dp.compute_gradients(ys, xs, batch_size=4, max_batch_size=4)
        with pytest.raises(ValueError, match="`max_batch_size` must be a positive"):
            dp.compute_gradients(ys, xs, max_batch_size=0)


@pytest.mark.parametrize("n, q, overflow", [(60000, 256 / 60000, 1e-6), (100, 0.1, 1e-3),
                                            (10, 0.5, 0.3), (7, 1.0, 1e-6)])
def test_poisson_capacity_is_the_binomial_tail_quantile(n, q, overflow):
    capacity = pertower.poisson_capacity(n, q, overflow)
    assert capacity == max(int(scipy.stats.binom.isf(overflow, n, q)), 1)
    assert scipy.stats.binom.sf(capacity, n, q) <= overflow
    if capacity > 1:
        assert scipy.stats.binom.sf(capacity - 1, n, q) > overflow


def test_poisson_capacity_errors_name_the_argument():
    with pytest.raises(ValueError, match="pertower.poisson_capacity: `num_examples`"):
        pertower.poisson_capacity(-1, 0.5)
    with pytest.raises(ValueError, match="`overflow` must be in"):
        pertower.poisson_capacity(10, 0.5, 1.0)

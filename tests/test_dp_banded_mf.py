"""Banded matrix-factorization noise (`pertower.BandedMFNoise`) against NumPy: the
recursion against C⁻¹ z solved in float64, the released noise's covariance against
C⁻¹ C⁻ᵀ, b = 1 against DP-SGD's draw, and `DPOptimizer(mechanism=)` against SGD on the
one-example loop's clipped sums; checkpoint continuation; bad arguments.
"""

import importlib.util
import os
import pathlib
import re

import numpy as np
import pytest
import tensorflow as tf

import pertower
from pertower import oracle
from pertower._dp import noise as noise_lib
from tests import common

B, LEARNING_RATE, CLIP = 4, 0.5, 0.5


def _model(seed=0):
    """(graph, sess, ys [B], weights, feed): a two-layer model on the mode's default
    variables (resource in tests/, reference in tests/legacy/)."""
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(seed)
        x = tf.compat.v1.placeholder(tf.float32, [None, 5])
        y = tf.compat.v1.placeholder(tf.float32, [None])
        k1 = tf.compat.v1.get_variable("k1", [5, 4])
        k2 = tf.compat.v1.get_variable("k2", [4, 1])
        ys = (tf.reduce_sum(tf.matmul(tf.tanh(tf.matmul(x, k1)), k2), axis=1) - y) ** 2
        sess = tf.compat.v1.Session(graph=graph)
    rng = np.random.RandomState(seed)
    feed = {x: rng.randn(B, 5).astype(np.float32), y: rng.randn(B).astype(np.float32)}
    return graph, sess, ys, [k1, k2], feed


def _released_noise(mechanism, shapes, steps, stddev=1.0):
    """[steps, P] float64: w_t over the entries of zero gradients of `shapes`, and
    [steps, P] z_t, the draws keyed by `key_at(t)`."""
    with tf.Graph().as_default():
        zeros = [tf.zeros(s) for s in shapes]
        noised = mechanism.add(zeros, [stddev] * len(shapes))
        t = tf.compat.v1.placeholder(tf.int64, [])
        draws = noise_lib.normal_like(zeros, mechanism.key_at(t))
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            flat = lambda arrays: np.concatenate([a.ravel() for a in arrays])  # noqa: E731
            w = np.stack([flat(sess.run(noised)) for _ in range(steps)])
            z = np.stack([flat(sess.run(draws, {t: k})) for k in range(steps)])
    return w.astype(np.float64), z.astype(np.float64)


def _banded(n, b, rng):
    """[n, n] a random lower-triangular b-banded matrix with a positive diagonal, not
    Toeplitz."""
    t, r = np.indices([n, n])
    C = np.where((t - r >= 0) & (t - r < b), rng.uniform(0.2, 1.0, [n, n]), 0.0)
    return C + np.eye(n)


@pytest.mark.parametrize("bands, factorization", [(1, None), (3, None), (4, "loaded")])
def test_the_recursion_releases_c_inverse_z(bands, factorization):
    n = 7
    matrix = None if factorization is None else _banded(n, bands, np.random.RandomState(1))
    mechanism = pertower.BandedMFNoise(bands, steps=n if matrix is None else None,
                                       factorization=matrix, seed=3)
    w, z = _released_noise(mechanism, [[6, 5], [7]], n, stddev=2.0)
    C = mechanism.matrix()
    # C is stored with max column norm 1 (the loaded one divided by its own)
    assert np.linalg.norm(C, axis=0).max() == pytest.approx(1.0, abs=1e-12)
    if matrix is not None:
        np.testing.assert_allclose(C, matrix / np.linalg.norm(matrix, axis=0).max())
    else:
        # the banded square root: c = (1, 1/2, 3/8, 5/16, ...) / norm, Toeplitz
        c = np.array([1, 1 / 2, 3 / 8, 5 / 16])[:bands]
        np.testing.assert_allclose(C[:bands, 0], c / np.linalg.norm(c))
        np.testing.assert_allclose(np.diagonal(C, -1), np.full(n - 1, C[1, 0]))
    want = np.linalg.solve(C, z) * 2.0                                    # s C⁻¹ z
    np.testing.assert_allclose(w, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert mechanism.sensitivity() == pytest.approx(1.0)
    assert mechanism.sensitivity(4) == pytest.approx(2.0)


def test_the_released_noise_has_the_covariance_of_c_inverse():
    """Over P = 20000 entries (independent draws of the [n] sequence w, n = 6, b = 3),
    each entry of the empirical covariance S = W Wᵀ / P lies within 6 standard errors,
    sqrt((Σ_ii Σ_jj + Σ_ij²) / P), of Σ = C⁻¹ C⁻ᵀ (the seed is fixed: the check is
    deterministic; for a random seed 21 entries would miss with probability < 1e-7).
    The bound excludes the identity of DP-SGD's independent noise."""
    n, P = 6, 20000
    mechanism = pertower.BandedMFNoise(3, seed=11)
    w, _ = _released_noise(mechanism, [[P]], n)
    inverse = np.linalg.inv(mechanism.matrix(n))
    sigma = inverse @ inverse.T                                         # [n, n]
    S = w @ w.T / P
    bound = 6 * np.sqrt((np.outer(np.diag(sigma), np.diag(sigma)) + sigma ** 2) / P)
    assert np.all(np.abs(S - sigma) <= bound), np.max(np.abs(S - sigma) / bound)
    assert np.any(np.abs(np.eye(n) - sigma) > 2 * bound)     # not independent noise


def test_one_band_is_dp_sgd_s_draw():
    """b = 1: C = I and no buffer; step t adds s z_t with z_t and the arithmetic of
    DP-SGD's `add_noise` for the same key: the same numbers, bit for bit."""
    mechanism = pertower.BandedMFNoise(1, seed=5)
    with tf.Graph().as_default():
        rng = np.random.RandomState(0)
        gradients = [tf.constant(rng.randn(3, 4).astype(np.float32)),
                     tf.constant(rng.randn(5).astype(np.float32))]
        noised = mechanism.add(gradients, [1.5, 0.25])
        assert mechanism.state.buffers == []
        t = tf.compat.v1.placeholder(tf.int64, [])
        dp_sgd = noise_lib.add_noise(gradients, [1.5, 0.25], mechanism.key_at(t))
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for step in range(3):
                got, want = sess.run(noised), sess.run(dp_sgd, {t: step})
                for g, w in zip(got, want):
                    np.testing.assert_array_equal(g, w)


def test_noise_free_banded_steps_equal_sgd_on_the_loop_s_clipped_sums():
    """σ = 0 with 3 bands (the buffer runs): three SGD steps on the clipped mean of the
    one-example loop's gradients, recomputed at each step's weights."""
    graph, sess, ys, weights, feed = _model()
    with graph.as_default():
        dp = pertower.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer(LEARNING_RATE),
                                  CLIP, 0.0, mechanism=pertower.BandedMFNoise(3, seed=1))
        train = dp.minimize(ys, var_list=weights)
        sess.run(tf.compat.v1.global_variables_initializer())
        for _ in range(3):
            before = sess.run(weights)
            norms, want = common.loop_clipped_mean(
                oracle.loop_per_example_gradients(sess, ys, weights, feed), CLIP)
            sess.run(train, feed)
            common.assert_all_close(
                [a - b for a, b in zip(before, sess.run(weights))],
                [LEARNING_RATE * g for g in want], what="noise-free banded step")
        assert (norms > CLIP).any()
        assert sess.run(dp._noise.state.step) == 3   # pylint: disable=protected-access


def test_one_band_in_the_optimizer_adds_dp_sgd_s_noise():
    """DPOptimizer with BandedMFNoise(1) releases (clipped sum + σC z_t) / B, z_t the
    draw of `key_at(t)`, against the loop's clipped sum."""
    graph, sess, ys, weights, feed = _model()
    sigma = 1.3
    with graph.as_default():
        mechanism = pertower.BandedMFNoise(1, seed=2)
        dp = pertower.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer(LEARNING_RATE),
                                  CLIP, sigma, mechanism=mechanism)
        grads = [g for g, _ in dp.compute_gradients(ys, weights)]
        t = tf.compat.v1.placeholder(tf.int64, [])
        draws = noise_lib.normal_like(grads, mechanism.key_at(t))
        sess.run(tf.compat.v1.global_variables_initializer())
        _, clipped = common.loop_clipped_mean(
            oracle.loop_per_example_gradients(sess, ys, weights, feed), CLIP)
        for step in range(2):
            got = sess.run(grads, feed)
            want = [c + sigma * CLIP * z / B for c, z in zip(clipped,
                                                            sess.run(draws, {t: step}))]
            common.assert_all_close(got, want, what=f"b = 1 step {step}")


def test_a_restored_checkpoint_continues_the_noise_stream(tmp_path):
    """2 steps, save, a new graph and session restore and run 3 more: the weights equal
    5 uninterrupted steps (the draws are keyed by (seed, t) and the buffer is saved)."""
    def build():
        graph, sess, ys, weights, feed = _model()
        with graph.as_default():
            dp = pertower.DPOptimizer(
                tf.compat.v1.train.GradientDescentOptimizer(LEARNING_RATE), CLIP, 2.0,
                mechanism=pertower.BandedMFNoise(3, seed=7))
            train = dp.minimize(ys, var_list=weights)
            saver = tf.compat.v1.train.Saver()
            sess.run(tf.compat.v1.global_variables_initializer())
        return sess, train, weights, feed, saver

    sess, train, weights, feed, _ = build()
    for _ in range(5):
        sess.run(train, feed)
    uninterrupted = sess.run(weights)
    sess, train, weights, feed, saver = build()
    for _ in range(2):
        sess.run(train, feed)
    path = saver.save(sess, os.path.join(tmp_path, "banded"))
    sess, train, weights, feed, saver = build()
    saver.restore(sess, path)
    for _ in range(3):
        sess.run(train, feed)
    common.assert_all_close(sess.run(weights), uninterrupted, rtol=1e-6, atol=1e-6,
                            what="restored run")


def test_accumulated_runs_advance_the_noise_once_per_step():
    """With gradient accumulation (the release in a tf.cond) the step counter moves on
    the k-th run only."""
    graph, sess, ys, weights, feed = _model()
    with graph.as_default():
        mechanism = pertower.BandedMFNoise(2, seed=4)
        dp = pertower.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1), CLIP,
                                  1.0, mechanism=mechanism, gradient_accumulation_steps=2)
        train = dp.minimize(ys, var_list=weights)
        sess.run(tf.compat.v1.global_variables_initializer())
        counts = []
        for _ in range(4):
            sess.run(train, feed)
            counts.append(sess.run(mechanism.state.step))
    assert counts == [0, 1, 1, 2], counts


def test_a_run_beyond_the_factorization_fails():
    mechanism = pertower.BandedMFNoise(2, steps=2, seed=0)
    with tf.Graph().as_default():
        noised = mechanism.add([tf.zeros([3])], [1.0])
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(noised)
            sess.run(noised)
            with pytest.raises(tf.errors.InvalidArgumentError,
                               match="covers 2 steps, and this run would be one more"):
                sess.run(noised)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(bands=0), ValueError, "`bands` must be a positive integer"),
    (dict(bands=2, steps=0), ValueError, "`steps` must be a positive integer"),
    (dict(bands=2, seed=1.5), TypeError, "`seed` must be an int or None"),
    (dict(bands=2, factorization=np.ones([2, 3])), ValueError, r"square \[n, n\] array"),
    (dict(bands=2, factorization=np.ones([3, 3])), ValueError,
     "lower-triangular with 2 bands .* 4 nonzero entries outside"),
    (dict(bands=2, factorization=np.diag([1.0, 0.0])), ValueError, "positive diagonal"),
    (dict(bands=1, factorization=np.eye(3), steps=4), ValueError,
     r"`steps` \(4\) must be the size of `factorization` \(3\)"),
])
def test_banded_mf_noise_rejects_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=f"pertower.BandedMFNoise: .*{message}"):
        pertower.BandedMFNoise(**kwargs)


def test_dp_optimizer_rejects_a_bad_mechanism_and_a_second_use():
    sgd = tf.compat.v1.train.GradientDescentOptimizer(0.1)
    with pytest.raises(TypeError, match="`mechanism` must be None or a noise object"):
        pertower.DPOptimizer(sgd, 1.0, 1.0, mechanism="banded")
    with pytest.raises(ValueError, match="give the seed to the mechanism"):
        pertower.DPOptimizer(sgd, 1.0, 1.0, seed=3, mechanism=pertower.BandedMFNoise(2))
    graph, _, ys, weights, _ = _model()
    mechanism = pertower.BandedMFNoise(2)
    with graph.as_default():
        pertower.DPOptimizer(sgd, 1.0, 1.0, mechanism=mechanism).compute_gradients(ys, weights)
        with pytest.raises(ValueError, match="one BandedMFNoise per optimizer"):
            pertower.DPOptimizer(sgd, 1.0, 1.0, mechanism=mechanism).compute_gradients(
                ys, weights)


def test_the_digits_example_trains_each_mechanism_at_the_same_epsilon(capsys):
    """examples/dp_ftrl_digits.py --quick --bands 4 (5 steps of each run; 4 bands build
    faster than an epoch's 30): an accuracy per run and the σ that reaches ε = 3 under
    each run's accounting."""
    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "dp_ftrl_digits.py"
    spec = importlib.util.spec_from_file_location("dp_ftrl_digits", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    capsys.readouterr()
    assert module.main(["--quick", "--bands", "4"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^(DP-SGD|banded MF|DP-FTRL) +test accuracy [01]\.\d{3}   noise "
                      r"multiplier (\d+\.\d+)", out, re.M)
    assert [name for name, _ in rows] == ["DP-SGD", "banded MF", "DP-FTRL"], out
    accounting = {"DP-SGD": dict(sampling_probability=50 / 1500),
                  "banded MF": dict(sampling_probability=1.0, mechanism="banded_mf", epochs=1,
                                    bands=4),
                  "DP-FTRL": dict(sampling_probability=1.0, mechanism="tree", epochs=1)}
    for name, sigma in rows:   # σ printed to 3 decimals: ε within 1% of the target
        eps = pertower.compute_epsilon(5, float(sigma), delta=1e-5, **accounting[name])
        assert eps == pytest.approx(3.0, rel=1e-2), (name, sigma, eps)

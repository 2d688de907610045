"""DP-SGD's Gaussian noise stream (`_dp.noise.GaussianNoise`) across checkpoints: a
session restored after 3 noised steps (same graph or a new one) continues the stream,
never replaying a released draw, with a seed or with only a graph-level seed; the
release counter moves once per noised release; split-mode workers draw distinct
numbers; the marginal stays N(0, σ²C²).
"""

import os

import numpy as np
import pytest
import tensorflow as tf

import pertower
from pertower._dp import noise as noise_lib

SIGMA, CLIP, B = 1.5, 0.5, 4


def _build(seed, graph_seed, accumulation=1):
    """(graph, run, saver, dp): run(sess) does one training step of a DP step on a
    [3, 2] weight and returns its noise, the noised minus the noise-free gradient
    (σ C z / B, z the draw; zeros on the runs that only accumulate)."""
    graph = tf.Graph()
    with graph.as_default():
        if graph_seed is not None:
            tf.compat.v1.set_random_seed(graph_seed)
        x = tf.compat.v1.placeholder(tf.float32, [None, 3])
        w = tf.compat.v1.get_variable("w", [3, 2], initializer=tf.ones_initializer())
        loss = tf.reduce_sum(tf.matmul(x, w) ** 2, axis=1)                 # [B]
        dp = pertower.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.01), CLIP,
                                  SIGMA, seed=seed, gradient_accumulation_steps=accumulation)
        clean = pertower.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.01),
                                     CLIP, 0.0, gradient_accumulation_steps=accumulation)
        pairs = dp.compute_gradients(loss, [w], batch_size=B)
        (g0, _), = clean.compute_gradients(loss, [w], batch_size=B)
        train = tf.group(dp.apply_gradients(pairs), clean.apply_gradients([(g0, w)]))
        saver = tf.compat.v1.train.Saver()
    feed = {x: np.arange(12, dtype=np.float32).reshape(B, 3) / 10}

    def run(sess):
        g, clean_g, _ = sess.run([pairs[0][0], g0, train], feed)
        return g - clean_g

    return graph, run, saver, dp


def _session(graph):
    sess = tf.compat.v1.Session(graph=graph)
    with graph.as_default():
        sess.run(tf.compat.v1.global_variables_initializer())
    return sess


@pytest.mark.parametrize("new_graph", [False, True], ids=["same-graph", "new-graph"])
@pytest.mark.parametrize("seed, graph_seed", [(5, None), (None, 1234)],
                         ids=["seed", "graph-level-seed"])
def test_a_restored_session_continues_the_noise_stream(tmp_path, seed, graph_seed, new_graph):
    """3 steps, save, restore in a new session (of the same graph or a new one), 3 more:
    the noise equals an uninterrupted run's steps 4..6, and none equals steps 1..3."""
    graph, run, _, _ = _build(seed, graph_seed)
    sess = _session(graph)
    uninterrupted = [run(sess) for _ in range(6)]
    graph, run, saver, _ = _build(seed, graph_seed)
    sess = _session(graph)
    first = [run(sess) for _ in range(3)]
    for got, want in zip(first, uninterrupted):      # a fresh init: the same sequence
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    path = saver.save(sess, os.path.join(tmp_path, "dp"))
    if new_graph:
        graph, run, saver, _ = _build(seed, graph_seed)
    sess = tf.compat.v1.Session(graph=graph)
    saver.restore(sess, path)
    resumed = [run(sess) for _ in range(3)]
    for got, want in zip(resumed, uninterrupted[3:]):   # draws 0.1 apart, rounding 1e-8
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for got in resumed:
        assert np.abs(got).min() > 0
        assert not any(np.allclose(got, old, rtol=1e-3, atol=1e-3) for old in first)


def test_the_counter_moves_once_per_noised_release():
    """With 2 accumulation steps the key is computed, and `draws` moves, on every 2nd
    run only; every release's noise is new."""
    graph, run, _, dp = _build(3, None, accumulation=2)
    sess = _session(graph)
    noises, counts = [], []
    for _ in range(6):
        noises.append(run(sess))
        counts.append(int(sess.run(dp._noise.draws)))  # pylint: disable=protected-access
    assert counts == [0, 1, 1, 2, 2, 3]
    assert all(np.abs(n).max() == 0 for n in noises[0::2])
    released = noises[1::2]
    assert all(np.abs(n).min() > 0 for n in released)
    assert not np.allclose(released[0], released[1]) and not np.allclose(released[1],
                                                                          released[2])


def _keys(noises, runs=3):
    """[len(noises), runs, 2]: the keys of `runs` sess.runs, each of the `noises` in a
    graph of its own (as each worker builds its own)."""
    out = []
    for noise in noises:
        with tf.Graph().as_default():
            key = noise.key()
            with tf.compat.v1.Session() as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                out.append([sess.run(key) for _ in range(runs)])
    return np.array(out)


def test_split_workers_draw_distinct_keys():
    """noise="split": every worker holds the same seed variable (one, on a parameter
    server, initialized by the chief) and counter; the task index, folded in as the
    stream, keeps their keys apart. The same worker rebuilt repeats its keys."""
    keys = _keys([noise_lib.GaussianNoise(7, stream=s) for s in (1, 2, 3, 1)])
    np.testing.assert_array_equal(keys[0], keys[3])
    flat = {tuple(k) for k in keys[:3].reshape(-1, 2)}
    assert len(flat) == 9                                  # 3 workers x 3 draws
    dp = pertower.DPSyncReplicasOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.1), 1.0, 1.0, replicas_to_aggregate=2,
        noise="split", task_index=1)
    worker = dp._clipper._noise   # pylint: disable=protected-access
    assert (worker.stream, worker.seed) == (2, None)


def test_the_marginal_is_n_0_sigma2_c2():
    """20 000 entries of 3 releases on a zero gradient with s = σC = 0.75: mean,
    variance and the correlation between releases within 6 standard errors (a fixed
    seed: the check is deterministic)."""
    n, s = 20000, SIGMA * CLIP
    noise = noise_lib.GaussianNoise(11)
    with tf.Graph().as_default():
        noised = noise.add([tf.zeros([n])], [s])[0]
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            z = np.array([sess.run(noised) for _ in range(3)], np.float64) / s   # [3, n]
    assert np.abs(z.mean(axis=1)).max() < 6 / np.sqrt(n)
    assert np.abs(z.var(axis=1) - 1).max() < 6 * np.sqrt(2 / n)
    assert np.abs(np.corrcoef(z)[np.triu_indices(3, 1)]).max() < 6 / np.sqrt(n)


def test_adaptive_clipping_s_count_key_moves_the_counter_each_step():
    """The count's noise has a key of its own, drawn after the release's (whose stddev
    σ_Δ C is a tensor, drawn even at σ = 0, as here): `draws` moves twice per step, and the clip
    norms follow a noisy, repeatable path."""
    def run(steps=3):
        with tf.Graph().as_default():
            x = tf.compat.v1.placeholder(tf.float32, [None, 3])
            w = tf.compat.v1.get_variable("w", [3, 2], initializer=tf.ones_initializer())
            loss = tf.reduce_sum(tf.matmul(x, w) ** 2, axis=1)                 # [B]
            dp = pertower.DPOptimizer(
                tf.compat.v1.train.GradientDescentOptimizer(0.0), CLIP, 0.0, seed=2,
                expected_batch_size=float(B),
                adaptive_clipping=pertower.AdaptiveClipping(0.5, 0.2, 1.0))
            train = dp.minimize(loss, var_list=[w])
            with tf.compat.v1.Session() as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                feed = {x: np.arange(12, dtype=np.float32).reshape(B, 3) / 10}
                clips = []
                for _ in range(steps):
                    sess.run(train, feed)
                    clips.append(sess.run(dp.l2_norm_clip_variable))
                return clips, int(sess.run(dp._noise.draws))  # pylint: disable=protected-access
    clips, draws = run()
    assert draws == 3 * 2
    assert len(set(np.round(np.log(clips[1:]) - np.log(clips[:-1]), 6))) == 2   # noisy
    np.testing.assert_array_equal(clips, run()[0])

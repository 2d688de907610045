"""The DP modes of issue 19 and per-weight norms under tf.compat.v1.disable_v2_behavior()
(reference variables, v1 control flow): each against the one-example loop.
"""

import numpy as np
import tensorflow as tf

import pertower
from pertower import oracle
from tests import common

B, LEARNING_RATE = 4, 0.5


def _model():
    """A two-layer model on reference variables: (graph, sess, x, y, ys [B], weights, feed)."""
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(0)
        x = tf.compat.v1.placeholder(tf.float32, [None, 5])
        y = tf.compat.v1.placeholder(tf.float32, [None])
        k1 = tf.compat.v1.get_variable("k1", [5, 4], use_resource=False)
        k2 = tf.compat.v1.get_variable("k2", [4, 1], use_resource=False)
        ys = (tf.reduce_sum(tf.matmul(tf.tanh(tf.matmul(x, k1)), k2), axis=1) - y) ** 2
        sess = tf.compat.v1.Session(graph=graph)
        sess.run(tf.compat.v1.global_variables_initializer())
    rng = np.random.RandomState(0)
    feed = {x: rng.randn(B, 5).astype(np.float32), y: rng.randn(B).astype(np.float32)}
    return graph, sess, ys, [k1, k2], feed


def _loop(sess, ys, weights, feed):
    grads = oracle.loop_per_example_gradients(sess, ys, weights, feed)     # [B, *x.shape]
    norms = np.stack([np.sqrt(np.sum(g.reshape(B, -1) ** 2, axis=1)) for g in grads], 1)
    return grads, norms                                                    # norms [B, K]


def _initialize_new(sess):
    names = set(sess.run(tf.compat.v1.report_uninitialized_variables()))
    sess.run(tf.compat.v1.variables_initializer(
        [v for v in tf.compat.v1.global_variables()
         if v.op.name.encode() in names]))


def test_per_weight_norms_and_per_layer_clipping():
    graph, sess, ys, weights, feed = _model()
    with graph.as_default():
        grads, norms = _loop(sess, ys, weights, feed)
        clips = [float(np.median(norms[:, k])) for k in range(2)]
        got_norms = pertower.per_example_norms(ys, weights, per_weight=True)
        dp = pertower.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1), clips, 0.0,
                                  clipping="per_layer")
        got = sess.run([got_norms, [g for g, _ in dp.compute_gradients(ys, weights)]], feed)
    common.assert_all_close([got[0]], [norms], what="per-weight norms")
    want = [(np.tensordot(np.minimum(1.0, clips[k] / norms[:, k]), g, axes=1) / B)
            .astype(np.float32) for k, g in enumerate(grads)]
    common.assert_all_close(got[1], want, what="per-layer gradient")


def test_accumulation_with_an_empty_run_equals_one_step():
    graph, sess, ys, weights, feed = _model()
    with graph.as_default():
        grads, norms = _loop(sess, ys, weights, feed)
        clip = float(np.median(np.sqrt(np.sum(norms ** 2, axis=1))))
        step = tf.compat.v1.train.get_or_create_global_step()
        dp = pertower.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer(LEARNING_RATE),
                                  clip, 0.0, gradient_accumulation_steps=3,
                                  expected_batch_size=B)
        train = dp.minimize(ys, var_list=weights, global_step=step)
        _initialize_new(sess)
        before = sess.run(weights)
        for rows in (slice(0, 0), slice(0, 3), slice(3, 4)):    # an empty run included
            sess.run(train, {p: v[rows] for p, v in feed.items()})
        after, steps = sess.run([weights, step])
    assert steps == 1, steps
    total = np.sqrt(np.sum(norms ** 2, axis=1))
    factors = clip / np.maximum(total, clip)
    want = [(LEARNING_RATE * np.tensordot(factors, g, axes=1) / B).astype(np.float32)
            for g in grads]
    common.assert_all_close([b - a for a, b in zip(after, before)], want,
                            what="one step over three accumulated runs")


def test_adaptive_clip_update():
    graph, sess, ys, weights, feed = _model()
    with graph.as_default():
        _, norms = _loop(sess, ys, weights, feed)
        total = np.sqrt(np.sum(norms ** 2, axis=1))
        clip0 = float(np.median(total)) * 1.01
        dp = pertower.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.0), clip0, 0.0,
                                  expected_batch_size=B,
                                  adaptive_clipping=pertower.AdaptiveClipping(
                                      0.9, 0.3, count_stddev=0.0))
        train = dp.minimize(ys, var_list=weights)
        _initialize_new(sess)
        sess.run(train, feed)
        got = sess.run(dp.l2_norm_clip_variable)
    want = clip0 * np.exp(-0.3 * (np.mean(total <= clip0) - 0.9))
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_poisson_batches_padded_on_towers():
    """max_batch_size: towers built for B examples take 3 and 0 (padded); the σ = 0
    gradient equals the loop's clipped sum over the fed examples / B."""
    graph, sess, ys, weights, feed = _model()
    with graph.as_default():
        dp = pertower.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1), 0.5,
                                  0.0, expected_batch_size=B, method="towers")
        grads = [g for g, _ in dp.compute_gradients(ys, weights, max_batch_size=B)]
        loop = oracle.SliceLoop(ys, weights)
    for b in (3, 0):
        part = {p: v[:b] for p, v in feed.items()}
        got = sess.run(grads, part)
        want = [np.zeros(w.shape.as_list(), np.float32) for w in weights]
        if b:
            rows = loop.run(sess, part, b)                                # [b, *x.shape]
            norms = np.sqrt(sum(np.sum(g.reshape(b, -1) ** 2, axis=1) for g in rows))
            factors = 0.5 / np.maximum(norms, 0.5)
            want = [np.tensordot(factors, g, axes=1) / B for g in rows]
        common.assert_all_close(got, want, what=f"padded towers, {b} fed")

"""Entries of `xs` that read the same variable get the same gradient (issue 32 item 1).

Under tf_keras' `mixed_float16` policy, `tf.compat.v1.trainable_variables() +
model.trainable_weights` holds each weight once as its `AutoCastVariable` and once as
the variable it wraps (both share one resource handle); the towers used to give one
of the two exact zeros. Each case is compared with the one-example loop, which
differentiates every entry through `tf.gradients` (the user's reference).
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import pertower
from pertower import oracle
from tests import common

B = 4


@pytest.fixture
def mixed_precision():
    """The process-wide `mixed_float16` policy for one test, restored after it."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy("float32")


def _model(shape, build):
    """(graph, x, ys, xs, loop): `build(x)` -> (ys, xs) on a placeholder x, [None, *shape],
    and the one-example loop's gradients (built before any session runs the graph: a
    while loop's gradient added later cannot run)."""
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(0)
        x = tf.compat.v1.placeholder(tf.float32, [None, *shape], name="x")
        ys, xs = build(x)
        loop = oracle.SliceLoop(ys, xs)
    return graph, x, ys, xs, loop


def _run(graph, x, loop, fetches):
    """(fetches' values, the loop's per-example gradients) on one random batch."""
    with graph.as_default():
        sess = tf.compat.v1.Session(graph=graph)
        sess.run(tf.compat.v1.global_variables_initializer())
        data = np.random.RandomState(0).randn(B, *x.shape[1:]).astype(np.float32)
        feed = {x: data}
        want = common.run_oracle(loop.run, sess, feed, B, [x])
        assert all(np.abs(w).max() > 0 for w in want)   # no entry is zero by construction
        return sess.run(fetches, feed), want


def _with_both_handles(layers, shape):
    """A model of `layers` under the current policy; xs lists every weight twice (the
    variables, then the model's weights: AutoCastVariables under mixed_float16)."""
    def build(x):
        model = keras.Sequential(layers())
        ys = tf.reduce_sum(model(x), 1)
        xs = tf.compat.v1.trainable_variables() + model.trainable_weights
        assert any(type(v).__name__ == "AutoCastVariable" for v in xs)
        return ys, xs
    return _model(shape, build)


def _mixed_dense():
    """A float16 Dense layer and a float32 head."""
    return _with_both_handles(lambda: [keras.layers.Dense(5, activation="tanh"),
                                       keras.layers.Dense(1, dtype="float32")], [3])


@pytest.mark.parametrize("method", ["towers", "auto", "rules"])
def test_autocast_variables_and_the_variables_they_wrap(mixed_precision, method):
    graph, x, ys, xs, loop = _mixed_dense()
    with graph.as_default():
        got = pertower.per_example_gradients(ys, xs, batch_size=B, method=method)
    assert [g.dtype for g in got] == [tf.float32] * len(xs)   # as tf.gradients gives
    common.assert_all_close(*_run(graph, x, loop, got), kind="deep")


@pytest.mark.parametrize("method", ["towers", "auto"])
def test_norms_count_each_entry(mixed_precision, method):
    graph, x, ys, xs, loop = _mixed_dense()
    with graph.as_default():
        norms = pertower.per_example_norms(ys, xs, batch_size=B, method=method,
                                           per_weight=True)
    got, rows = _run(graph, x, loop, norms)
    want = np.stack([np.sqrt((r.reshape(B, -1) ** 2).sum(1)) for r in rows], 1)
    common.assert_all_close([got], [want], kind="deep")


@pytest.mark.parametrize("method", ["towers", "auto"])
def test_a_noiseless_dp_step_gives_both_entries_the_mean_gradient(mixed_precision, method):
    graph, x, ys, xs, loop = _mixed_dense()
    with graph.as_default():
        dp = pertower.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                  l2_norm_clip=1e6, noise_multiplier=0.0, method=method)
        grads = [g for g, _ in dp.compute_gradients(ys, var_list=xs, batch_size=B)]
    got, rows = _run(graph, x, loop, grads)
    common.assert_all_close(got, [r.mean(0) for r in rows], kind="deep")


@pytest.mark.parametrize("method", ["towers", "auto"])
def test_a_mixed_precision_gru(mixed_precision, method):
    """Each weight of a mixed-precision GRU and its dense head listed twice (the variable
    and its AutoCastVariable): on the towers (the issue's case: a loop body read by
    copies), and under auto, where the body's casts are weight-side functions and every
    weight is on the rules."""
    graph, x, ys, xs, loop = _with_both_handles(
        lambda: [keras.layers.GRU(4), keras.layers.Dense(1, dtype="float32")], [3, 2])
    with graph.as_default():
        plan = pertower.explain(ys, xs, batch_size=B, method=method)
        assert {w.method for w in plan.weights} == {method if method == "towers" else "rules"}
        got = pertower.per_example_gradients(ys, xs, batch_size=B, method=method)
    # the towers replay the loop's float16 ops example by example, as the loop does; the
    # rules sum the same float16 products in another order
    tol = {} if method == "towers" else dict(rtol=1e-2, atol=1e-3)
    common.assert_all_close(*_run(graph, x, loop, got), kind="deep", **tol)


def _plain(listing, read=lambda w: w):
    """tanh(x w + b) summed, w read through `read`; xs = listing(w, b, the read)."""
    def build(x):
        w = tf.compat.v1.get_variable("w", initializer=[[1.0, -1.0], [0.5, 2.0], [-0.3, 0.2]],
                                      use_resource=True)
        b = tf.compat.v1.get_variable("b", initializer=[0.1, -0.2], use_resource=True)
        r = read(w)
        return tf.reduce_sum(tf.tanh(tf.matmul(x, r) + b), 1), listing(w, b, r)
    return _model([3], build)


@pytest.mark.parametrize("method", ["towers", "auto", "rules"])
@pytest.mark.parametrize("listing, read", [
    (lambda w, b, r: [w, b, w], None),
    (lambda w, b, r: [w, b, r], lambda w: w.read_value()),
    (lambda w, b, r: [r, b, w], lambda w: tf.identity(w)),
], ids=["the variable twice", "the variable and its read", "an identity and the variable"])
def test_the_same_variable_listed_twice(method, listing, read):
    graph, x, ys, xs, loop = _plain(listing, read or (lambda w: w))
    with graph.as_default():
        got = pertower.per_example_gradients(ys, xs, batch_size=B, method=method)
    common.assert_all_close(*_run(graph, x, loop, got))


@pytest.mark.parametrize("method", ["towers", "auto"])
def test_the_variable_and_its_handle(method):
    graph, x, ys, xs, loop = _plain(lambda w, b, r: [w, b, w.handle])
    with graph.as_default():
        got = pertower.per_example_gradients(ys, xs, batch_size=B, method=method)
    common.assert_all_close(*_run(graph, x, loop, got))


def test_a_handle_on_the_rules_is_refused_naming_the_variable_to_pass():
    graph, x, ys, xs, loop = _plain(lambda w, b, r: [w, b, w.handle])
    with graph.as_default(), pytest.raises(ValueError, match="resource handle tensor"):
        pertower.per_example_gradients(ys, xs, batch_size=B, method="rules")

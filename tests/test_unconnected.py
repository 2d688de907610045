"""Weights `ys` does not reach: zeros, and a UserWarning naming them unless the caller
chose `unconnected_gradients` (the classic case: optimizer slots passed in
`tf.compat.v1.global_variables()`). The zeros are checked against the one-example loop,
which gives zeros for them too."""

import warnings

import numpy as np
import pytest
import tensorflow as tf

import pertower
from tests import common
from pertower import oracle
from tests.common import assert_all_close

B = 3


@pytest.fixture(scope="module")
def case():
    """A two-weight model, plus seven variables `ys` does not read (Adam's slots)."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 2], name="x")
        w = tf.compat.v1.get_variable("w", initializer=[[1.0], [-2.0]], use_resource=True)
        b = tf.compat.v1.get_variable("b", initializer=[0.5], use_resource=True)
        ys = tf.tanh(tf.matmul(x, w) + b)                           # [B, 1]
        tf.compat.v1.train.AdamOptimizer().minimize(tf.reduce_mean(ys))  # 6 slots
        tf.compat.v1.get_variable("unused", initializer=[3.0], use_resource=True)
        everything = tf.compat.v1.global_variables()                # 2 + 6 + 1
        sess = tf.compat.v1.Session(graph=graph)
        sess.run(tf.compat.v1.global_variables_initializer())
    feed = {x: np.random.RandomState(0).randn(B, 2).astype(np.float32)}
    yield graph, sess, ys, everything, feed
    sess.close()


def _recorded(build):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = build()
    return result, [w for w in caught if "does not depend on" in str(w.message)]


@pytest.mark.parametrize("function", ["per_example_gradients", "microbatch_gradients",
                                      "per_example_jacobians"])
def test_default_warns_once_naming_five_and_still_gives_zeros(case, function):
    graph, sess, ys, everything, feed = case
    with graph.as_default():
        grads, caught = _recorded(lambda: getattr(pertower, function)(ys, everything,
                                                                  batch_size=B))
        want = oracle.loop_per_example_gradients(sess, ys, everything, feed)
    assert len(caught) == 1, [str(w.message) for w in caught]
    warning = caught[0]
    assert issubclass(warning.category, UserWarning)
    assert warning.filename == __file__        # points at the caller's line
    text = str(warning.message)
    assert text.startswith(f"pertower.{function}: `ys` does not depend on 7 of the 9 weights "
                           "in `xs` (")
    assert "and 2 more), so their gradients are zeros" in text
    assert "unconnected_gradients='zero'" in text
    assert text.count(":0") == 5, text                            # five names
    assert "w:0" not in text and "b:0" not in text
    got = sess.run(grads, feed)
    if function == "per_example_jacobians":                      # [B, 1, *x.shape]
        got = [g[:, 0] for g in got]
    assert_all_close(got, want, kind="tight", what=function)           # zeros for the 7
    assert all(not np.any(g) for g in got[2:])


@pytest.mark.parametrize("value", ["zero", tf.UnconnectedGradients.ZERO, "none"])
def test_explicit_unconnected_gradients_is_silent(case, value):
    graph, sess, ys, everything, feed = case
    with graph.as_default():
        grads, caught = _recorded(lambda: pertower.per_example_gradients(
            ys, everything, batch_size=B, unconnected_gradients=value))
    assert not caught, [str(w.message) for w in caught]
    if value == "none":
        assert grads[2:] == [None] * 7
    else:
        with graph.as_default():
            want = oracle.loop_per_example_gradients(sess, ys, everything[:2], feed)
        got = sess.run(grads, feed)
        assert_all_close(got[:2], want, kind="tight", what="explicit zero")
        assert all(not np.any(g) for g in got[2:])


def test_all_weights_reached_is_silent(case):
    graph, _, ys, everything, _ = case
    with graph.as_default():
        _, caught = _recorded(lambda: pertower.per_example_gradients(ys, everything[:2],
                                                                         batch_size=B))
    assert not caught


def test_norms_warn_and_add_zero(case):
    graph, sess, ys, everything, feed = case
    with graph.as_default():
        norms, caught = _recorded(lambda: pertower.per_example_norms(ys, everything, batch_size=B))
        want = oracle.loop_per_example_gradients(sess, ys, everything[:2], feed)
    assert len(caught) == 1, [str(w.message) for w in caught]
    text = str(caught[0].message)
    assert text.startswith("pertower.per_example_norms: `ys` does not depend on 7 of the 9")
    assert "so they add 0 to the norms. Leave them out of `xs`." in text
    want_norms = np.sqrt(sum(np.sum(g.reshape(B, -1) ** 2, axis=1) for g in want))
    common.assert_all_close([sess.run(norms, feed)], [want_norms], what="norms", kind="deep")


@pytest.mark.parametrize("defaulted", [False, True])
def test_dp_optimizer_warns_once_that_unreached_variables_get_noise(case, defaulted):
    graph, _, ys, everything, _ = case
    with graph.as_default():
        dp = pertower.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                  l2_norm_clip=1.0, noise_multiplier=0.0)
        var_list = None if defaulted else everything
        pairs, caught = _recorded(lambda: dp.compute_gradients(ys[:, 0], var_list=var_list,
                                                                  batch_size=B))
    assert len(caught) == 1, [str(w.message) for w in caught]
    text = str(caught[0].message)
    # defaulted: the trainable variables, w, b and `unused` (the slots are not trainable)
    count = "1 of the 3" if defaulted else "7 of the 9"
    assert text.startswith(f"pertower.DPOptimizer.compute_gradients: `loss` does not depend "
                           f"on {count} weights in `var_list`"), text
    assert "pure noise" in text
    assert ("it defaulted to every trainable variable" in text) == defaulted
    assert len(pairs) == (3 if defaulted else 9)

"""The test helpers of tests/common.py and tests/cases.py: weights that do not depend on
what ran before, tolerances that follow the dtype and the kind of graph, and the oracle
runner that skips only when TensorFlow cannot compute the reference on this machine."""

import random

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

from tests import cases
from tests import common


def _weights(case):
    values = case.sess.run(case.xs)
    case.sess.close()
    return values


def test_builders_give_the_same_weights_whatever_ran_before():
    first = _weights(cases.build_mlp(B=2))
    # what other tests do in between: draw from Python's random, seed Keras globally
    # (the digits examples call keras.utils.set_random_seed), build other graphs
    random.random()
    keras.utils.set_random_seed(12345)
    with tf.Graph().as_default():
        keras.layers.Dense(3)(tf.zeros([1, 2]))
    random.random()
    second = _weights(cases.build_mlp(B=2))
    common.assert_all_close(second, first, 0.0, 0.0, "build_mlp weights")


def test_tolerance_follows_the_dtype():
    f32, f64 = common.tolerance(tf.float32), common.tolerance(np.float64)
    assert f32 == common.tolerance(np.zeros(2, np.float32))
    assert f64 == common.tolerance(tf.float64)
    assert f64["rtol"] < f32["rtol"] and f64["atol"] < f32["atol"]
    # float32 tolerances are wide enough for float32 round-off, not for a float64 bug
    base = np.linspace(1.0, 2.0, 5)
    common.assert_all_close([base.astype(np.float32) * (1 + 2e-6)], [base.astype(np.float32)])
    with pytest.raises(AssertionError, match=r"max abs error"):
        common.assert_all_close([base * (1 + 2e-6)], [base], what="float64")
    with pytest.raises(AssertionError, match=r"float32: \[0\] max abs error"):
        common.assert_all_close([base.astype(np.float32) * 1.01], [base.astype(np.float32)],
                                what="float32")



def test_every_kind_of_tolerance_is_tighter_in_float64_and_unknown_kinds_are_refused():
    """TOLERANCES is the one table: each kind has both dtypes, float64 no wider than
    float32, and assert_all_close reads the kind it is given."""
    for kind in common.TOLERANCES:
        f32, f64 = common.tolerance(np.float32, kind), common.tolerance(np.float64, kind)
        assert f64["rtol"] <= f32["rtol"] and f64["atol"] <= f32["atol"], kind
    assert common.tolerance(np.float32) == common.tolerance(np.float32, "default")
    base = np.linspace(1.0, 2.0, 5).astype(np.float32)
    common.assert_all_close([base * (1 + 5e-5)], [base], kind="deep")
    with pytest.raises(AssertionError, match=r"tight: \[0\] max abs error"):
        common.assert_all_close([base * (1 + 5e-5)], [base], what="tight", kind="tight")
    with pytest.raises(ValueError, match=r"`kind` must be one of .*'default'.*but received "
                                         r"'loose'"):
        common.tolerance(np.float32, "loose")

def _conv_gradient_graph(dilations):
    """(sess, loop arguments) for a conv whose weight gradient TF computes with
    Conv2DBackpropFilter."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 6, 6, 1])
        w = tf.compat.v1.get_variable("w", [2, 2, 1, 1])
        ys = tf.reduce_sum(tf.nn.conv2d(x, w, 1, "VALID", dilations=dilations), axis=[1, 2, 3])
        sess = tf.compat.v1.Session(graph=graph)
        sess.run(w.initializer)
    return graph, sess, ys, w, {x: np.ones([2, 6, 6, 1], np.float32)}


def test_run_oracle_skips_exactly_when_tensorflow_cannot_compute_the_reference():
    from pertower import oracle  # pylint: disable=import-outside-toplevel
    graph, sess, ys, w, feed = _conv_gradient_graph(1)
    with graph.as_default():
        (got,) = common.run_oracle(oracle.loop_per_example_gradients, sess, ys, [w], feed)
    assert got.shape == (2, 2, 2, 1, 1)
    sess.close()
    graph, sess, ys, w, feed = _conv_gradient_graph(2)
    try:      # oneDNN on: TensorFlow computes it; off: its CPU kernel refuses dilations
        with graph.as_default():
            (got,) = common.run_oracle(oracle.loop_per_example_gradients, sess, ys, [w],
                                       feed)
    except pytest.skip.Exception as skip:
        assert "do not yet support dilation rates larger than 1" in str(skip)
        assert "Conv2DBackpropFilter" in str(skip)
    else:
        assert got.shape == (2, 2, 2, 1, 1)
    finally:
        sess.close()
    # any other TensorFlow error is an error
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        one = tf.compat.v1.placeholder(tf.int32, [])
        bad = tf.debugging.assert_equal(one, 2, message="not the reference")
        with pytest.raises(tf.errors.InvalidArgumentError, match="not the reference"):
            common.run_oracle(sess.run, bad, {one: 1})


def test_oracle_cache_runs_each_loop_once_per_arguments_and_returns_copies():
    calls = []

    def loop(sess, ys, feed, M=1):
        calls.append((sess, ys, M))
        return [feed["x"] * M, feed["x"] + len(calls)]

    cache, sess, ys = common.OracleCache(), object(), object()
    feed = {"x": np.arange(3.0)}
    first = cache.run(loop, sess, ys, feed)
    first[0][:] = -1                        # a test changing what it got
    again = cache.run(loop, sess, ys, {"x": np.arange(3.0)})   # equal values: cached
    assert len(calls) == 1
    np.testing.assert_array_equal(again[0], np.arange(3.0))
    np.testing.assert_array_equal(again[1], np.arange(3.0) + 1)
    # other values, another tensor or other arguments: run again
    np.testing.assert_array_equal(cache.run(loop, sess, ys, {"x": np.ones(3)})[0], np.ones(3))
    cache.run(loop, sess, object(), feed)
    np.testing.assert_array_equal(cache.run(loop, sess, ys, feed, M=2)[0], np.arange(3.0) * 2)
    assert len(calls) == 4

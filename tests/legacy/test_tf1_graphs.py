"""TF1 code under tf.compat.v1.disable_v2_behavior() (reference variables, v1 control
flow), against the one-example oracle: tf.compat.v1.layers, a v1 cond, a tf_keras model,
scenario 2's hand-checkable case, a Keras LSTM with v1 loops and with control flow v2,
and a v1-cond batch norm with a training placeholder (refused).
"""

import math

import numpy as np
import pytest
import tensorflow as tf

import tf_keras as keras

import pertower
from pertower import oracle
from tests import cases
from tests import common


# Graphs of TF1 code: tf.compat.v1.layers, v1 cond, a Keras model, scenario 2 ----------

def _close(got, want, what, rtol=None, atol=None, kind="tight"):
    common.assert_all_close(got, want, rtol, atol, what, kind)


def test_layers_model():
    """tf.compat.v1.layers MLP with reference variables, dropout off, against the loop."""
    with tf.Graph().as_default() as graph:
        tf.compat.v1.set_random_seed(0)
        s = tf.compat.v1.placeholder(tf.float32, [None, 3], name="s")
        h = tf.compat.v1.layers.dense(s, 8, tf.nn.relu, name="h")
        h = tf.compat.v1.layers.dropout(h, 0.5, training=False)
        w = tf.compat.v1.get_variable("scale", [8], initializer=tf.ones_initializer())
        out = tf.compat.v1.layers.dense(h * w, 2, name="out")       # [B, 2]
        ys = tf.reduce_sum(tf.tanh(out), axis=1)                     # [B]
        xs = tf.compat.v1.trainable_variables()
        kinds = {type(v).__name__ for v in xs}
        assert kinds == {"RefVariable"}, f"expected reference variables, got {kinds}"
        grads = pertower.per_example_gradients(ys, xs, batch_size=6)
        micro = pertower.microbatch_gradients(ys, xs, num_microbatches=3, batch_size=6)
        jac = pertower.per_example_jacobians(out, xs, batch_size=6)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            before = sess.run(xs)
            feed = {s: np.random.RandomState(0).randn(6, 3).astype(np.float32)}
            _close(sess.run(grads, feed), oracle.loop_per_example_gradients(sess, ys, xs, feed),
                   "per-example gradients")
            _close(sess.run(micro, feed),
                   oracle.loop_microbatch_gradients(sess, ys, xs, feed, 3), "microbatches")
            _close(sess.run(jac, feed), oracle.loop_per_example_jacobians(sess, out, xs, feed),
                   "Jacobians")
            _close(sess.run(xs), before, "variables unchanged", rtol=0, atol=0)


def test_v1_cond():
    """A v1 tf.cond (Switch/Merge) between the batch and ys."""
    with tf.Graph().as_default() as graph:
        x = tf.compat.v1.placeholder(tf.float32, [None, 2], name="x")
        flag = tf.compat.v1.placeholder_with_default(True, [], name="flag")
        w = tf.compat.v1.get_variable("w", [2, 2], initializer=tf.constant_initializer(
            [[1.0, -2.0], [0.5, 3.0]]))
        h = tf.compat.v1.cond(flag, lambda: tf.matmul(x, w), lambda: tf.matmul(x, 2 * w))
        ys = tf.reduce_sum(h ** 2, axis=1)
        grads = pertower.per_example_gradients(ys, [w], batch=x, batch_size=3)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for value in (True, False):
                feed = {x: np.arange(6, dtype=np.float32).reshape(3, 2), flag: value}
                _close(sess.run(grads, feed),
                       oracle.loop_per_example_gradients(sess, ys, [w], feed, batch=[x]),
                       f"v1 cond, flag={value}")


def test_keras_model():
    """A tf_keras functional model built under disable_v2_behavior()."""
    with tf.Graph().as_default() as graph:
        inputs = keras.Input(shape=(4,))
        hidden = keras.layers.Dense(5, activation="tanh")(inputs)
        model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
        ys = model.output[:, 0] ** 2                                  # [B]
        xs = model.trainable_weights
        grads = pertower.per_example_gradients(ys, xs, batch_size=4)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            feed = {inputs: np.random.RandomState(1).randn(4, 4).astype(np.float32)}
            _close(sess.run(grads, feed), oracle.loop_per_example_gradients(sess, ys, xs, feed),
                   "Keras model under v1 behaviour")


def test_hand_checkable_case():
    """The hand-checkable case of scenario 2 with reference variables: exact gradients and cosine."""
    g_value, cos_value = cases.run_scenario_2_hand_checkable_case()
    np.testing.assert_array_equal(g_value, [[3, 6, 9], [3, 6, 10]])
    want = 135 / math.sqrt(126 * 145)
    assert abs(cos_value - want) < 1e-6, (cos_value, want)


def test_hand_checkable_case_in_two_placeholders():
    """Scenario 2 with the batches in two placeholders (ys = concat([f(s1), f(s2)], 0))
    with reference variables: exact gradients, cosine, and the oracle's loop."""
    cases.check_scenario_2_two_placeholders_case()


# Recurrent layers: a Keras LSTM with v1 loops and with control flow v2 -------------------

def _check_lstm(what, v1_loops):
    """A Keras LSTM -> Dense(2), summed per example [B], against the loop at B = 3; with
    `v1_loops` the graph must hold a v1 while loop."""
    with tf.Graph().as_default() as graph:
        common.seed_weights(3)
        x = tf.compat.v1.placeholder(tf.float32, [None, 4, 2], name="x")
        ys = tf.reduce_sum(keras.layers.Dense(2)(keras.layers.LSTM(3)(x)), axis=1)   # [B]
        xs = tf.compat.v1.trainable_variables()
        if v1_loops:
            assert any(op.type == "LoopCond" for op in graph.get_operations()), "no v1 loop"
        loop = oracle.SliceLoop(ys, xs)   # before the session runs (while_v2 edits ops)
        grads = pertower.per_example_gradients(ys, xs, batch_size=3)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            feed = {x: np.random.RandomState(0).randn(3, 4, 2).astype(np.float32)}
            got, want = sess.run(grads, feed), loop.run(sess, feed, 3)
    common.assert_all_close(got, want, kind="deep", what=what)


@pytest.mark.heavy
def test_keras_lstm_with_v1_loops_matches_oracle():
    """A Keras LSTM built with v1 control flow: its weights are computed by row passes
    (one backward pass per example), against the loop."""
    _check_lstm("Keras LSTM, v1 loops", v1_loops=True)


@pytest.mark.heavy
def test_lstm_with_control_flow_v2_matches_oracle():
    """enable_control_flow_v2() under disable_v2_behavior(): LSTM against the loop."""
    tf.compat.v1.enable_control_flow_v2()
    try:
        _check_lstm("LSTM, control flow v2", v1_loops=False)
    finally:
        tf.compat.v1.disable_control_flow_v2()


# A v1 cond (Switch/Merge) batch norm with a training placeholder ------------------------

def test_v1_cond_batch_norm_with_a_training_placeholder_is_refused():
    """A batch norm whose training mode is a placeholder is refused; the same layer in
    inference mode is accepted."""
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 4, 4, 2], name="x")
        training = tf.compat.v1.placeholder(tf.bool, [], name="training")
        h = tf.compat.v1.layers.conv2d(x, 3, 3)
        normed = tf.compat.v1.layers.batch_normalization(h, training=training)
        ys = tf.reduce_sum(normed, axis=[1, 2, 3])
        graph_ops = tf.compat.v1.get_default_graph().get_operations()
        assert any(op.type == "Switch" for op in graph_ops), "no v1 cond in the graph"
        try:
            pertower.per_example_gradients(ys, tf.compat.v1.trainable_variables(),
                                           batch_size=3)
        except ValueError as error:
            assert "couples the examples of the batch" in str(error), error
            assert "is_training=True" in str(error) and "training=False" in str(error), error
        else:
            raise AssertionError("batch norm with a training placeholder was not refused")
        inference = tf.compat.v1.layers.batch_normalization(h, training=False,
                                                            name="inference")
        grads = pertower.per_example_gradients(tf.reduce_sum(inference, axis=[1, 2, 3]),
                                               tf.compat.v1.trainable_variables(),
                                               batch_size=3)
        assert len(grads) == len(tf.compat.v1.trainable_variables())

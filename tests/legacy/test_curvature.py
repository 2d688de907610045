"""Under tf.compat.v1.disable_v2_behavior() (reference
variables, v1 control flow): `pertower.diag_ggn` and `pertower.sum_grad_squared` against
the one-example loop, on a Keras MLP with a weight no rule covers (towers) and on a
network with a TF1 while loop between the batch and the logits (row passes).

The reference GGN diagonal is sum_n sum_{k,l} J_n[k] H_n[k, l] J_n[l] (elementwise over
the weight's entries), J_n from `pertower.oracle.loop_per_example_jacobians` and H_n the
softmax cross-entropy Hessian diag(p) - p p^T.
"""

import warnings

import numpy as np
import pytest
import tensorflow as tf

import tf_keras as keras
import pertower
from pertower import oracle
from tests.common import assert_all_close, reference_ggn

B = 4


def _compare(logits, loss, xs, feed, expected_routes):
    per_example = pertower.diag_ggn(logits, xs, per_example=True, batch_size=B)
    summed = pertower.diag_ggn(logits, xs, batch_size=B)
    squares = pertower.sum_grad_squared(loss, xs, batch_size=B)
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        want = reference_ggn(sess, logits, xs, feed)
        grads = oracle.loop_per_example_gradients(sess, loss, xs, feed)
        got = sess.run([list(per_example), list(summed), list(squares)], feed)
    assert_all_close(got[0], want, what="diag_ggn(per_example=True)", kind="deep")
    assert_all_close(got[1], [w.sum(0) for w in want], what="diag_ggn", kind="deep")
    assert_all_close(got[2], [np.square(g).sum(0) for g in grads], what="sum_grad_squared",
                     kind="deep")
    routes = [r.split(":")[0] for r in summed.routes]
    assert routes == expected_routes, routes
    return summed.explain()


def test_keras_mlp_with_a_towers_weight():
    with tf.Graph().as_default():
        rng = np.random.RandomState(0)
        x = tf.compat.v1.placeholder(tf.float64, [None, 5])
        labels = tf.compat.v1.placeholder(tf.int32, [None])
        net = keras.Sequential([keras.layers.Dense(6, activation="relu", dtype="float64"),
                                keras.layers.Dense(3, dtype="float64")])
        v = tf.compat.v1.get_variable("v", initializer=np.float64(rng.randn()),
                                      use_resource=False)
        bound = 0.5 + tf.square(tf.sin(v))                      # []
        logits = net(x) + tf.reduce_sum(tf.raw_ops.ClipByValue(
            t=x, clip_value_min=-bound, clip_value_max=bound), axis=1, keepdims=True)  # [B, 3]
        loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
        xs = list(net.trainable_weights) + [v]
        feed = {x: rng.randn(B, 5), labels: [0, 1, 2, 1]}
        print(_compare(logits, loss, xs, feed, ["rules, cheap form"] * 4 + ["towers"]))


@pytest.mark.heavy
def test_v1_while_loop_row_passes():
    with tf.Graph().as_default():
        rng = np.random.RandomState(1)
        x = tf.compat.v1.placeholder(tf.float64, [None, 5])
        labels = tf.compat.v1.placeholder(tf.int32, [None])
        w1 = tf.compat.v1.get_variable("w1", initializer=rng.randn(5, 4), use_resource=False)
        w2 = tf.compat.v1.get_variable("w2", initializer=rng.randn(4, 3), use_resource=False)
        inner = tf.compat.v1.get_variable("inner", initializer=rng.randn(4, 4) * 0.5,
                                          use_resource=False)
        _, h = tf.compat.v1.while_loop(
            lambda i, h: i < 2, lambda i, h: (i + 1, tf.tanh(h @ inner)),
            [tf.constant(0), x @ w1])                   # a v1 loop reading `inner`
        logits = h @ w2                                                    # [B, 3]
        loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
        feed = {x: rng.randn(B, 5), labels: [2, 1, 0, 1]}
        # `inner` is read inside the loop: no rule, and towers cannot replay a v1 loop
        print(_compare(logits, loss, [w1, inner, w2], feed,
                        ["rules, cheap form", "passes", "rules, cheap form"]))


@pytest.mark.heavy
def test_dynamic_rnn_frame_weights():
    # a BasicRNNCell's kernel and bias are read inside dynamic_rnn's v1 frame
    with tf.Graph().as_default():
        rng = np.random.RandomState(2)
        x = tf.compat.v1.placeholder(tf.float64, [None, 3, 4])
        labels = tf.compat.v1.placeholder(tf.int32, [None])
        cell = tf.compat.v1.nn.rnn_cell.BasicRNNCell(5, dtype=tf.float64)
        outputs, _ = tf.compat.v1.nn.dynamic_rnn(cell, x, dtype=tf.float64)
        w = tf.compat.v1.get_variable("w", initializer=rng.randn(5, 3), use_resource=False)
        logits = outputs[:, -1] @ w                                        # [B, 3]
        loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
        xs = list(cell.trainable_weights) + [w]
        feed = {x: rng.randn(B, 3, 4), labels: [0, 2, 1, 1]}
        routes = [r.split(":")[0] for r in pertower.diag_ggn(logits, xs, batch_size=B).routes]
        explained = _compare(logits, loss, xs, feed, routes)   # values against the loop
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            factors = pertower.kfac_factors(logits, xs, batch_size=B)
        if routes[0].startswith("rules"):   # the frame's own rule: kfac refuses by name
            assert factors[0] is None, factors
            text = "\n".join(str(c.message) for c in caught)
            assert xs[0].op.name in text and "inside a loop" in text, text
        print(explained)

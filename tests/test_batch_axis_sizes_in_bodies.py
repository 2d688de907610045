"""Sizes computed from `tf.shape` inside function bodies (While, If, function calls) read
as sizes, as they do outside (issue 32 item 6), against the one-example loop.

A body is analysed on the graph it was built from, where a weight keeps its shape: a
custom recurrent cell holding tf_keras' LayerNormalization (whose call reshapes by
`prod(tf.shape(x)[:1])`) is proven independent, not refused. A body read back without
its shapes loses the proof (the towers then run, checked), but reducing such sizes is
never taken for a coupling; a body that really reduces over the batch is still refused.
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import pertower
from pertower import oracle
from tests import common

B, T, D, UNITS = 4, 5, 3, 4


class _NormalizedCell(keras.layers.Layer):
    """h_t = tanh(LayerNormalization(Dense([x_t, h_{t-1}]))); with `batch_mean`, minus
    the mean over the batch (a genuine coupling)."""

    def __init__(self, batch_mean=False, **kwargs):
        super().__init__(**kwargs)
        self.state_size = UNITS
        self.batch_mean = batch_mean
        self.dense = keras.layers.Dense(UNITS)
        self.norm = keras.layers.LayerNormalization()

    def call(self, inputs, states):
        h = self.norm(self.dense(tf.concat([inputs, states[0]], -1)))
        if self.batch_mean:
            h = h - tf.reduce_mean(h, axis=0, name="batch_mean")
        h = tf.tanh(h)
        return h, [h]


def _rnn_model(batch_mean=False):
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(3)
        x = tf.compat.v1.placeholder(tf.float32, [None, T, D], name="x")
        ys = tf.reduce_sum(tf.square(keras.layers.RNN(_NormalizedCell(batch_mean))(x)), 1)
    return graph, x, ys


def _check_against_the_loop(graph, x, ys, xs, batch_size=None, sizes=(B,)):
    with graph.as_default():
        grads = pertower.per_example_gradients(ys, xs, batch=[x], batch_size=batch_size)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for seed, size in enumerate(sizes):
                shape = [size] + x.shape.as_list()[1:]
                feed = {x: np.random.RandomState(seed).randn(*shape).astype(np.float32)}
                if x.shape[0] is None:
                    want = common.run_oracle(oracle.loop_per_example_gradients, sess, ys, xs,
                                             feed)
                else:   # (a static batch cannot be fed one example at a time)
                    want = common.loop_rows_of_batch(sess, ys, xs, feed)
                common.assert_all_close(sess.run(grads, feed), want, kind="deep",
                                        what=f"B={size}")


def test_a_cell_with_layer_normalization_is_proven_and_its_dense_is_on_the_rules():
    graph, x, ys = _rnn_model()
    with graph.as_default():
        xs = tf.compat.v1.trainable_variables()
        plan = pertower.explain(ys, xs, batch=[x])
    assert plan.verdict == "independent" and not plan.couplings, plan
    methods = {row.name.split("/")[-1]: row.method for row in plan.weights}
    # LayerNormalization's gamma and beta, read by a broadcast Mul and AddV2 in the body,
    # are on the rules per step too (issue 32 item 2)
    assert set(methods) == {"kernel:0", "bias:0", "gamma:0", "beta:0"}, plan
    assert set(methods.values()) == {"rules"}, plan
    _check_against_the_loop(graph, x, ys, xs, batch_size=B)


@pytest.mark.parametrize("batch_dim", [None, B])
def test_a_while_loop_body_that_reshapes_by_its_batch_size(batch_dim):
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(4)
        x = tf.compat.v1.placeholder(tf.float32, [batch_dim, 6], name="x")
        w = tf.compat.v1.get_variable("w", [6, 6])

        def body(i, h):
            n = tf.shape(h)[0]
            z = tf.tanh(tf.reshape(tf.matmul(h, w), tf.stack([n, 2, 3])))
            scale = tf.cast(tf.reduce_prod(tf.shape(z)[1:]), tf.float32)
            return i + 1, tf.reshape(z, [n, 6]) / scale

        _, h = tf.while_loop(lambda i, h: i < 3, body, [0, x])
        ys = tf.reduce_sum(tf.square(h), 1)
        plan = pertower.explain(ys, [w], batch=[x])
    assert plan.verdict == "independent" and plan.weights[0].method == "rules", plan
    _check_against_the_loop(graph, x, ys, [w], sizes=(3, 5) if batch_dim is None else (B,))


@pytest.mark.parametrize("body", ["cond", "function"])
def test_layer_normalization_in_a_cond_or_a_function_is_proven(body):
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(5)
        x = tf.compat.v1.placeholder(tf.float32, [None, 6], name="x")
        dense, norm = keras.layers.Dense(UNITS), keras.layers.LayerNormalization()
        dense.build([None, 6])
        norm.build([None, UNITS])
        if body == "cond":
            flag = tf.compat.v1.placeholder_with_default(True, [])
            h = tf.cond(flag, lambda: norm(dense(x)), lambda: tf.tanh(norm(dense(x))))
        else:
            h = tf.function(lambda x: norm(dense(x)))(x)
        ys = tf.reduce_sum(tf.square(h), 1)
        xs = dense.trainable_weights + norm.trainable_weights
        plan = pertower.explain(ys, xs, batch=[x])
    assert plan.verdict == "independent" and not plan.couplings, plan
    _check_against_the_loop(graph, x, ys, xs, batch_size=B)


def test_a_body_read_back_without_its_shapes_is_unproven_not_refused(monkeypatch):
    """Read back from the library (as from a GraphDef), the body's weights have no shape,
    so LayerNormalization's reshape loses the batch axis; its `prod(tf.shape(x)[:1])`
    is then a size of a lost tensor, not a reduction over the examples."""
    monkeypatch.setattr(pertower._tf, "built_function_graph", lambda op, attr: None)
    graph, x, ys = _rnn_model()
    with graph.as_default():
        xs = tf.compat.v1.trainable_variables()
        plan = pertower.explain(ys, xs, batch=[x])
    assert plan.verdict == "unproven" and not plan.couplings, plan
    _check_against_the_loop(graph, x, ys, xs, batch_size=B)


def test_a_batch_mean_in_a_layer_normalized_cell_is_still_refused():
    graph, x, ys = _rnn_model(batch_mean=True)
    with graph.as_default():
        with pytest.raises(ValueError, match=r"\((Stateless)?While\).*runs the function .*"
                                             r"batch_mean.*reduces \(Mean\) over axis 0"):
            pertower.per_example_gradients(ys, tf.compat.v1.trainable_variables(), batch=[x],
                                           batch_size=B)


def _recurrent_model(layer, use, static):
    """ys from a tf_keras LSTM (h [B, UNITS]) or a GRU returning its sequences
    (h [B, T, UNITS]), with tf.shape(h)[0] sizing a reshape of h or a [B] factor of `ys`.
    A static batch folds tf.shape(h)[0] into the constant B; the While's body carries
    TensorListPushBack accumulators once a gradient has been taken through it."""
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(7)
        x = tf.compat.v1.placeholder(tf.float32, [B if static else None, T, D], name="x")
        if layer == "lstm":
            h = keras.layers.LSTM(UNITS)(x)
        else:
            h = keras.layers.GRU(UNITS, return_sequences=True)(x)
        if use == "reshape":
            flat = tf.reshape(h, [tf.shape(h)[0], -1])                     # [B, E]
            ys = tf.reduce_sum(tf.square(flat), 1)
        else:
            flat = tf.reshape(h, [-1, int(np.prod(h.shape[1:]))])          # [B, E]
            ys = tf.reduce_sum(tf.square(flat), 1) * tf.ones([tf.shape(h)[0]])
    return graph, x, ys


# each layer, use and shape mode once (the reshape by tf.shape(h)[0] in both modes)
@pytest.mark.parametrize("layer,use,static", [
    ("lstm", "reshape", False), ("gru", "reshape", True), ("gru", "ones", False)],
    ids=["lstm-reshape-dynamic_batch", "gru-reshape-static_batch", "gru-ones-dynamic_batch"])
def test_a_size_of_a_recurrent_layers_output_keeps_the_proof(layer, use, static):
    """[B, ...] -> [tf.shape(h)[0], -1] has one row per example whether tf.shape(h)[0]
    is read symbolically (dynamic B) or folded into a constant (static B); the gradient
    accumulators a while_v2 body gains (TensorListPushBack) are followed, not lost."""
    graph, x, ys = _recurrent_model(layer, use, static)
    with graph.as_default():
        xs = tf.compat.v1.trainable_variables()
        tf.gradients(ys, xs)   # (adds the accumulators to the While's body)
        plan = pertower.explain(ys, xs, batch=[x])
        assert plan.verdict == "independent" and not plan.couplings, plan
        assert {row.method for row in plan.weights} == {"rules"}, plan
        norms = pertower.per_example_norms(ys, xs, batch=[x])
    _check_against_the_loop(graph, x, ys, xs, sizes=(B,) if static else (B, 2))
    with graph.as_default(), tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        feed = {x: np.random.RandomState(0).randn(B, T, D).astype(np.float32)}
        want = common.loop_rows_of_batch(sess, ys, xs, feed)
        flat = np.concatenate([np.reshape(w, [B, -1]) for w in want], axis=1)
        common.assert_all_close(sess.run(norms, feed), np.linalg.norm(flat, axis=1),
                                what="norms")


@pytest.mark.parametrize("target", [[B, -1], [-1, UNITS], [2 * UNITS, B]])
def test_a_reshape_by_a_static_batch_size_is_proven_the_flat_way(target):
    """With a static B the target [B, -1] names no size symbolically: its rows are
    followed by the flat layout (B blocks of E entries), as [-1, UNITS] always is;
    [2 * UNITS, B], whose rows mix examples, still loses the proof."""
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(9)
        x = tf.compat.v1.placeholder(tf.float32, [B, 2 * UNITS], name="x")
        h = keras.layers.Dense(2 * UNITS)(x)                               # [B, 2 UNITS]
        axis = 0 if target[-1] == B else 1
        ys = tf.reshape(tf.reduce_sum(tf.square(tf.reshape(h, target)), axis), [B, -1])
        ys = tf.reduce_sum(ys, 1)                                          # [B]
        xs = tf.compat.v1.trainable_variables()
        plan = pertower.explain(ys, xs, batch=[x])
    if target[-1] == B:
        assert plan.verdict != "independent", plan
        return
    assert plan.verdict == "independent" and not plan.couplings, plan
    _check_against_the_loop(graph, x, ys, xs)

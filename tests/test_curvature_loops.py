"""Curvature with the columns' backward pass through pfor (`pertower._curvature.columns`)
over convolutions, poolings and elementwise ops, on BiasAdd in NCHW, and on weights read
inside loops (tf.while_loop, Keras LSTM), against the one-example loop.

Notation: B examples, K logits, H_n = diag(p_n) - p_n p_n^T the softmax cross-entropy
Hessian of example n. The reference GGN diagonal is sum_n sum_{k,l} J_n[k] H_n[k, l]
J_n[l] (entrywise over the weight), J_n from `pertower.oracle.loop_per_example_jacobians`
(one example fed at a time); the reference sum of squared gradients is the sum over n
of the squared one-example gradients (`oracle.loop_per_example_gradients`).
"""

import warnings

import numpy as np
import pytest
import tensorflow as tf

import pertower
from pertower import oracle
from tests import common

B = 3


class Graphs:
    """One graph and session for the module: a conv net whose path from the rules'
    outputs to the logits holds convolutions, poolings and elementwise ops; the same net
    with a Concat; BiasAdd in NCHW; a tf.while_loop reading a
    resource variable per step (its own graph: a while_v2's gradient is built before
    the session first runs its graph)."""

    def __init__(self):
        rng = np.random.RandomState(0)
        self.graph = tf.Graph()
        with self.graph.as_default():
            v = lambda shape, name, s=0.5: tf.Variable(rng.randn(*shape) * s, name=name)
            self.images = tf.compat.v1.placeholder(tf.float64, [None, 6, 6, 2])
            k1, b1 = v([3, 3, 2, 4], "k1"), v([4], "b1")
            dw = v([3, 3, 4, 1], "dw")
            k2 = v([2, 2, 4, 3], "k2")
            w, c = v([12, 4], "w"), v([4], "c")
            z = tf.tanh(tf.nn.bias_add(tf.nn.conv2d(self.images, k1, 1, "SAME"), b1))
            pooled = tf.nn.max_pool2d(z, 2, 2, "VALID")                     # [B, 3, 3, 4]
            over = tf.nn.max_pool2d(z, 3, 1, "SAME")                        # overlapping
            d = tf.nn.depthwise_conv2d(pooled + tf.reduce_mean(over, [1, 2], keepdims=True),
                                       dw, [1, 1, 1, 1], "SAME")            # [B, 3, 3, 4]
            e = tf.nn.leaky_relu(d, 0.2) * tf.sigmoid(pooled) - tf.nn.elu(d) * 0.5
            a = tf.nn.avg_pool2d(tf.nn.relu6(e * 3.0), 2, 1, "SAME")        # overlapping
            y = tf.nn.conv2d(a, k2, 1, "VALID")                             # [B, 2, 2, 3]
            flat = tf.reshape(tf.nn.relu(y), [-1, 12])
            h = tf.nn.bias_add(flat @ w, c)                                 # [B, 4]
            corner = tf.squeeze(tf.nn.avg_pool2d(a, 3, 3, "VALID"), [1, 2])   # [B, 4]
            self.logits = (tf.reduce_sum(tf.expand_dims(h, 1) * [[1.0], [0.5]], 1) +
                           tf.expand_dims(tf.reduce_sum(corner, 1), 1))       # [B, 4]
            self.xs = [k1, b1, dw, k2, w, c]
            # a ConcatV2 on the path
            self.concat_logits = tf.concat([h[:, :2], h[:, 2:] * 2.0], axis=1)

            # BiasAdd NCHW: the bias on axis 1 of [B, 3, 2, 2]
            self.nchw_x = tf.compat.v1.placeholder(tf.float64, [None, 3, 2, 2])
            self.nchw_b, self.nchw_w = v([3], "nchw_b"), v([12, 3], "nchw_w")
            added = tf.nn.bias_add(self.nchw_x, self.nchw_b, data_format="NCHW")
            self.nchw_logits = tf.reshape(tf.tanh(added), [-1, 12]) @ self.nchw_w

            self.sess = tf.compat.v1.Session()
            self.sess.run(tf.compat.v1.global_variables_initializer())
        self.feed = {self.images: rng.randn(B, 6, 6, 2), self.nchw_x: rng.randn(B, 3, 2, 2)}

    def build(self, function, *args, **kwargs):
        with self.graph.as_default():
            return function(*args, batch_size=B, **kwargs)

    def reference(self, logits, xs):
        with self.graph.as_default():
            return common.reference_ggn(self.sess, logits, xs, self.feed)

    def squares(self, ys, xs):
        with self.graph.as_default():
            grads = oracle.loop_per_example_gradients(self.sess, ys, xs, self.feed)
        return [np.square(g).sum(0) for g in grads]


@pytest.fixture(scope="module")
def graphs():
    g = Graphs()
    yield g
    g.sess.close()


def test_columns_match_loop_over_convolutions_poolings_and_elementwise_ops(graphs):
    # Conv2D, DepthwiseConv2dNative, MaxPool (2x2 VALID; 3x3 SAME), AvgPool (2x2 SAME
    # overlapping; 3x3 VALID), Tanh, Sigmoid, LeakyRelu, Elu, Relu6, Relu, Mul, Sub,
    # AddV2 with broadcasting, Mean, Sum, Reshape, ExpandDims, Squeeze, MatMul, BiasAdd
    # (TensorFlow 2.21's pfor does not convert DepthwiseConv2dNativeBackpropInput with a
    # filter shared by the columns: the while loop over the columns)
    result = graphs.build(pertower.diag_ggn, graphs.logits, graphs.xs, per_example=True)
    assert result.columns_method == "while loop", result.columns_reason
    assert "DepthwiseConv2dNativeBackpropInput" in result.columns_reason
    want = graphs.reference(graphs.logits, graphs.xs)
    common.assert_all_close(graphs.sess.run(list(result), graphs.feed), want, kind="deep",
                            what="diag_ggn through convolutions, poolings, elementwise ops")


def test_pfor_columns_through_a_concat(graphs):
    concat = graphs.build(pertower.diag_ggn, graphs.concat_logits, graphs.xs[4:])
    assert concat.columns_method == "pfor", concat.columns_reason
    got = graphs.sess.run(list(concat), graphs.feed)
    common.assert_all_close(got, [w.sum(0) for w in graphs.reference(
        graphs.concat_logits, graphs.xs[4:])], kind="deep", what="diag_ggn (pfor)")


def test_bias_add_nchw_sum_squared_sums_the_channel_axis(graphs):
    xs = [graphs.nchw_b, graphs.nchw_w]
    ggn = graphs.build(pertower.diag_ggn, graphs.nchw_logits, xs)
    squares = graphs.build(pertower.sum_grad_squared, graphs.nchw_logits, xs)
    assert ggn.columns_method == "pfor", ggn.columns_reason
    assert ggn.routes[0].startswith("rules, cheap form") and "BiasAdd" in ggn.routes[0]
    got = graphs.sess.run([list(ggn), list(squares)], graphs.feed)
    common.assert_all_close(got[0], [w.sum(0) for w in graphs.reference(
        graphs.nchw_logits, xs)], what="diag_ggn, BiasAdd NCHW")
    common.assert_all_close(got[1], graphs.squares(graphs.nchw_logits, xs),
                            what="sum_grad_squared, BiasAdd NCHW")


class OneExample:
    """The reference of a graph whose session has not run yet: tf.gradients of the
    logits with grad_ys a [1, K] placeholder, built at once, then run one example at a
    time (column e_k: row k of J_n; all ones: the gradient of sum(logits_n))."""

    def __init__(self, logits, xs):
        self.logits, self.xs = logits, xs
        self.grad_ys = tf.compat.v1.placeholder(logits.dtype, [1, logits.shape[1]])
        self.grads = tf.gradients(logits, xs, grad_ys=self.grad_ys)

    def ggn_and_squares(self, sess, feed):
        """([B, *x] GGN diagonals, [*x] sums of squared gradients of sum(logits_n))."""
        K = self.logits.shape[1]
        ggn, squares = [], [0.0] * len(self.xs)
        for one in oracle.slice_feeds(feed, None, B):
            f = sess.run(self.logits, one)[0]
            p = np.exp(f - f.max())
            p /= p.sum()
            H = np.diag(p) - np.outer(p, p)
            J = [sess.run(self.grads, {**one, self.grad_ys: np.eye(K)[k][None]})
                 for k in range(K)]                                  # [K][x] rows of J_n
            ggn.append([np.einsum("k...,kl,l...->...", np.stack([r[j] for r in J]), H,
                                  np.stack([r[j] for r in J])) for j in range(len(self.xs))])
            g = sess.run(self.grads, {**one, self.grad_ys: np.ones([1, K])})
            squares = [t + gj ** 2 for t, gj in zip(squares, g)]
        return [np.stack([e[j] for e in ggn]) for j in range(len(self.xs))], squares


def test_weights_read_inside_a_while_loop():
    rng = np.random.RandomState(3)
    with tf.Graph().as_default():
        v = lambda shape, name: tf.Variable(rng.randn(*shape) * 0.5, name=name)
        seq = tf.compat.v1.placeholder(tf.float64, [None, 4])
        w_in, w_step, w_out = v([4, 3], "w_in"), v([3, 3], "w_step"), v([3, 3], "w_out")
        _, state = tf.while_loop(lambda i, s: i < 3, lambda i, s: (i + 1, tf.tanh(s @ w_step)),
                                 [tf.constant(0), seq @ w_in])      # reads w_step per step
        logits = state @ w_out                                        # [B, 3]
        xs = [w_in, w_step, w_out]
        ggn = pertower.diag_ggn(logits, xs, per_example=True, batch_size=B)
        squares = pertower.sum_grad_squared(logits, xs, batch_size=B)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            factors = pertower.kfac_factors(logits, xs, batch_size=B)
        reference = OneExample(logits, xs)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            feed = {seq: rng.randn(B, 4)}
            got = sess.run([list(ggn), list(squares)], feed)
            want_ggn, want_squares = reference.ggn_and_squares(sess, feed)
    assert "per step" in str(ggn.plan), str(ggn.plan)      # w_step: the loop's own rule
    assert ggn.columns_method == "per column", ggn.columns_reason     # w_in: through While
    common.assert_all_close(got[0], want_ggn, kind="deep",
                            what="diag_ggn, weight read inside a tf.while_loop")
    common.assert_all_close(got[1], want_squares, kind="deep",
                            what="sum_grad_squared, weight read inside a tf.while_loop")
    assert factors[1] is None and factors[0] is not None and factors[2] is not None
    text = "\n".join(str(w.message) for w in caught)
    assert "w_step" in text and "inside a loop" in text, text


@pytest.mark.heavy
def test_keras_lstm_weights_heavy():
    import tf_keras as keras  # pylint: disable=import-outside-toplevel
    rng = np.random.RandomState(2)
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float64, [None, 4, 3])
        net = keras.Sequential([keras.layers.LSTM(3, dtype="float64"),
                                keras.layers.Dense(4, dtype="float64")])
        logits = net(x)
        xs = list(net.trainable_weights)
        ggn = pertower.diag_ggn(logits, xs, per_example=True, batch_size=B)
        squares = pertower.sum_grad_squared(logits, xs, batch_size=B)
        reference = OneExample(logits, xs)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            feed = {x: rng.randn(B, 4, 3)}
            got = sess.run([list(ggn), list(squares)], feed)
            want_ggn, want_squares = reference.ggn_and_squares(sess, feed)
    common.assert_all_close(got[0], want_ggn, kind="deep", what="diag_ggn, Keras LSTM")
    common.assert_all_close(got[1], want_squares, kind="deep",
                            what="sum_grad_squared, Keras LSTM")

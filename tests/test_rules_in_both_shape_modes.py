"""The per-op rules in both shape modes (issue 17, item 7): under
tf.compat.v1.disable_v2_behavior() static shapes are `Dimension` objects, and a rule
that does int arithmetic on them crashed (a strided VALID convolution that never reads
the last row or column: 1x1 stride 2 on 8x8, every ResNet shortcut). Each check
computes one layer type with method="rules" and compares it with the one-example loop.

Here in graph mode (TensorFlow 2 shapes); tests/legacy/test_rules_in_both_shape_modes.py runs
the same tests under disable_v2_behavior().
"""

import functools

import numpy as np
import pytest
import tensorflow as tf

import pertower
from pertower import oracle
from tests import common

B = 3


@functools.lru_cache(maxsize=None)
def _tensorflow_conv_gradient_error():
    """Max error of TensorFlow's own gradient of a 1x1 stride-2 VALID convolution on
    8x8 (the loop's reference) against float64 numpy over ten runs, in this process's
    oneDNN setting."""
    x_value = np.random.RandomState(1).randn(1, 8, 8, 3).astype(np.float32)
    w_value = np.random.RandomState(0).randn(1, 1, 3, 4)
    with tf.Graph().as_default():   # (placeholders: nothing folded at build time)
        x = tf.compat.v1.placeholder(tf.float32, [None, 8, 8, 3])
        w = tf.compat.v1.placeholder(tf.float32, [1, 1, 3, 4])
        y = tf.nn.conv2d(x, w, strides=2, padding="VALID")              # [1, 4, 4, 4]
        g = tf.gradients(tf.reduce_sum(y ** 2), w)[0]
        with tf.compat.v1.Session() as sess:   # (it goes wrong on some runs only)
            runs = [sess.run(g, {x: x_value, w: w_value.astype(np.float32)})
                    for _ in range(10)]
    rows = x_value[0, ::2, ::2, :].reshape(-1, 3).astype(np.float64)   # [16, 3]
    want = (rows.T @ (2 * rows @ w_value[0, 0]))[None, None]
    return max(float(np.abs(got - want).max() / np.abs(want).max()) for got in runs)


def _rules_match_loop(build, x_shape, what, x_dtype=tf.float32, feed_x=None):
    """`build(x)` -> (ys [B], xs); every weight by the rules, against the loop."""
    with tf.Graph().as_default() as graph:
        common.seed_weights(61)
        x = tf.compat.v1.placeholder(x_dtype, [None] + list(x_shape), name="x")
        ys, xs = build(x)
        if not tf.compat.v1.resource_variables_enabled():   # disable_v2_behavior()
            assert isinstance(x.shape[1], tf.compat.v1.Dimension), type(x.shape[1])
        grads = pertower.per_example_gradients(ys, xs, batch_size=B, method="rules")
        value = feed_x if feed_x is not None else np.random.RandomState(0).randn(
            B, *x_shape).astype(np.float32)
        feed = {x: value}
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            got = sess.run(grads, feed)
            want = oracle.loop_per_example_gradients(sess, ys, xs, feed)
    common.assert_all_close(got, want, kind="deep", what=what)


def _conv(ksize, stride, padding, channels=2):
    def build(x):
        k = tf.compat.v1.get_variable("k", [ksize, ksize, channels, 3])
        y = tf.nn.conv2d(x, k, stride, padding)
        return tf.reduce_sum(tf.tanh(y) ** 2, axis=[1, 2, 3]), [k]
    return build


def test_conv2d_strided_valid_that_skips_the_last_rows():
    """1x1 stride 2 on 8x8 (a ResNet shortcut), 3x3 stride 2 on 8x8, 2x2 stride 3 on
    9x9: VALID convolutions that never read the last row and column."""
    error = _tensorflow_conv_gradient_error()
    if error > 1e-4:
        pytest.skip("TensorFlow's own Conv2DBackpropFilter, the loop's reference, is "
                    f"wrong here (relative error {error:.2g} for a 1x1 stride-2 VALID "
                    "convolution against float64 numpy; oneDNN on a CPU without "
                    "AVX-512), so the rule cannot be checked against the loop")
    _rules_match_loop(_conv(1, 2, "VALID"), [8, 8, 2], "1x1 stride 2 VALID")
    _rules_match_loop(_conv(3, 2, "VALID"), [8, 8, 2], "3x3 stride 2 VALID")
    _rules_match_loop(_conv(2, 3, "VALID"), [9, 9, 2], "2x2 stride 3 VALID")


def test_conv2d_same_and_unstrided():
    _rules_match_loop(_conv(3, 2, "SAME"), [8, 8, 2], "3x3 stride 2 SAME")
    _rules_match_loop(_conv(3, 1, "VALID"), [7, 7, 2], "3x3 stride 1 VALID")


def test_depthwise_conv2d_strided_valid():
    def build(x):
        k = tf.compat.v1.get_variable("k", [3, 3, 2, 2])
        y = tf.nn.depthwise_conv2d(x, k, [1, 2, 2, 1], "VALID")
        return tf.reduce_sum(tf.tanh(y) ** 2, axis=[1, 2, 3]), [k]
    _rules_match_loop(build, [8, 8, 2], "depthwise 3x3 stride 2 VALID")


def test_dense_bias_and_batch_matmul():
    def build(x):                                     # x: [B, 4, 3]
        w = tf.compat.v1.get_variable("w", [3, 5])
        b = tf.compat.v1.get_variable("b", [5])
        v = tf.compat.v1.get_variable("v", [5, 2])
        h = tf.tanh(tf.nn.bias_add(tf.tensordot(x, w, 1), b))       # [B, 4, 5]
        z = tf.matmul(h, tf.tile(v[None], tf.stack([tf.shape(h)[0], 1, 1])))
        return tf.reduce_sum(z ** 2, axis=[1, 2]), [w, b]
    _rules_match_loop(build, [4, 3], "dense, bias_add, batch matmul")


def test_embedding_lookup():
    def build(ids):                                   # ids: [B, 4]
        table = tf.compat.v1.get_variable("table", [10, 3])
        e = tf.nn.embedding_lookup(table, ids)                      # [B, 4, 3]
        return tf.reduce_sum(tf.tanh(e) ** 2, axis=[1, 2]), [table]
    ids = np.random.RandomState(1).randint(0, 10, size=[B, 4]).astype(np.int32)
    _rules_match_loop(build, [4], "embedding_lookup", tf.int32, ids)

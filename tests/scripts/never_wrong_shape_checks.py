"""The per-op rules in both shape modes (issue 17, item 7): under
tf.compat.v1.disable_v2_behavior() static shapes are `Dimension` objects, and a rule
that does int arithmetic on them crashed (a strided VALID convolution that never reads
the last row or column: 1x1 stride 2 on 8x8, every ResNet shortcut). Each check
computes one layer type with method="rules" and compares it with the one-example loop.

    python tests/scripts/never_wrong_shape_checks.py [legacy]

"legacy" runs the checks under disable_v2_behavior(); without it, in TensorFlow 2
behaviour with eager execution off. Prints one `pertower-check` line per check.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

LEGACY = "legacy" in sys.argv[1:]
if LEGACY:
    tf.compat.v1.disable_v2_behavior()
else:
    tf.compat.v1.disable_eager_execution()

import pertower  # noqa: E402
from pertower import oracle  # noqa: E402
from tests import common  # noqa: E402
from tests import process_checks  # noqa: E402

B = 3


def _rules_match_loop(build, x_shape, what, x_dtype=tf.float32, feed_x=None):
    """`build(x)` -> (ys [B], xs); every weight by the rules, against the loop."""
    with tf.Graph().as_default() as graph:
        common.seed_weights(61)
        x = tf.compat.v1.placeholder(x_dtype, [None] + list(x_shape), name="x")
        ys, xs = build(x)
        if LEGACY:
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


def check_conv2d_strided_valid_that_skips_the_last_rows():
    """1x1 stride 2 on 8x8 (a ResNet shortcut), 3x3 stride 2 on 8x8, 2x2 stride 3 on
    9x9: VALID convolutions that never read the last row and column."""
    _rules_match_loop(_conv(1, 2, "VALID"), [8, 8, 2], "1x1 stride 2 VALID")
    _rules_match_loop(_conv(3, 2, "VALID"), [8, 8, 2], "3x3 stride 2 VALID")
    _rules_match_loop(_conv(2, 3, "VALID"), [9, 9, 2], "2x2 stride 3 VALID")


def check_conv2d_same_and_unstrided():
    _rules_match_loop(_conv(3, 2, "SAME"), [8, 8, 2], "3x3 stride 2 SAME")
    _rules_match_loop(_conv(3, 1, "VALID"), [7, 7, 2], "3x3 stride 1 VALID")


def check_depthwise_conv2d_strided_valid():
    def build(x):
        k = tf.compat.v1.get_variable("k", [3, 3, 2, 2])
        y = tf.nn.depthwise_conv2d(x, k, [1, 2, 2, 1], "VALID")
        return tf.reduce_sum(tf.tanh(y) ** 2, axis=[1, 2, 3]), [k]
    _rules_match_loop(build, [8, 8, 2], "depthwise 3x3 stride 2 VALID")


def check_dense_bias_and_batch_matmul():
    def build(x):                                     # x: [B, 4, 3]
        w = tf.compat.v1.get_variable("w", [3, 5])
        b = tf.compat.v1.get_variable("b", [5])
        v = tf.compat.v1.get_variable("v", [5, 2])
        h = tf.tanh(tf.nn.bias_add(tf.tensordot(x, w, 1), b))       # [B, 4, 5]
        z = tf.matmul(h, tf.tile(v[None], tf.stack([tf.shape(h)[0], 1, 1])))
        return tf.reduce_sum(z ** 2, axis=[1, 2]), [w, b]
    _rules_match_loop(build, [4, 3], "dense, bias_add, batch matmul")


def check_embedding_lookup():
    def build(ids):                                   # ids: [B, 4]
        table = tf.compat.v1.get_variable("table", [10, 3])
        e = tf.nn.embedding_lookup(table, ids)                      # [B, 4, 3]
        return tf.reduce_sum(tf.tanh(e) ** 2, axis=[1, 2]), [table]
    ids = np.random.RandomState(1).randint(0, 10, size=[B, 4]).astype(np.int32)
    _rules_match_loop(build, [4], "embedding_lookup", tf.int32, ids)


CHECKS = [check_conv2d_strided_valid_that_skips_the_last_rows, check_conv2d_same_and_unstrided,
          check_depthwise_conv2d_strided_valid, check_dense_bias_and_batch_matmul,
          check_embedding_lookup]

if __name__ == "__main__":
    sys.exit(process_checks.run_checks(CHECKS, "never-wrong shape checks"))

"""The convolution ways the zoo networks run on, against the one-example loop:
DepthwiseConv2dNativeBackpropInput (a depthwise transposed convolution,
`depthwise_conv2d.DepthwiseConv2DTransposeRule`) and the Conv2D ways of
`rules/conv2d.py` at the shapes of small-input networks (few positions, 1x1 filters,
thin channels), each way forced and "auto".

Each `check_*` function builds its own graph and asserts against `pertower.oracle`;
the tests here run them in this process (graph mode, TF2 behaviour, oneDNN as this
machine sets it); tests/legacy/test_conv_rules.py runs them under
`tf.compat.v1.disable_v2_behavior()` and tests/eager/test_onednn_convs.py with
TF_ENABLE_ONEDNN_OPTS=1 (both heavy).
"""

import numpy as np
import pytest
import tensorflow as tf

import pertower
from pertower import oracle
from pertower import rules as rules_lib
from pertower.rules import conv2d
from pertower.rules import depthwise_conv2d
from tests import common

B = 3
CHECKS = ("check_depthwise_transposed", "check_conv2d_small_shapes")


def _registry(op_type, rule):
    registry = rules_lib.default_registry()
    registry.register(op_type, rule)
    return registry


def _compare(ys, xs, feed, registry, what):
    """Per-example gradients and norms (method="rules", no batch_size) against the
    loop; every weight on the rules."""
    plan = pertower.explain(ys, xs, rules=registry)
    off = {w.name: w.reason for w in plan.weights if w.method != "rules"}
    assert not off, f"{what}: weights not on the rules: {off}"
    grads = pertower.per_example_gradients(ys, xs, method="rules", rules=registry)
    norms = pertower.per_example_norms(ys, xs, method="rules", rules=registry)
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        got, got_norms = sess.run([grads, norms], feed)
        want = oracle.loop_per_example_gradients(sess, ys, xs, feed)
    common.assert_all_close(got, want, what=f"{what}: per-example gradients", kind="deep")
    want_norms = np.sqrt(sum(np.sum(g.reshape(len(g), -1) ** 2, axis=1) for g in want))
    common.assert_all_close([got_norms], [want_norms], what=f"{what}: norms", kind="deep")
    assert all(np.abs(g).max() > 0 for g in want), f"{what}: a weight has zero gradients"


def _per_example_loss(outputs):
    return tf.add_n([tf.reduce_sum(tf.square(z), axis=[1, 2, 3]) for z in outputs])


# -- DepthwiseConv2dNativeBackpropInput ----------------------------------------------

# (input side, channels C, multiplier M, filter side, stride, padding)
_TRANSPOSED = ((4, 3, 2, 3, 2, "SAME"), (5, 2, 1, 3, 1, "VALID"), (3, 4, 1, 1, 2, "VALID"),
               (4, 2, 3, 2, 2, "SAME"))


DEPTHWISE_WAYS = ("auto", "grouped", "shifts", "patches")


def check_depthwise_transposed(strategies=DEPTHWISE_WAYS):
    """Four depthwise transposed convolutions (strides 1 and 2, SAME and VALID,
    multipliers 1-3, 1x1 to 3x3 filters), the data input a convolution of the batch,
    by each way of `strategies` of the depthwise rule."""
    rng = np.random.default_rng(0)
    for strategy in strategies:
        with tf.Graph().as_default():
            x = tf.compat.v1.placeholder(tf.float32, [None, 5, 5, 2])
            outputs, weights, feed = [], [], {x: rng.standard_normal((B, 5, 5, 2))}
            for j, (side, c, m, k, s, padding) in enumerate(_TRANSPOSED):
                pre = tf.Variable(rng.standard_normal((2, 2, 2, c * m)).astype("float32"))
                a = tf.image.resize(tf.nn.conv2d(x, pre, 1, "SAME"), [side, side])
                w = tf.Variable(rng.standard_normal((k, k, c, m)).astype("float32"),
                                name=f"w{j}")
                out_side = (side - 1) * s + (k if padding == "VALID" else 1)
                outputs.append(tf.raw_ops.DepthwiseConv2dNativeBackpropInput(
                    input_sizes=tf.stack([tf.shape(a)[0], out_side, out_side, c]), filter=w,
                    out_backprop=a, strides=[1, s, s, 1], padding=padding))
                weights += [w, pre]
            rule = depthwise_conv2d.DepthwiseConv2DTransposeRule(conv2d.ConvOptions(strategy))
            _compare(_per_example_loss(outputs), weights, feed,
                     _registry("DepthwiseConv2dNativeBackpropInput", rule),
                     f"depthwise transposed, {strategy}")


@pytest.mark.parametrize("strategy", [
    "auto", *(pytest.param(way, marks=pytest.mark.heavy) for way in DEPTHWISE_WAYS[1:])])
def test_depthwise_transposed_matches_the_loop(strategy):
    check_depthwise_transposed([strategy])


def test_depthwise_transposed_refuses_its_data_input_as_weight():
    with tf.Graph().as_default():
        z = tf.raw_ops.DepthwiseConv2dNativeBackpropInput(
            input_sizes=[1, 4, 4, 2], filter=tf.ones([3, 3, 2, 1]),
            out_backprop=tf.ones([1, 4, 4, 2]), padding="SAME", strides=[1, 1, 1, 1])
        reason = depthwise_conv2d.DepthwiseConv2DTransposeRule().match(z.op, 2, None)
        assert "not its filter" in reason, reason


# -- Conv2D at the shapes of small-input networks --------------------------------------

# (input side, Cin, Cout, filter side, stride, padding): few positions (1x1 and 2x2
# outputs, a 3x3 filter mostly on the padding), 1x1 filters with and without strides,
# thin and wide input channels, many positions
_CONVOLUTIONS = ((1, 6, 5, 3, 1, "SAME"), (2, 9, 4, 3, 1, "SAME"), (3, 8, 6, 1, 1, "VALID"),
                 (4, 3, 4, 1, 2, "VALID"), (9, 10, 3, 3, 2, "SAME"), (9, 2, 3, 5, 1, "SAME"),
                 (5, 12, 7, 1, 1, "SAME"))


CONV2D_WAYS = ("auto", "shifts", "patches", "grouped")


def check_conv2d_small_shapes(strategies=CONV2D_WAYS):
    """Seven convolutions at small-network shapes, by each way of `strategies` that
    computes them on this machine ("grouped" needs oneDNN)."""
    rng = np.random.default_rng(1)
    for strategy in strategies:
        if strategy == "grouped" and not conv2d.onednn_enabled():
            continue
        with tf.Graph().as_default():
            x = tf.compat.v1.placeholder(tf.float32, [None, 9, 9, 2])
            outputs, weights, feed = [], [], {x: rng.standard_normal((B, 9, 9, 2))}
            for j, (side, c_in, c_out, k, s, padding) in enumerate(_CONVOLUTIONS):
                pre = tf.Variable(rng.standard_normal((1, 1, 2, c_in)).astype("float32"))
                a = tf.image.resize(tf.nn.conv2d(x, pre, 1, "SAME"), [side, side])
                w = tf.Variable(rng.standard_normal((k, k, c_in, c_out)).astype("float32"),
                                name=f"w{j}")
                outputs.append(tf.nn.conv2d(a, w, s, padding))
                weights += [w, pre]
            rule = conv2d.Conv2DRule(conv2d.ConvOptions(strategy))
            _compare(_per_example_loss(outputs), weights, feed, _registry("Conv2D", rule),
                     f"Conv2D, {strategy}")


@pytest.mark.parametrize("strategy", [
    "auto", *(pytest.param(way, marks=pytest.mark.heavy) for way in CONV2D_WAYS[1:])])
def test_conv2d_small_shapes_match_the_loop(strategy):
    check_conv2d_small_shapes([strategy])

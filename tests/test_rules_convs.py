"""Convolution rules against the one-example loop: Conv2DBackpropInput (transposed
convolutions, rules/conv2d_transpose.py), Conv3D (rules/conv3d.py), the NCHW data
format (_convolution/views.py, rules/bias_add.py) and dilated convolutions as TensorFlow
builds them without oneDNN, SpaceToBatchND -> Conv2D -> BatchToSpaceND
(_batch_axis/transfer_blocks.py).

Each `check_*` function builds its own graph, asserts that `pertower.explain` puts every
weight on the rules (none on the towers, no batch_size) and that per-example gradients
and norms match `pertower.oracle`. The tests here run them in this process (graph mode,
TF2 behaviour, oneDNN as this machine sets it); tests/legacy/test_conv_rules.py runs
`CHECKS["legacy"]` under `tf.compat.v1.disable_v2_behavior()` and
tests/eager/test_onednn_convs.py `CHECKS["onednn"]` with TF_ENABLE_ONEDNN_OPTS=1 (NCHW
convolutions run on the CPU only with oneDNN, and
the oneDNN filter-gradient check).
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import pertower
from pertower import _batch_axis
from pertower import _graph_walk
from pertower import oracle
from pertower.rules import conv2d
from tests import common

B = 3


def _session(graph):
    sess = tf.compat.v1.Session(graph=graph)
    sess.run(tf.compat.v1.global_variables_initializer())
    return sess


def _assert_on_rules(ys, xs, op_types):
    """explain: every weight of xs on the rules, and every op type of `op_types` among
    the ops that compute them."""
    plan = pertower.explain(ys, xs)
    off = {w.name: w.reason for w in plan.weights if w.method != "rules"}
    assert not off, f"weights not on the rules: {off}"
    for op_type in op_types:
        assert any(f"({op_type})" in op for w in plan.weights for op in w.ops), (
            f"no weight is computed by a {op_type} rule:\n{plan}")
    return plan


def _check_against_loop(graph, ys, xs, feed, what, op_types):
    """Per-example gradients and norms (method="rules", no batch_size) against the loop;
    their sum against tf.gradients."""
    _assert_on_rules(ys, xs, op_types)
    grads = pertower.per_example_gradients(ys, xs, method="rules")
    norms = pertower.per_example_norms(ys, xs, method="rules")
    batch_grads = tf.gradients(tf.reduce_sum(ys), xs)
    sess = _session(graph)
    got, got_norms, batch_values = sess.run([grads, norms, batch_grads], feed)
    want = oracle.loop_per_example_gradients(sess, ys, xs, feed)
    common.assert_all_close(got, want, what=f"{what}: per-example gradients", kind="deep")
    want_norms = np.sqrt(sum(np.sum(g.reshape(len(g), -1) ** 2, axis=1) for g in want))
    common.assert_all_close([got_norms], [want_norms], what=f"{what}: norms", kind="deep")
    common.assert_all_close([g.sum(axis=0) for g in got], batch_values,
                            what=f"{what}: sum over examples", kind="deep")
    assert all(np.abs(g).max() > 0 for g in want), f"{what}: a weight has zero gradients"
    return sess


def _op_types(ys):
    return {op.type for op in _graph_walk.upstream_ops([ys])}


# -- dilated convolutions (SpaceToBatchND -> Conv2D -> BatchToSpaceND) -------------------

def check_dilated():
    """tf_keras Conv2D(dilation 2, SAME) -> DepthwiseConv2D(dilation (2, 1), VALID) ->
    tf.nn.convolution(dilations 2, VALID) -> tf.nn.atrous_conv2d(rate 2, SAME), and a
    convolution between two nested SpaceToBatchND/BatchToSpaceND pairs (blocks [2, 2]
    then [1, 3]: 12 blocks per example); a causal dilated Conv1D (ExpandDims and
    Squeeze between the blocks) and a dilated SeparableConv2D."""
    with tf.Graph().as_default() as graph:
        common.seed_weights(30)
        rng = np.random.RandomState(30)
        x = tf.compat.v1.placeholder(tf.float32, [None, 13, 12, 2], name="x")
        conv = keras.layers.Conv2D(4, 3, dilation_rate=2, padding="same")
        depthwise = keras.layers.DepthwiseConv2D(3, dilation_rate=(2, 1), depth_multiplier=2)
        h = depthwise(tf.tanh(conv(x)))                                  # [B, 9, 10, 8]
        w1 = tf.compat.v1.get_variable("w1", initializer=rng.randn(2, 2, 8, 3).astype(
            np.float32) * 0.3)
        h = tf.nn.convolution(tf.tanh(h), w1, padding="VALID", dilations=2)  # [B, 7, 8, 3]
        w2 = tf.compat.v1.get_variable("w2", initializer=rng.randn(3, 3, 3, 3).astype(
            np.float32) * 0.3)
        h = tf.nn.atrous_conv2d(tf.tanh(h), w2, rate=2, padding="SAME")     # [B, 7, 8, 3]
        w3 = tf.compat.v1.get_variable("w3", initializer=rng.randn(2, 1, 3, 2).astype(
            np.float32) * 0.3)
        blocks = tf.space_to_batch_nd(tf.space_to_batch_nd(h, [2, 2], [[1, 0], [0, 0]]),
                                      [1, 3], [[0, 0], [2, 0]])            # [12B, 4, 2, 3]
        z = tf.nn.conv2d(blocks, w3, 1, "SAME")
        z = tf.compat.v1.batch_to_space_nd(tf.compat.v1.batch_to_space_nd(
            z, [1, 3], [[0, 0], [2, 0]]), [2, 2], [[1, 0], [0, 0]])          # [B, 7, 8, 2]
        causal = keras.layers.Conv1D(3, 3, dilation_rate=2, padding="causal")
        separable = keras.layers.SeparableConv2D(2, 2, dilation_rate=3)
        line = causal(tf.reshape(x, [-1, 26, 12]))                        # [B, 26, 3]
        ys = (tf.reduce_sum(tf.sin(z), axis=[1, 2, 3]) + tf.reduce_sum(tf.cos(line), [1, 2])
              + tf.reduce_sum(tf.sin(separable(x)), axis=[1, 2, 3]))      # [B]
        xs = (conv.trainable_weights + depthwise.trainable_weights + [w1, w2, w3]
              + causal.trainable_weights + separable.trainable_weights)
        if not conv2d.onednn_enabled():
            assert "SpaceToBatchND" in _op_types(ys)
        feed = {x: rng.randn(B, 13, 12, 2).astype(np.float32)}
        _check_against_loop(graph, ys, xs, feed, "dilated convolutions",
                            ["Conv2D", "DepthwiseConv2dNative"])


# -- transposed convolutions (Conv2DBackpropInput) ---------------------------------------

def check_transposed():
    """tf_keras Conv2DTranspose (stride 2 SAME; (2, 3) kernel, strides (1, 2), VALID),
    Conv1DTranspose (its filter through ExpandDims) and tf.nn.conv2d_transpose with the
    batch size taken from tf.shape (stride 2 VALID, dilations 1)."""
    with tf.Graph().as_default() as graph:
        common.seed_weights(31)
        rng = np.random.RandomState(31)
        x = tf.compat.v1.placeholder(tf.float32, [None, 4, 5, 3], name="x")
        first = keras.layers.Conv2DTranspose(4, 3, strides=2, padding="same")
        second = keras.layers.Conv2DTranspose(2, (2, 3), strides=(1, 2), padding="valid")
        h = second(tf.tanh(first(x)))                                    # [B, 9, 21, 2]
        w = tf.compat.v1.get_variable("w", initializer=rng.randn(3, 3, 2, 3).astype(
            np.float32) * 0.3)
        z = tf.nn.conv2d_transpose(x, w, tf.stack([tf.shape(x)[0], 9, 11, 2]), strides=2,
                                   padding="VALID")                      # [B, 9, 11, 2]
        one_d = keras.layers.Conv1DTranspose(2, 3, strides=2)
        line = one_d(tf.reshape(x, [-1, 20, 3]))                         # [B, 41, 2]
        ys = (tf.reduce_sum(tf.sin(h), axis=[1, 2, 3]) + tf.reduce_sum(z ** 2, axis=[1, 2, 3])
              + tf.reduce_sum(tf.cos(line), axis=[1, 2]))
        xs = (first.trainable_weights + second.trainable_weights + [w]
              + one_d.trainable_weights)
        feed = {x: rng.randn(B, 4, 5, 3).astype(np.float32)}
        _check_against_loop(graph, ys, xs, feed, "transposed convolutions",
                            ["Conv2DBackpropInput"])


# -- Conv3D --------------------------------------------------------------------------------

def check_conv3d():
    """tf_keras Conv3D: dilation (2, 1, 1) SAME (SpaceToBatchND without oneDNN), a
    (2, 1, 2) kernel with strides (2, 1, 1) VALID, 9 input channels (one matmul per tap),
    tf.nn.conv3d stride 2 SAME, and Conv3DTranspose (Conv3DBackpropInputV2)."""
    with tf.Graph().as_default() as graph:
        common.seed_weights(32)
        rng = np.random.RandomState(32)
        x = tf.compat.v1.placeholder(tf.float32, [None, 5, 4, 6, 2], name="x")
        dilated = keras.layers.Conv3D(3, 3, dilation_rate=(2, 1, 1), padding="same")
        strided = keras.layers.Conv3D(9, (2, 1, 2), strides=(2, 1, 1))
        wide = keras.layers.Conv3D(2, 2, padding="same")
        h = wide(tf.tanh(strided(tf.tanh(dilated(x)))))                 # [B, 2, 4, 5, 2]
        w = tf.compat.v1.get_variable("w", initializer=rng.randn(2, 3, 2, 2, 3).astype(
            np.float32) * 0.3)
        z = tf.nn.conv3d(x, w, [1, 2, 2, 2, 1], "SAME")                   # [B, 3, 2, 3, 3]
        up = keras.layers.Conv3DTranspose(2, 2, strides=(1, 2, 1), padding="same")
        ys = (tf.reduce_sum(tf.sin(h), axis=[1, 2, 3, 4]) + tf.reduce_sum(z ** 2, [1, 2, 3, 4])
              + tf.reduce_sum(tf.cos(up(x)), axis=[1, 2, 3, 4]))          # up: [B, 5, 8, 6, 2]
        xs = (dilated.trainable_weights + strided.trainable_weights + wide.trainable_weights
              + [w] + up.trainable_weights)
        feed = {x: rng.randn(B, 5, 4, 6, 2).astype(np.float32)}
        _check_against_loop(graph, ys, xs, feed, "Conv3D",
                            ["Conv3D", "Conv3DBackpropInputV2"])


# -- NCHW -----------------------------------------------------------------------------------

def _nchw_graph():
    """tf.nn.conv2d NCHW (stride 2 SAME), depthwise NCHW (VALID), bias_add NCHW and
    conv2d_transpose NCHW; (graph, ys, xs, feed). (Not explicit padding: TensorFlow's
    CPU Conv2DBackpropFilter refuses it in NCHW even with oneDNN, so the loop cannot
    run.)"""
    graph = tf.Graph()
    with graph.as_default():
        rng = np.random.RandomState(33)
        x = tf.compat.v1.placeholder(tf.float32, [None, 3, 7, 6], name="x")

        def weight(name, shape):
            return tf.compat.v1.get_variable(name, initializer=rng.randn(*shape).astype(
                np.float32) * 0.3)

        w, b, d, t = (weight("w", [3, 3, 3, 4]), weight("b", [4]), weight("d", [2, 2, 4, 2]),
                      weight("t", [2, 2, 5, 8]))
        h = tf.nn.bias_add(tf.nn.conv2d(x, w, 2, "SAME", data_format="NCHW"), b,
                           data_format="NCHW")                           # [B, 4, 4, 3]
        h = tf.nn.depthwise_conv2d(tf.tanh(h), d, [1, 1, 1, 1], "VALID",
                                   data_format="NCHW")                   # [B, 8, 3, 2]
        z = tf.nn.conv2d_transpose(h, t, tf.stack([tf.shape(x)[0], 5, 6, 4]), strides=2,
                                   padding="SAME", data_format="NCHW")   # [B, 5, 6, 4]
        ys = tf.reduce_sum(tf.sin(z), axis=[1, 2, 3])
        feed = {x: rng.randn(B, 3, 7, 6).astype(np.float32)}
    return graph, ys, [w, b, d, t], feed


def check_nchw():
    """NCHW convolutions against the loop (they run on the CPU with oneDNN only)."""
    graph, ys, xs, feed = _nchw_graph()
    with graph.as_default():
        _check_against_loop(graph, ys, xs, feed, "NCHW", [
            "Conv2D", "BiasAdd", "DepthwiseConv2dNative", "Conv2DBackpropInput"])


def check_bias_add_nchw():
    """BiasAdd NCHW on [B, C, H, W] and [B, C, L] (runs without oneDNN too)."""
    with tf.Graph().as_default() as graph:
        rng = np.random.RandomState(34)
        x = tf.compat.v1.placeholder(tf.float32, [None, 3, 4, 5], name="x")
        b1 = tf.compat.v1.get_variable("b1", initializer=rng.randn(3).astype(np.float32))
        b2 = tf.compat.v1.get_variable("b2", initializer=rng.randn(4).astype(np.float32))
        h = tf.nn.bias_add(x, b1, data_format="NCHW")
        z = tf.nn.bias_add(tf.reshape(tf.transpose(h, [0, 2, 1, 3]), [-1, 4, 15]), b2,
                           data_format="NCHW")
        ys = tf.reduce_sum(tf.sin(z) * tf.cos(x[:, :1, 0, :1]), axis=[1, 2])
        feed = {x: rng.randn(B, 3, 4, 5).astype(np.float32)}
        _check_against_loop(graph, ys, [b1, b2], feed, "BiasAdd NCHW", ["BiasAdd"])


# -- DP-SGD: the clipped sums of these rules ---------------------------------------------

def check_dp_step():
    """DPOptimizer (noise 0) through a transposed convolution, a dilated convolution
    (SpaceToBatchND) and a Conv3D: the rules' clipped sums against the loop's
    per-example gradients clipped in NumPy; microbatches against the loop."""
    with tf.Graph().as_default() as graph:
        rng = np.random.RandomState(35)
        x = tf.compat.v1.placeholder(tf.float32, [None, 4, 4, 2], name="x")

        def weight(name, shape):
            return tf.compat.v1.get_variable(name, initializer=rng.randn(*shape).astype(
                np.float32) * 0.4)

        t, d, c = weight("t", [3, 3, 3, 2]), weight("d", [3, 3, 3, 2]), weight("c", [2, 2, 2, 2, 2])
        h = tf.nn.conv2d_transpose(x, t, tf.stack([tf.shape(x)[0], 8, 8, 3]), 2, "SAME")
        h = tf.nn.convolution(tf.tanh(h), d, padding="SAME", dilations=2)   # [B, 8, 8, 2]
        h = tf.nn.conv3d(tf.reshape(h, [-1, 4, 4, 4, 2]), c, [1] * 5, "VALID")
        ys = tf.reduce_sum(tf.sin(h), axis=[1, 2, 3, 4])
        xs = [t, d, c]
        _assert_on_rules(ys, xs, ["Conv2DBackpropInput", "Conv2D", "Conv3D"])
        feed = {x: rng.randn(4, 4, 4, 2).astype(np.float32)}
        sess = _session(graph)
        per_example = oracle.loop_per_example_gradients(sess, ys, xs, feed)
        norms = np.sqrt(sum(np.sum(g.reshape(4, -1) ** 2, axis=1) for g in per_example))
        clip = float(np.median(norms))
        factors = clip / np.maximum(norms, clip)
        want = [np.tensordot(factors, g, axes=1) / 4 for g in per_example]
        dp = pertower.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                  l2_norm_clip=clip, noise_multiplier=0.0)
        got = sess.run([g for g, _ in dp.compute_gradients(ys, var_list=xs)], feed)
        assert (norms > clip * 1.01).any() and (norms < clip * 0.99).any()
        common.assert_all_close(got, want, what="DP gradient", kind="deep")
        micro = pertower.microbatch_gradients(ys, xs, num_microbatches=2, method="rules")
        common.assert_all_close(sess.run(micro, feed),
                                oracle.loop_microbatch_gradients(sess, ys, xs, feed, 2),
                                what="microbatch gradients", kind="deep")


# -- tests (this process: graph mode, TF2 behaviour) --------------------------------------

@pytest.mark.parametrize("check", [check_dilated, check_transposed, check_conv3d,
                                   check_bias_add_nchw])
def test_convolution_rules_match_the_loop(check):
    check()


@pytest.mark.heavy
def test_dp_step_through_convolution_rules_matches_numpy():
    check_dp_step()


def test_nchw_convolutions_are_on_the_rules():
    """The plan here (the numbers in the oneDNN process: without oneDNN TensorFlow's
    CPU convolutions refuse NCHW, so neither the rules nor the loop can run)."""
    graph, ys, xs, _ = _nchw_graph()
    with graph.as_default():
        _assert_on_rules(ys, xs, ["Conv2D", "BiasAdd", "DepthwiseConv2dNative",
                                  "Conv2DBackpropInput"])


def _blocks_analysis(between):
    """The analysis of SpaceToBatchND -> `between` -> BatchToSpaceND -> sum."""
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 6, 6, 2])
        blocks = tf.space_to_batch_nd(x, [2, 2], [[0, 0], [0, 0]])       # [4B, 3, 3, 2]
        z = tf.compat.v1.batch_to_space_nd(between(blocks), [2, 2], [[0, 0], [0, 0]])
        ys = tf.reduce_sum(z, axis=[1, 2, 3])
        analysis = _batch_axis.analyze(ys, [x], _graph_walk.upstream_ops([ys]))
        return analysis, analysis.value(blocks)


def test_space_to_batch_interleaves_each_examples_rows():
    analysis, value = _blocks_analysis(
        lambda t: tf.nn.conv2d(t, tf.ones([1, 1, 2, 2]), 1, "SAME"))
    assert value == _batch_axis.Interleaved(1, 4, 4 * 3 * 3 * 2)
    assert analysis.verdict == "independent"


@pytest.mark.parametrize("between, op_type", [
    (tf.tanh, "Tanh"),                                            # elementwise: not read
    (lambda t: tf.reduce_sum(t, 0, keepdims=True) + 0 * t, "Sum"),  # over the blocks
    (lambda t: t[::-1], "StridedSlice"),                          # reorders the rows
    (lambda t: tf.squeeze(tf.expand_dims(t, 0), [0]), "ExpandDims"),  # moves axis 0
])
def test_other_ops_on_the_blocks_lose_the_batch_axis(between, op_type):
    """Only convolutions and BatchToSpaceND read the interleaved rows; any other op
    there loses the proof at that op (the rules then fall back, never wrong)."""
    analysis, _ = _blocks_analysis(between)
    assert analysis.verdict == "unproven"
    op, reason = analysis.lost_at
    assert op.type == op_type and "SpaceToBatchND" in reason


def test_batch_to_space_on_plain_rows_loses_the_batch_axis():
    """BatchToSpaceND without a SpaceToBatchND before it puts rows of several examples
    into one row: the proof is lost there, with why."""
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 3, 3, 2])
        z = tf.compat.v1.batch_to_space_nd(x, [2, 1], [[0, 0], [0, 0]])
        ys = tf.reduce_sum(z, axis=[1, 2, 3])
        analysis = _batch_axis.analyze(ys, [x], _graph_walk.upstream_ops([ys]))
    assert analysis.verdict == "unproven"
    assert analysis.lost_at[0].type == "BatchToSpaceND"
    assert "mixes examples" in analysis.lost_at[1]


CHECKS = {"legacy": ["check_dilated", "check_transposed", "check_conv3d"],
          "onednn": ["check_nchw", "check_dilated", "check_onednn_filter_gradients"]}

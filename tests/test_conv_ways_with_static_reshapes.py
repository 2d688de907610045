"""The convolution rules' ways with static reshape targets (_convolution/geometry.py
`to_groups`, `group_target`, `split_channels`, `fold_groups` with k): every way of the
Conv2D and depthwise rules against the one-example loop, with the group count G a
tensor (no batch_size: [-1, k*P, C] targets), an int (batch_size=B) and microbatches
(M groups of T examples), on a network whose examples hold k = 2 images each (so the
rows per example enter the static targets).

One graph and session for the module; small shapes (B = 4). Heavy (it builds 15 sets of
gradients, ~1 min): the fast representatives of these ways are in test_conv_ways_at_zoo_shapes.py.
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

pytestmark = pytest.mark.heavy

B, K, SIDE = 4, 2, 6    # examples, images per example, input height and width

# (Conv2D options, depthwise options): every way each rule has, as a registry
WAYS = {
    "auto": (conv2d.ConvOptions(), conv2d.ConvOptions()),
    "shifts per tap": (conv2d.ConvOptions("shifts", few_positions=0),
                       conv2d.ConvOptions("shifts")),
    "shifts stacked": (conv2d.ConvOptions("shifts", few_positions=10 ** 6),
                       conv2d.ConvOptions("shifts")),
    "patches": (conv2d.ConvOptions("patches"), conv2d.ConvOptions("patches")),
    "depthwise": (conv2d.ConvOptions("depthwise"), conv2d.ConvOptions()),
}
if conv2d.onednn_enabled():     # TensorFlow's other CPU kernels refuse grouped convolutions
    WAYS["grouped"] = (conv2d.ConvOptions("grouped"), conv2d.ConvOptions("grouped"))


def _registry(conv_options, depthwise_options):
    registry = rules_lib.default_registry()
    registry.register("Conv2D", conv2d.Conv2DRule(conv_options))
    registry.register("DepthwiseConv2dNative",
                      depthwise_conv2d.DepthwiseConv2DRule(depthwise_options))
    return registry


@pytest.fixture(scope="module")
def network():
    """(graph, session, ys, weights, feed, {name: fetches}, loop's gradients)."""
    with tf.Graph().as_default() as graph:
        rng = np.random.default_rng(0)
        x = tf.compat.v1.placeholder(tf.float32, [None, K, SIDE, SIDE, 3], name="x")

        def weight(name, shape):
            return tf.Variable(rng.normal(0, 0.2, shape).astype("float32"), name=name)
        w_thin = weight("thin", [3, 3, 3, 8])          # Cin < thin_channels
        w_wide = weight("wide", [3, 3, 8, 8])          # Cin = thin_channels
        w_one = weight("one", [1, 1, 8, 8])            # a 1x1 filter
        w_depth = weight("depth", [3, 3, 8, 2])        # depthwise, multiplier 2
        w_out = weight("out", [K * 4 * 4 * 16, 3])
        h = tf.reshape(x, [-1, SIDE, SIDE, 3])         # [B*K, H, W, 3]: k = 2 rows each
        h = tf.nn.relu(tf.nn.conv2d(h, w_thin, 1, "SAME"))
        h = tf.nn.relu(tf.nn.conv2d(h, w_wide, 1, "SAME"))
        h = tf.nn.relu(tf.nn.conv2d(h, w_one, 1, "VALID"))
        h = tf.nn.depthwise_conv2d(h, w_depth, [1, 1, 1, 1], "VALID")   # [B*K, 4, 4, 16]
        ys = tf.reduce_sum(tf.square(tf.matmul(tf.reshape(h, [-1, K * 4 * 4 * 16]),
                                               w_out)), axis=1)         # [B]
        weights = [w_thin, w_wide, w_one, w_depth, w_out]
        fetches = {}
        for name, options in WAYS.items():
            registry = _registry(*options)
            fetches[name, "B tensor"] = pertower.per_example_gradients(
                ys, weights, method="rules", rules=registry)
            fetches[name, "B int"] = pertower.per_example_gradients(
                ys, weights, batch_size=B, method="rules", rules=registry)
            fetches[name, "microbatches"] = pertower.microbatch_gradients(
                ys, weights, num_microbatches=2, method="rules", rules=registry)
        sess = tf.compat.v1.Session(graph=graph)
        sess.run(tf.compat.v1.global_variables_initializer())
        feed = {x: rng.normal(size=(B, K, SIDE, SIDE, 3)).astype("float32")}
        want = oracle.loop_per_example_gradients(sess, ys, weights, feed)
        yield graph, sess, fetches, feed, want
        sess.close()


@pytest.mark.parametrize("how", ["B tensor", "B int", "microbatches"])
@pytest.mark.parametrize("way", list(WAYS))
def test_conv_ways_match_the_loop(network, way, how):
    _, sess, fetches, feed, want = network
    got = sess.run(fetches[way, how], feed)
    if how == "microbatches":   # 2 groups of 2 examples: the loop's sums per group
        want = [w.reshape((2, B // 2) + w.shape[1:]).sum(axis=1) for w in want]
    assert all(np.abs(w).max() > 0 for w in want), "a weight has zero gradients"
    common.assert_all_close(got, want, what=f"{way}, {how}", kind="deep")


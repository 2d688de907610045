"""The convolution rules' choice of way from the shapes (`rules/conv2d.py`,
`rules/depthwise_conv2d.py`) and the live taps of a filter larger than its map
(`_convolution/geometry.py`), against the one-example loop `pertower.oracle`: a 5x5
depthwise filter on a 2x2 map, 7x7 on 1x1, 3x3 on 1x1, a Conv2D kernel larger than its
map (SAME and explicit padding, strided), under "auto" and under each way forced;
where "auto" takes the per-example kernel calls ("examples").
"""

import types

import numpy as np
import pytest
import tensorflow as tf

import pertower
from pertower import oracle
from pertower import rules as rules_lib
from pertower._convolution import geometry
from pertower.rules import conv2d
from pertower.rules import depthwise_conv2d
from pertower.rules import registry as registry_lib
from tests import common

B = 3

# (kind, H, k, C (Cin = Cout), stride, padding)
LAYERS = [
    ("depthwise", 2, 5, 6, 1, "SAME"),
    ("depthwise", 1, 7, 4, 1, "SAME"),
    ("depthwise", 1, 3, 5, 1, "SAME"),
    ("depthwise", 4, 5, 3, 2, "SAME"),
    ("depthwise", 6, 3, 4, 1, "SAME"),      # every tap lives
    ("conv2d", 2, 5, 4, 1, "SAME"),
    ("conv2d", 1, 3, 8, 1, "SAME"),
    ("conv2d", 3, 5, 3, 2, "SAME"),
    ("conv2d", 2, 5, 4, 1, [[0, 0], [3, 1], [2, 2], [0, 0]]),
    ("depthwise", 6, 5, 96, 1, "SAME"),     # "auto": "examples" on both settings
    ("conv2d", 8, 3, 8, 1, "SAME"),         # "auto": "examples" without oneDNN
]
WAYS = {"depthwise": ("auto", "grouped", "patches", "examples"),
        "conv2d": ("auto", "shifts", "patches", "grouped", "examples")}


def _layer(kind, H, k, C, stride, padding):
    """(graph, x, w, ys) of one layer, ys [B] the per-example sum of squares."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, H, H, C])
        init = tf.random.normal([k, k, C, 1 if kind == "depthwise" else C], seed=3)
        w = tf.Variable(init)
        if kind == "depthwise":
            z = tf.nn.depthwise_conv2d(x, w, [1, stride, stride, 1], padding)
        else:
            z = tf.nn.conv2d(x, w, stride, padding)
        ys = tf.reduce_sum(tf.tanh(z) ** 2, axis=[1, 2, 3])
    return graph, x, w, ys


def _registry(kind, way):
    registry = rules_lib.default_registry()
    options = conv2d.ConvOptions(strategy=way)
    if kind == "depthwise":
        registry.register("DepthwiseConv2dNative", depthwise_conv2d.DepthwiseConv2DRule(options))
    else:
        registry.register("Conv2D", conv2d.Conv2DRule(options))
    return registry


@pytest.mark.parametrize("layer", LAYERS, ids=lambda l: "-".join(map(str, l[:5])))
def test_every_way_of_a_filter_larger_than_its_map_matches_the_loop(layer):
    graph, x, w, ys = _layer(*layer)
    feed = {x: np.random.RandomState(0).normal(size=[B] + x.shape.as_list()[1:])}
    with graph.as_default():
        got = {}
        for way in WAYS[layer[0]]:
            try:
                got[way] = pertower.per_example_gradients(ys, [w], method="rules",
                                                          rules=_registry(layer[0], way))[0]
            except ValueError as refusal:     # (grouped: needs oneDNN, or float32)
                assert way == "grouped" and "forced strategy" in str(refusal), refusal
        assert "auto" in got and "patches" in got
        sess = tf.compat.v1.Session()
        sess.run(tf.compat.v1.global_variables_initializer())
        want = oracle.loop_per_example_gradients(sess, ys, [w], feed)[0]
        values = sess.run(got, feed)
    for way, value in values.items():
        common.assert_all_close(value, want, what=f"{layer}, way {way}")


def test_the_live_taps_of_a_filter_larger_than_its_map():
    """5x5 SAME on 2x2: taps 1 ... 3 read the input (pad 2 before: rows u - 2 + i);
    on 1x1 only the centre; 3x3 on 6x6: every tap (None); stride 2 on 4x4 (pad 1
    before, outputs 0 and 1: rows u - 1 and u + 1): taps 0 ... 4 but 4 reads row 4 - 1
    = 3 only, so all live."""
    cases = [((2, 5), [(1, 4), (1, 4)]), ((1, 5), [(2, 3), (2, 3)]), ((6, 3), None),
             ((4, 5, 2), None)]
    for sizes, want in cases:
        H, k = sizes[:2]
        stride = sizes[2] if len(sizes) > 2 else 1
        with tf.Graph().as_default():
            x = tf.compat.v1.placeholder(tf.float32, [None, H, H, 2])
            z = tf.nn.conv2d(x, tf.zeros([k, k, 2, 3]), stride, "SAME")
            assert geometry.live_range(z.op, [k, k]) == want, sizes


def test_grouped_depthwise_in_chunks_of_channels_matches_the_loop(monkeypatch):
    """"grouped" with CHUNK_FLOATS small enough for one call per 1, 2 or 3 channels
    (uneven chunks: 7 channels), fixed and run-time batch sizes, against the loop (the
    chunks are oneDNN's: `onednn=True` takes them on either setting)."""
    graph, x, w, ys = _layer("depthwise", 5, 3, 7, 1, "SAME")
    feed = {x: np.random.RandomState(1).normal(size=[B, 5, 5, 7])}
    registry = rules_lib.default_registry()
    registry.register("DepthwiseConv2dNative", depthwise_conv2d.DepthwiseConv2DRule(
        conv2d.ConvOptions(strategy="grouped", onednn=True)))
    with graph.as_default():
        sess = tf.compat.v1.Session()
        sess.run(tf.compat.v1.global_variables_initializer())
        want = oracle.loop_per_example_gradients(sess, ys, [w], feed)[0]
        for floats in (9 * B, 2 * 9 * B, 3 * 9 * 32):
            monkeypatch.setattr(depthwise_conv2d, "CHUNK_FLOATS", floats)
            for batch_size in (B, None):
                try:
                    got = pertower.per_example_gradients(ys, [w], batch_size=batch_size,
                                                         method="rules", rules=registry)[0]
                except ValueError as refusal:
                    assert "forced strategy" in str(refusal), refusal
                    return
                common.assert_all_close(sess.run(got, feed), want,
                                        what=f"chunks of {floats}, batch_size {batch_size}")


@pytest.mark.parametrize("onednn", [False, True])
def test_auto_takes_examples_where_the_rule_says(onednn):
    """`ways.per_example_calls_pay`: depthwise 5x5 filters of 96 channels (K*C = 2400 >=
    EXAMPLE_FLOATS) on both settings, of 16 channels without oneDNN only, 3x3 never;
    Conv2D 3x3 of 8 input channels without oneDNN only, from 8x8 outputs (64 positions)."""
    cases = [("depthwise", 16, 5, 96, True), ("depthwise", 16, 5, 16, not onednn),
             ("depthwise", 16, 3, 96, False), ("conv2d", 8, 3, 8, not onednn),
             ("conv2d", 4, 3, 8, False), ("conv2d", 8, 3, 4, False), ("conv2d", 8, 1, 8, False)]
    rule = conv2d.ConvolutionRule(conv2d.ConvOptions(onednn=onednn))
    for kind, H, k, C, want in cases:
        graph, _, w, ys = _layer(kind, H, k, C, 1, "SAME")
        op = graph.get_operations()[-1]
        while op.type not in ("Conv2D", "DepthwiseConv2dNative"):
            op = op.inputs[0].op
        use = registry_lib.Use(op, 1, rule, op.inputs[0], op.outputs[0], w.shape,
                               types.SimpleNamespace(k=1))
        got = rule.strategy(use)
        assert (got == "examples") == want, (kind, H, k, C, onednn, got)
        if kind == "depthwise":   # a forced way is kept
            forced = conv2d.ConvolutionRule(conv2d.ConvOptions("grouped", onednn=onednn))
            assert forced.strategy(use) in ("grouped", "patches"), (kind, H, k, C, onednn)

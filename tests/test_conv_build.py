"""The Conv2D rule's thin taps (`_convolution/ways.py` `by_thin_taps`, the "thin" layout
of "shifts": Cin < thin_channels) against the one-example loop (`pertower.oracle`), and
the ops they build: one gather of the row taps and kw column slices (column stride 1)
or one more gather (column stride > 1), never one slice per tap. Same filter sizes, strides,
paddings (SAME, VALID, explicit), several rows per example, float64, and a group of
several examples (a microbatch: G an int, T > 1). One module graph, B = 3. At the end,
what a build shares (`costs`): one constant per value (the backward pass's forward forms
included), no empty Pad, one Slice per stride-1 tap, the depthwise filter sizes.
"""

import collections

import numpy as np
import pytest
import tensorflow as tf

import pertower
from pertower import _dispatch
from pertower import oracle
from pertower._convolution import ways as _conv_ways
from pertower._layout import _shapes
from pertower.rules import conv2d
from pertower.rules import depthwise_conv2d
from tests import common

B = 3
OPTIONS = conv2d.ConvOptions()

# name -> (input [H, W, Cin], rows per example k, filter [kh, kw, Cin, Cout], conv
#          keywords, dtype)
LAYERS = collections.OrderedDict([
    ("same_5x5", ((7, 7, 1), 1, (5, 5, 1, 4), dict(strides=1, padding="SAME"), tf.float32)),
    ("valid_7x7_stride2", ((11, 10, 3), 1, (7, 7, 3, 5), dict(strides=2, padding="VALID"),
                           tf.float32)),
    ("explicit_rows_stride", ((6, 5, 2), 1, (3, 2, 2, 3),
                              dict(strides=[1, 2, 1, 1],
                                   padding=[[0, 0], [1, 0], [2, 1], [0, 0]]), tf.float32)),
    ("columns_stride_two_rows", ((6, 7, 3), 2, (2, 3, 3, 4),
                                 dict(strides=[1, 1, 2, 1], padding="SAME"), tf.float32)),
    ("same_float64", ((5, 6, 2), 1, (3, 3, 2, 3), dict(strides=1, padding="SAME"),
                      tf.float64)),
])


@pytest.fixture(scope="module")
def convs():
    graph = tf.Graph()
    with graph.as_default():
        rng = np.random.default_rng(0)
        feed, xs, losses = {}, [], []
        for name, (shape, k, filt, keywords, dtype) in LAYERS.items():
            x = tf.compat.v1.placeholder(dtype, [None, k] + list(shape), name=name)
            feed[x] = rng.normal(size=(B, k) + shape).astype(dtype.as_numpy_dtype)
            w = tf.Variable(rng.normal(size=filt).astype(dtype.as_numpy_dtype) / 3,
                            name=f"w_{name}")
            z = tf.nn.conv2d(tf.reshape(x, [-1] + list(shape)), w, **keywords)
            z = tf.reshape(tf.tanh(z), [-1, k * int(np.prod(z.shape[1:]))])    # [B, k*...]
            xs.append(w)
            losses.append(tf.cast(tf.reduce_sum(z * z * 0.5 + z, axis=1), tf.float64))
        ys = tf.add_n(losses)                                                    # [B]
        plan = _dispatch.make_plan(ys, xs, validate=False)
        sess = tf.compat.v1.Session(graph=graph)
        sess.run(tf.compat.v1.global_variables_initializer())
    yield graph, sess, feed, ys, xs, plan
    sess.close()


def _uses(plan):
    return [use for uses in plan.uses for use in uses or () if use.op.type == "Conv2D"]


def test_thin_taps_match_the_loop(convs):
    graph, sess, feed, ys, xs, plan = convs
    with graph.as_default():
        assert not plan.fallback, plan.reasons
        uses = _uses(plan)
        assert [_conv_ways.tap_layout(OPTIONS, use) for use in uses] == ["thin"] * len(LAYERS)
        assert [use.rows.k for use in uses] == [layer[1] for layer in LAYERS.values()]
        assert [use.rule.strategy(use) for use in uses] == ["shifts"] * len(LAYERS)
        grads = pertower.per_example_gradients(ys, xs, method="rules")
        # one group of all B examples (G = 1, T = B*k images): the batch gradient
        whole = [_conv_ways.by_shifts(OPTIONS, use, tf.gradients(ys, use.output)[0], 1)
                 for use in uses]
        got, got_whole = sess.run([grads, whole], feed)
        want = oracle.loop_per_example_gradients(sess, ys, xs, feed)
    common.assert_all_close(got, want, what="thin taps: per-example gradients", kind="deep")
    common.assert_all_close([g[0] for g in got_whole], [w.sum(axis=0) for w in want],
                            what="thin taps: one group of the whole batch", kind="deep")
    assert all(np.abs(g).max() > 0 for g in want)


def test_thin_taps_build_no_slice_per_tap(convs):
    """Per use: ONE gather of the row taps; with a column stride of 1, kw column slices
    and one stack; with a column stride > 1, a second gather and no slice; one
    contraction; ops other than Const at most 13 + kw (15 strided), whatever kh*kw."""
    graph, _, _, _, _, plan = convs
    with graph.as_default():
        for use in _uses(plan):
            dZ = tf.compat.v1.placeholder(use.output.dtype, use.output.shape)
            G = tf.shape(dZ)[0] // use.rows.k
            before = len(graph.get_operations())
            grad = _conv_ways.by_shifts(OPTIONS, use, dZ, G)
            built = collections.Counter(op.type for op in graph.get_operations()[before:])
            assert grad.shape.as_list()[1:] == use.weight_shape.as_list()
            kw = use.weight_shape.as_list()[1]
            column_stride = use.op.get_attr("strides")[2]
            gathers = 1 if column_stride == 1 else 2
            slices = kw if column_stride == 1 else 0
            assert built["GatherV2"] == gathers, built
            # (padded_input uncropped: the taps stop before what a crop would drop)
            assert built["Slice"] + built["StridedSlice"] == slices, built
            assert built["Pad"] <= 1, built
            assert built["Pack"] == (1 if column_stride == 1 else 0), built
            assert built["BatchMatMulV2"] + built["Einsum"] == 1, built
            assert not built["ConcatV2"] + built["ExtractImagePatches"], built
            others = sum(n for op_type, n in built.items() if op_type != "Const")
            # Pad and crop, the input's transpose, rows gathered, (kw slices and a stack |
            # transpose, gather, dZ's transpose), 2 reshapes and a matmul, (several images
            # per group: a reshape and a sum), (Cin > 1: a reshape and a transpose), the
            # reshape to [G, kh, kw, Cin, Cout]
            assert others <= (13 + kw if column_stride == 1 else 15), built


# --- build cost: shared constants, no empty pad, one Slice per stride-1 tap ---
# x [B, 24, 24, 8] -> 3x3 SAME 8->8 (576 positions: one Slice per tap) -> 1x1 stride 2
# VALID 8->96 (24 -> 12: reads 23 rows, the 24th cropped: no Pad) -> two 3x3 SAME
# 96->96 (their input gradients are forward convolutions with oneDNN off: one filter
# turn constant for both) -> 3x3 depthwise (grouped: filter sizes one Pack) -> dense.
SHAPES = {"w_taps": (3, 3, 8, 8), "w_strided": (1, 1, 8, 96), "w_fwd1": (3, 3, 96, 96),
          "w_fwd2": (3, 3, 96, 96), "w_depth": (3, 3, 96, 1), "w_dense": (96, 10)}


@pytest.fixture(scope="module")
def costs():
    graph = tf.Graph()
    with graph.as_default():
        rng = np.random.default_rng(1)
        x = tf.compat.v1.placeholder(tf.float32, [None, 24, 24, 8], name="x")
        labels = tf.compat.v1.placeholder(tf.int32, [None], name="labels")
        feed = {x: rng.normal(size=(B, 24, 24, 8)).astype(np.float32),
                labels: np.arange(B) % 10}
        w = {name: tf.Variable((rng.normal(size=shape) / np.sqrt(np.prod(shape[:-1])))
                               .astype(np.float32), name=name)
             for name, shape in SHAPES.items()}
        h = tf.nn.relu(tf.nn.conv2d(x, w["w_taps"], 1, "SAME"))
        h = tf.nn.conv2d(h, w["w_strided"], 2, "VALID")                    # [B, 12, 12, 96]
        h = tf.nn.relu(tf.nn.conv2d(h, w["w_fwd1"], 1, "SAME"))
        h = tf.nn.relu(tf.nn.conv2d(h, w["w_fwd2"], 1, "SAME"))
        h = tf.nn.depthwise_conv2d(h, w["w_depth"], [1, 1, 1, 1], "SAME")
        logits = tf.matmul(tf.reduce_mean(h, [1, 2]), w["w_dense"])
        ys = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
        xs = list(w.values())
        registry = pertower.rules.default_registry()
        registry.register("Conv2D", conv2d.Conv2DRule(conv2d.ConvOptions(   # ("auto" takes
            strategy="shifts", onednn=False)))                       # "examples" here)
        before = len(graph.get_operations())
        grads = pertower.per_example_gradients(ys, xs, rules=registry, method="rules")
        built = graph.get_operations()[before:]
        sess = tf.compat.v1.Session(graph=graph)
        sess.run(tf.compat.v1.global_variables_initializer())
    yield graph, sess, feed, ys, xs, grads, built
    sess.close()


def _constant_values(ops):
    return [(op.get_attr("dtype"), tf.make_ndarray(op.get_attr("value")).tolist())
            for op in ops if op.type == "Const"]


def test_build_cost_paths_match_the_loop(costs):
    graph, sess, feed, ys, xs, grads, _ = costs
    with graph.as_default():
        got = sess.run(grads, feed)
        want = oracle.loop_per_example_gradients(sess, ys, xs, feed)
    common.assert_all_close(got, want, what="build cost paths: per-example gradients",
                            kind="deep")
    assert all(np.abs(g).max() > 0 for g in want)


def test_build_shares_constants_and_builds_no_empty_pad(costs):
    """The two forward forms share one filter-turn permutation (and reverse axes); the
    rules' own constants are each built once; no Pad pads nothing (the strided 1x1
    convolution only crops, and its tap's slice stops before the cropped row); the 3x3
    stride-1 taps are 9 Slices sharing one size constant."""
    _, _, _, _, _, _, built = costs
    types = collections.Counter(op.type for op in built)
    values = _constant_values(built)
    assert types["ReverseV2"] == 2, types                   # the two forward forms
    assert values.count((tf.int32, [0, 1, 3, 2])) == 1, types
    assert values.count((tf.int32, [0, 1])) == 1, types
    rules_scope = "per_example_gradients/gradients"         # the rules' ops (the backward
    own = _constant_values([op for op in built                # pass is in .../gradients)
                            if op.name.rsplit("/", 1)[0] == rules_scope])
    assert len(own) >= 10
    repeated = [v for v, n in collections.Counter(map(repr, own)).items() if n > 1]
    assert not repeated, repeated
    pads = [op for op in built if op.type == "Pad"]
    assert len(pads) == 1, types                             # the 3x3 SAME taps' only
    assert all(np.any(tf.make_ndarray(p.inputs[1].op.get_attr("value"))) for p in pads)
    assert types["Slice"] == 9, types
    assert values.count((tf.int32, [-1, 24, 24, -1])) == 1, types


def test_depthwise_filter_sizes_are_one_pack(costs):
    """The grouped depthwise way, per chunk of channels (`CHUNK_FLOATS`, G taken as
    `GUESSED_G` when it is a tensor): two folds (a transpose and a reshape each), the
    filter sizes as ONE Pack (of G*c and constants), a Mul, the kernel and a reshape;
    the chunks split (x and dZ) and concatenated once, one transpose: at most 8 ops
    other than Const per chunk and 4 more, whatever the filter's size."""
    graph, _, _, ys, xs, _, _ = costs
    with graph.as_default():
        plan = _dispatch.make_plan(ys, xs, validate=False)
        (use,) = [u for uses in plan.uses for u in uses or ()
                  if u.op.type == "DepthwiseConv2dNative"]
        dZ = tf.compat.v1.placeholder(use.output.dtype, use.output.shape)
        G = tf.shape(dZ)[0]
        assert use.rule.strategy(use, G) == "grouped"
        before = len(graph.get_operations())
        with _shapes.ShapeCache(G).active():                  # as in a build
            grad = use.rule.per_group(use, dZ, G)
        new_ops = graph.get_operations()[before:]
        types = collections.Counter(op.type for op in new_ops)
    assert grad.shape.as_list()[1:] == use.weight_shape.as_list()
    kh, kw, c_in, mult = use.weight_shape.as_list()
    per_call = depthwise_conv2d.CHUNK_FLOATS // (kh * kw * mult * depthwise_conv2d.GUESSED_G)
    chunks = -(-c_in // per_call) if conv2d.onednn_enabled() else 1   # (oneDNN only)
    assert chunks > 1 or not conv2d.onednn_enabled()
    assert types["Pack"] == chunks == types["DepthwiseConv2dNativeBackpropFilter"], types
    for pack in [op for op in new_ops if op.type == "Pack"]:   # [kh, kw, G*c, M]
        sizes = [i.op for i in pack.inputs if i.op.type == "Const"]
        assert len(sizes) == 3 and len({op.name for op in sizes}) == 2   # kh = kw = 3 shared
    assert sum(n for t, n in types.items() if t != "Const") <= 8 * chunks + 4, types

"""The Conv2D rule's thin taps (`rules/_conv_taps.py`, the "thin" layout of "shifts":
Cin < thin_channels) against the one-example loop (`pertower.oracle`), and the ops they
build: one gather of the row taps and kw column slices (column stride 1) or one more
gather (column stride > 1), never one slice per tap. Same filter sizes, strides,
paddings (SAME, VALID, explicit), several rows per example, float64, and a group of
several examples (a microbatch: G an int, T > 1). One module graph, B = 3.
"""

import collections

import numpy as np
import pytest
import tensorflow as tf

import pertower
from pertower import _dispatch
from pertower import oracle
from pertower.rules import _conv_ways
from pertower.rules import conv2d
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

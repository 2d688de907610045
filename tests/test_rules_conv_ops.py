"""What the Conv2D rule's "shifts" builds per use (`_convolution/ways.py`): the taps
side by side (one ExtractImagePatches and one matmul straight into [B, kh, kw, Cin,
Cout]) where the per-tap results would be larger than the taps (T*P < Cout) or the
positions few, one matmul per tap elsewhere, a strided 1x1 filter's input subsampled by
one ExtractImagePatches (no strided slice); each layout against the one-example loop
(`pertower.oracle`), with several rows per example, strides and explicit padding
(dilated Conv2D does not run on TensorFlow's CPU kernels without oneDNN). One module
graph, B = 3.
"""

import collections

import numpy as np
import pytest
import tensorflow as tf

import pertower
from pertower import _dispatch
from pertower import oracle
from pertower import rules as rules_lib
from pertower._convolution import ways as _conv_ways
from pertower.rules import conv2d
from tests import common

B = 3
# few_positions=4: only T*P < Cout (not "few positions") sends these 4x4 inputs (P = 16)
# to the side-by-side layout
OPTIONS = conv2d.ConvOptions(few_positions=4)

# name -> (input [H, W, Cin], rows per example k, filter [kh, kw, Cin, Cout], conv keywords,
#          tap_layout)
LAYERS = collections.OrderedDict([
    ("same", ((4, 4, 8), 1, (3, 3, 8, 32), dict(strides=1, padding="SAME"), "channels")),
    ("strided_valid", ((5, 5, 8), 1, (3, 3, 8, 16), dict(strides=2, padding="VALID"),
                       "channels")),
    ("strided_explicit", ((5, 4, 8), 1, (2, 3, 8, 24),
                          dict(strides=[1, 2, 1, 1], padding=[[0, 0], [1, 0], [2, 1], [0, 0]]),
                          "channels")),
    ("two_rows", ((4, 4, 8), 2, (3, 3, 8, 40), dict(strides=1, padding="SAME"), "channels")),
    ("per_tap", ((4, 4, 8), 1, (3, 3, 8, 12), dict(strides=1, padding="SAME"), "per_tap")),
    ("per_tap_two_rows", ((4, 4, 8), 2, (3, 3, 8, 24), dict(strides=1, padding="SAME"),
                          "per_tap")),
    ("one_strided", ((5, 5, 8), 1, (1, 1, 8, 16), dict(strides=2, padding="SAME"), "one")),
    ("one_strided_two_rows", ((6, 5, 8), 2, (1, 1, 8, 16),
                              dict(strides=[1, 3, 2, 1], padding="VALID"), "one")),
])


@pytest.fixture(scope="module")
def convs():
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(0)
        rng = np.random.default_rng(0)
        feed, xs, losses = {}, [], []
        for name, (shape, k, filt, keywords, _) in LAYERS.items():
            x = tf.compat.v1.placeholder(tf.float32, [None, k] + list(shape), name=name)
            feed[x] = rng.normal(size=(B, k) + shape).astype(np.float32)
            w = tf.Variable(rng.normal(size=filt).astype(np.float32) / 4, name=f"w_{name}")
            z = tf.nn.conv2d(tf.reshape(x, [-1] + list(shape)), w, **keywords)
            z = tf.reshape(tf.tanh(z), [-1, k * int(np.prod(z.shape[1:]))])    # [B, k*...]
            xs.append(w)
            losses.append(tf.reduce_sum(z * z * 0.5 + z, axis=1))
        ys = tf.add_n(losses)                                                    # [B]
        registry = rules_lib.default_registry()
        registry.register("Conv2D", conv2d.Conv2DRule(OPTIONS))
        plan = _dispatch.make_plan(ys, xs, rules=registry, validate=False)
        sess = tf.compat.v1.Session(graph=graph)
        sess.run(tf.compat.v1.global_variables_initializer())
    yield graph, sess, feed, ys, xs, registry, plan
    sess.close()


def _uses(plan):
    return [use for uses in plan.uses for use in uses or () if use.op.type == "Conv2D"]


def test_each_layout_matches_the_loop(convs):
    graph, sess, feed, ys, xs, registry, plan = convs
    with graph.as_default():
        assert not plan.fallback, plan.reasons
        layouts = [_conv_ways.tap_layout(OPTIONS, use) for use in _uses(plan)]
        assert layouts == [layer[-1] for layer in LAYERS.values()], layouts
        assert [use.rows.k for use in _uses(plan)] == [layer[1] for layer in LAYERS.values()]
        grads = pertower.per_example_gradients(ys, xs, method="rules", rules=registry)
        norms = pertower.per_example_norms(ys, xs, method="rules", rules=registry)
        got, got_norms = sess.run([grads, norms], feed)
        want = oracle.loop_per_example_gradients(sess, ys, xs, feed)
    common.assert_all_close(got, want, what="conv layouts: per-example gradients",
                            kind="deep")
    want_norms = np.sqrt(sum(np.sum(g.reshape(B, -1) ** 2, axis=1) for g in want))
    common.assert_all_close([got_norms], [want_norms], what="conv layouts: norms",
                            kind="deep")
    assert all(np.abs(g).max() > 0 for g in want)


def test_side_by_side_taps_are_one_patches_op_and_one_matmul(convs):
    """The side-by-side layout (and a strided 1x1 filter) builds no slice, concat or
    stack: one ExtractImagePatches (a Pad before it for explicit padding), one
    contraction, and
    reshapes (only the result's with one image per example: Einsum on the [B, Ho, Wo,
    C] tensors); one matmul per tap builds kh*kw contractions and one stack."""
    graph, _, _, _, _, _, plan = convs
    with graph.as_default():
        for use in _uses(plan):
            G = tf.shape(use.activation)[0] // use.rows.k
            dZ = tf.compat.v1.placeholder(tf.float32, use.output.shape)
            before = len(graph.get_operations())
            grad = _conv_ways.by_shifts(OPTIONS, use, dZ, G)
            built = collections.Counter(op.type for op in graph.get_operations()[before:])
            assert grad.shape.as_list()[1:] == use.weight_shape.as_list()
            kh, kw = use.weight_shape.as_list()[:2]
            contractions = built["BatchMatMulV2"] + built["Einsum"]
            if _conv_ways.tap_layout(OPTIONS, use) in ("channels", "one"):
                assert built["ExtractImagePatches"] == 1 and contractions == 1, built
                assert not built["StridedSlice"] + built["ConcatV2"] + built["Pack"], built
            else:
                assert contractions == kh * kw and built["Pack"] == 1, built
                assert not built["ExtractImagePatches"], built
            if use.rows.k == 1:   # the taps and dZ enter their Einsum as they are
                assert built["Reshape"] == 1, built       # (the result's only)

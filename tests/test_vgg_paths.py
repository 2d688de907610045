"""The paths VGG16's per-example gradients take (issue 20), each against the one-example
loop (`pertower.oracle`), with the ops each builds bounded by formulas:

- dense layers (`rules/matmul.py` `outer_products`): with one row per example, an
  outer product whose last axis has at least `MUL_MIN_COLUMNS` entries is ONE broadcast
  Mul ([B, d, 1] * [B, 1, n]), a shorter one ONE Einsum, either side of transpose_b;
- 3x3 convolutions with the default `few_positions` (None): below
  `_conv_ways.FEW_POSITIONS` output positions per image the taps side by side
  ("channels": one ExtractImagePatches, one contraction), at or above it one matmul
  per tap; the formed norms (`Conv2DRule.formed_norms`) take one matmul over the
  joined taps at every size.

One module graph and session; B = 3, small shapes.
"""

import collections

import numpy as np
import pytest
import tensorflow as tf

import pertower
from pertower import _dispatch
from pertower import oracle
from pertower._convolution import ways as _conv_ways
from pertower.rules import _input_gradients
from pertower.rules import conv2d
from pertower.rules import matmul
from tests import common

B = 3
LONG = matmul.MUL_MIN_COLUMNS          # the shortest last axis that takes the Mul
# dense weights: name -> (shape, transpose_b, whether the per-example product is a Mul)
DENSE = {"long": ([4, LONG], False, True),            # [B, 4, LONG]
         "short": ([LONG, 5], False, False),          # [B, LONG, 5]
         "long_t": ([2, 5], True, False),             # W^T: [B, 2, 5]
         "wide_t": ([3, LONG + 1], True, True)}       # W^T on [B, LONG+1]: [B, 3, LONG+1]
# convolutions: name -> (input side, Cin, Cout, the per-example layout)
SIDE_BIG = 23                          # P = 529 >= FEW_POSITIONS (512)
CONVS = {"few": (8, 8, 8, "channels"),
         "many": (SIDE_BIG, 8, 4, "per_tap")}


@pytest.fixture(scope="module")
def built():
    """(graph, session, feed, ys, {name: weight}, plan)."""
    with tf.Graph().as_default() as graph:
        rng = np.random.default_rng(20)
        feed, losses, weights = {}, [], {}

        def weight(name, shape, scale):
            weights[name] = tf.Variable(rng.normal(0, scale, shape).astype("float32"),
                                        name=name)
            return weights[name]
        a = tf.compat.v1.placeholder(tf.float32, [None, 4], name="a")
        feed[a] = rng.normal(size=[B, 4]).astype("float32")
        h = tf.tanh(tf.matmul(a, weight("long", DENSE["long"][0], 0.5)))          # [B, LONG]
        h = tf.tanh(tf.matmul(h, weight("short", DENSE["short"][0], 0.05)))       # [B, 5]
        h = tf.tanh(tf.matmul(h, weight("long_t", DENSE["long_t"][0], 0.5),
                              transpose_b=True))                                   # [B, 2]
        losses.append(tf.reduce_sum(h ** 2, axis=1))
        wide = tf.compat.v1.placeholder(tf.float32, [None, LONG + 1], name="wide")
        feed[wide] = rng.normal(size=[B, LONG + 1]).astype("float32")
        z = tf.matmul(wide, weight("wide_t", DENSE["wide_t"][0], 0.05), transpose_b=True)
        losses.append(tf.reduce_sum(tf.sin(z), axis=1))
        for name, (side, c_in, c_out, _) in CONVS.items():
            x = tf.compat.v1.placeholder(tf.float32, [None, side, side, c_in], name=name + "_x")
            feed[x] = rng.normal(size=[B, side, side, c_in]).astype("float32")
            y = tf.nn.conv2d(x, weight(name, [3, 3, c_in, c_out], 0.2), 1, "SAME")
            losses.append(tf.reduce_mean(tf.tanh(y) ** 2, axis=[1, 2, 3]))
        ys = tf.add_n(losses)                                                      # [B]
        plan = _dispatch.make_plan(ys, list(weights.values()), validate=False)
        sess = tf.compat.v1.Session(graph=graph)
        sess.run(tf.compat.v1.global_variables_initializer())
    yield graph, sess, feed, ys, weights, plan
    sess.close()


def _uses(plan, op_type):
    return [use for uses in plan.uses for use in uses or () if use.op.type == op_type]


def _built_ops(graph, build):
    """(build()'s value, Counter of the op types it added to `graph`)."""
    before = len(graph.get_operations())
    value = build()
    return value, collections.Counter(op.type for op in graph.get_operations()[before:])


def test_paths_match_the_loop(built):
    graph, sess, feed, ys, weights, plan = built
    with graph.as_default():
        assert not plan.fallback, plan.reasons
        xs = list(weights.values())
        grads = pertower.per_example_gradients(ys, xs, method="rules")
        norms = pertower.per_example_norms(ys, xs, method="rules")
        got, got_norms = sess.run([grads, norms], feed)
        want = oracle.loop_per_example_gradients(sess, ys, xs, feed)
    assert all(np.abs(w).max() > 0 for w in want)
    common.assert_all_close(got, want, what="VGG paths: per-example gradients", kind="deep")
    want_norms = np.sqrt(sum(np.sum(w.reshape(B, -1) ** 2, axis=1) for w in want))
    common.assert_all_close([got_norms], [want_norms], what="VGG paths: norms", kind="deep")


def test_dense_outer_products_are_one_op(built):
    """Per MatMul use: ONE Mul (and two ExpandDims) for a long last axis, else ONE
    Einsum; no BatchMatMul, no transpose, the result [B, *W.shape]."""
    graph, _, _, _, weights, plan = built
    uses = _uses(plan, "MatMul")
    assert len(uses) == len(DENSE)
    with graph.as_default():
        for use in uses:
            name = _weight_name(use, weights)
            shape, transposed, is_mul = DENSE[name]
            assert bool(use.op.get_attr("transpose_b")) == transposed
            dZ = tf.compat.v1.placeholder(tf.float32, use.output.shape)
            grad, ops = _built_ops(graph, lambda: use.rule.per_group(use, dZ, tf.shape(dZ)[0]))
            assert grad.shape.as_list() == [None] + shape, (name, grad.shape)
            if is_mul:
                assert (ops["Mul"], ops["ExpandDims"], ops["Einsum"]) == (1, 2, 0), ops
            else:
                assert (ops["Einsum"], ops["Mul"]) == (1, 0), ops
            assert not ops["BatchMatMulV2"] + ops["Transpose"], ops


def _weight_name(use, weights):
    """The name in `weights` of the variable `use`'s weight input reads."""
    handle = use.op.inputs[1]
    while handle.op.type not in ("VarHandleOp", "VariableV2"):
        handle = handle.op.inputs[0]
    return next(name for name, w in weights.items() if w.handle is handle)


def test_conv_layouts_follow_the_positions(built):
    """Below FEW_POSITIONS positions per image: one ExtractImagePatches and one
    contraction, nothing stacked; at or above it kh*kw contractions and one stack; the
    formed norms are built at both sizes."""
    graph, _, _, _, weights, plan = built
    options = conv2d.ConvOptions()
    assert options.few_positions is None
    assert 8 * 8 < _conv_ways.FEW_POSITIONS <= SIDE_BIG ** 2
    uses = _uses(plan, "Conv2D")
    assert len(uses) == len(CONVS)
    with graph.as_default():
        for use in uses:
            _, _, _, layout = CONVS[_weight_name(use, weights)]
            assert _conv_ways.tap_layout(options, use) == layout
            dZ = tf.compat.v1.placeholder(tf.float32, use.output.shape)
            grad, ops = _built_ops(graph, lambda: _conv_ways.by_shifts(
                options, use, dZ, tf.shape(dZ)[0]))
            assert grad.shape.as_list()[1:] == use.weight_shape.as_list()
            contractions = ops["BatchMatMulV2"] + ops["Einsum"]
            if layout == "channels":
                assert (ops["ExtractImagePatches"], contractions, ops["Pack"]) == (1, 1, 0), ops
            else:
                assert (contractions, ops["Pack"], ops["ExtractImagePatches"]) == (9, 1, 0), ops
            shifts = conv2d.Conv2DRule(conv2d.ConvOptions("shifts"))
            formed, _ = _built_ops(graph, lambda: shifts.formed_norms(
                use, dZ, tf.shape(dZ)[0]))
            assert formed is not None     # one matmul over the joined taps (both sizes)
            # "auto" too, unless its cost model picks oneDNN's grouped kernel (per_group)
            formed, _ = _built_ops(graph, lambda: use.rule.formed_norms(
                use, dZ, tf.shape(dZ)[0]))
            assert (formed is None) == (use.rule.strategy(use) == "grouped"), use.op.name


# The input gradients between the convolutions (`rules._input_gradients`): name ->
# (input name, kh, kw, Cin, Cout, stride, dilation, padding, the forward form's padding
# or None for TensorFlow's Conv2DBackpropInput, or "first" where none is built)
FORWARD_CONVS = (
    ("c0", "x", 3, 3, 16, 96, 1, 1, "SAME", "first"),
    ("c1", "c0", 3, 3, 96, 96, 1, 1, "SAME", "SAME"),                  # SAME again
    ("c2", "c1", 2, 2, 96, 192, 1, 1, "SAME", "EXPLICIT"),             # even: (1, 0)
    ("c3", "c2", 3, 3, 192, 64, 1, 1, [[0, 0], [2, 0], [1, 2], [0, 0]], "EXPLICIT"),
    ("c4", "c3", 3, 3, 64, 128, 2, 1, "SAME", None),                   # a stride
    ("c5", "c4", 1, 1, 128, 8, 1, 1, "SAME", None),                    # a small filter
    ("c6", "c5", 3, 3, 8, 1024, 1, 1, "SAME", None),                   # thin Cin
    ("c7", "y", 3, 3, 16, 32, 1, 1, "SAME", "first"),
    ("c8", "c7", 3, 3, 32, 256, 1, 1, "SAME", None),                   # Cin < Cout/2, P 81
    ("c9", "v", 3, 3, 16, 32, 1, 1, "SAME", "first"),
    ("c10", "c9", 3, 3, 32, 256, 1, 1, "VALID", "EXPLICIT"),           # Cin < Cout/2, P 4
)
FORWARD_INPUTS = {"x": [3, 4, 16], "y": [9, 9, 16], "v": [4, 4, 16]}
# dense layers after c10 ([B, 1024]): (W's shape, transpose_b); the input gradient of
# the first two (A W, min(d, n) >= TURNED_MIN_SIDE) is (W dZ^T)^T, of the third dZ W;
# the second's outer products (MUL_MIN_COLUMNS columns) are one broadcast Mul
DENSE_CHAIN = (([1024, 256], False), ([256, LONG], False), ([300, LONG], True))


def check_forward_form(batch=3, seed=21):
    """Per-example gradients through FORWARD_CONVS and DENSE_CHAIN against the loop, with
    the conv rule's oneDNN setting off: each input gradient between them is the forward
    Conv2D or Conv2DBackpropInput the table says (op counts of the build); with it on,
    every one is Conv2DBackpropInput; the dense layers' input gradients as DENSE_CHAIN
    says (oneDNN off). Builds its own graph and session (also run under
    disable_v2_behavior() by tests/legacy/test_vgg_paths.py)."""
    rng = np.random.default_rng(seed)
    with tf.Graph().as_default() as graph, tf.compat.v1.Session(graph=graph) as sess:
        feed, tensors, weights, ops = {}, {}, [], {}
        for name, shape in FORWARD_INPUTS.items():
            tensors[name] = tf.compat.v1.placeholder(tf.float32, [None] + shape, name=name)
            feed[tensors[name]] = rng.normal(size=[batch] + shape).astype("float32")
        for name, source, kh, kw, c_in, c_out, stride, dilation, padding, _ in FORWARD_CONVS:
            scale = 1.0 / np.sqrt(kh * kw * c_in)
            weights.append(tf.compat.v1.Variable(
                rng.normal(0, scale, [kh, kw, c_in, c_out]).astype("float32"), name=name))
            z = tf.nn.conv2d(tensors[source], weights[-1], stride, padding, dilations=dilation)
            ops[name] = z.op
            tensors[name] = tf.tanh(z)
        dense = tf.reshape(tensors["c10"], [-1, 2 * 2 * 256])                 # [B, 1024]
        for shape, transposed in DENSE_CHAIN:
            weights.append(tf.compat.v1.Variable(
                rng.normal(0, 1 / np.sqrt(shape[1 - transposed]), shape).astype("float32")))
            dense = tf.tanh(tf.matmul(dense, weights[-1], transpose_b=transposed))
        ys = (tf.reduce_mean(tensors["c6"] ** 2, axis=[1, 2, 3])
              + tf.reduce_mean(tf.sin(tensors["c8"]), axis=[1, 2, 3])
              + tf.reduce_mean(dense ** 2, axis=1))                     # [B]
        for name, *_, form in FORWARD_CONVS:
            taken = _input_gradients.forward_padding(ops[name]) is not None
            assert taken == (form not in (None, "first")), (name, form)
        in_between = [row for row in FORWARD_CONVS if row[-1] != "first"]
        grads = {}
        for onednn in (False, True):
            rules = pertower.rules.default_registry()
            rules.register("Conv2D", conv2d.Conv2DRule(conv2d.ConvOptions(onednn=onednn)))
            before = len(graph.get_operations())
            grads[onednn] = pertower.per_example_gradients(ys, weights, rules=rules)
            built = graph.get_operations()[before:]
            counts = collections.Counter(op.type for op in built)
            forward = sorted(op.get_attr("padding").decode() for op in built
                             if op.type == "Conv2D")
            if onednn:
                assert (forward, counts["Conv2DBackpropInput"]) == ([], len(in_between)), counts
            else:
                assert forward == sorted(row[-1] for row in in_between if row[-1]), forward
                assert counts["Conv2DBackpropInput"] == sum(
                    row[-1] is None for row in in_between), counts
            assert [op for op in built if op.type == "Mul"
                    and op.outputs[0].shape.as_list()[1:] == [256, LONG]], "no outer product"
            matmuls = [op for op in built if op.type == "MatMul"]
            turned = [op for op in matmuls if not op.get_attr("grad_a")]
            if not conv2d.onednn_enabled():
                assert (len(turned), len(matmuls)) == (2, 3), matmuls
                assert all(op.inputs[0].op.type != "MatMul" and op.get_attr("transpose_b")
                           and op.outputs[0].consumers()[0].type == "Transpose"
                           for op in turned), turned
        sess.run(tf.compat.v1.global_variables_initializer())
        got = sess.run(grads[False], feed)
        want = oracle.loop_per_example_gradients(sess, ys, weights, feed)
    assert all(np.abs(w).max() > 0 for w in want)
    common.assert_all_close(got, want, what="forward-form input gradients", kind="deep")


def test_input_gradients_as_forward_convolutions():
    """The forward form of the input gradients: where it is taken (padding SAME, an even
    filter's, an explicit one's and VALID's EXPLICIT), where not (a stride, a small
    filter, thin Cin, Cin < Cout/2 at many positions), oneDNN, the loop."""
    check_forward_form()


def test_dilated_input_gradients_as_forward_convolutions():
    """A dilated convolution's forward form (TensorFlow's CPU gradients without oneDNN
    refuse dilations, so no loop): against the gradient of the same convolution with
    the dilated filter written out (zeros between the taps), SAME and explicit."""
    rng = np.random.default_rng(22)
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        for padding in ("SAME", [[0, 0], [3, 1], [0, 2], [0, 0]]):
            x = tf.constant(rng.normal(size=[2, 6, 7, 16]).astype("float32"))
            w = rng.normal(0, 0.02, size=[3, 3, 16, 512]).astype("float32")
            z = tf.nn.conv2d(x, w, 1, padding, dilations=2)
            pads = _input_gradients.forward_padding(z.op)
            assert pads is not None
            dz = tf.constant(rng.normal(size=z.shape.as_list()).astype("float32"))
            got = _input_gradients.as_forward_convolution(
                z.op, dz, pads)
            written = np.zeros([5, 5, 16, 512], "float32")
            written[::2, ::2] = w
            plain = tf.nn.conv2d(x, written, 1, padding)
            assert plain.shape.as_list() == z.shape.as_list()
            want = tf.gradients(plain, x, dz)[0]
            common.assert_all_close(sess.run([got]), sess.run([want]), kind="deep",
                                    what=f"dilated forward form, {padding}")

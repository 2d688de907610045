"""Grouped convolutions (issue 20, item 1), against the one-example loop `pertower.oracle`.

tf_keras runs a convolution with groups > 1 as a call of a jit-compiled tf.function. For
Conv1D its body reaches Conv2D through ExpandDims (input and filter) and returns its
output through Squeeze: `rules/function_call.py` maps the call's tensors to the body
op's through such re-layouts (`rules/_call_layouts.py`: Identity, ExpandDims, Squeeze,
Reshape that keep axis 0, or static ones). A Conv2D with one input channel per group
(groups = channels, ConvNeXt's 7x7 stages) is a depthwise convolution and takes the
depthwise rule's ways (`_convolution/views.py`), one backward-filter kernel for every
group instead of one contraction per tap.

The fast model (B=3, inference mode, per-example softmax cross-entropy) has Conv1D with
groups and groups = channels in 1-D and 2-D, in one graph and session shared by the
module: per-example gradients and norms against the loop. Under
tf.compat.v1.disable_v2_behavior() the same checks run in
tests/legacy/test_unseen_networks.py. Heavy: the full model (also Conv2D
and Conv3D with groups < channels; sum_grad_squared and a DP clipped mean, σ = 0) and
ConvNeXtTiny.
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import pertower
from pertower import oracle
from tests import common

B = 3
NUM_CLASSES = 5
CLIP = 1.0
L = keras.layers


def grouped_layers(inputs, full=True):
    """[B, 12, 4] -> [B, NUM_CLASSES] through grouped convolutions: Conv1D with groups
    (re-layouts in its call), groups = channels in 1-D (strides [1, 2]) and in 2-D; with
    `full` also Conv2D and Conv3D with groups < channels."""
    h = L.Conv1D(4, 3, groups=2, padding="same")(inputs)                  # [B, 12, 4]
    h = L.Conv1D(8, 3, groups=4, padding="causal", strides=2,
                 activation="tanh")(h)                 # g = C, strides [1, 2]: [B, 6, 8]
    a = L.Reshape((2, 3, 8))(h)                                            # [B, 2, 3, 8]
    a = L.Conv2D(8, 3, groups=8, padding="same", activation="tanh")(a)     # g = C: [B, 2, 3, 8]
    if not full:
        return L.Dense(NUM_CLASSES)(L.Flatten()(a))
    a = L.Conv2D(6, 2, groups=2)(a)                                        # [B, 1, 2, 6]
    b = L.Reshape((1, 2, 3, 8))(h)                                         # [B, 1, 2, 3, 8]
    b = L.Conv3D(4, (1, 2, 2), groups=2)(b)                                # [B, 1, 1, 2, 4]
    h = L.Concatenate()([L.Flatten()(a), L.Flatten()(b)])                  # [B, 20]
    return L.Dense(NUM_CLASSES)(h)


class GroupedModel:
    """`grouped_layers` in a graph and session of its own, its plan, everything pertower
    builds for it (before the first run: a session that ran a function call before
    anything differentiated it cannot run a gradient through it), and one batch."""

    def __init__(self, full=True, seed=0):
        self.full = full
        self.graph = tf.Graph()
        with self.graph.as_default():
            common.seed_weights(seed)
            x = tf.compat.v1.placeholder(tf.float32, [None, 12, 4], name="x")
            labels = tf.compat.v1.placeholder(tf.int32, [None], name="labels")
            inputs = keras.Input((12, 4))
            model = keras.Model(inputs, grouped_layers(inputs, full))
            self.loss = tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=labels, logits=model(x, training=False))              # [B]
            self.weights = list(model.trainable_weights)
            self.plan = pertower.explain(self.loss, self.weights)
            before = len(self.graph.get_operations())
            self.grads = pertower.per_example_gradients(self.loss, self.weights)
            self.built_ops = self.graph.get_operations()[before:]
            self.norms = pertower.per_example_norms(self.loss, self.weights)
            self.squares, self.means = [], []
            if full:
                self.squares = list(pertower.sum_grad_squared(self.loss, self.weights))
                dp = pertower.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                          l2_norm_clip=CLIP, noise_multiplier=0.0,
                                          method="rules")
                self.means = [g for g, _ in dp.compute_gradients(self.loss,
                                                                  var_list=self.weights)]
            self.loop = oracle.SliceLoop(self.loss, self.weights)
            rng = np.random.default_rng(seed + 1)
            self.feed = {x: rng.normal(size=(B, 12, 4)).astype("float32"),
                         labels: rng.integers(0, NUM_CLASSES, B).astype("int32")}
            self.sess = tf.compat.v1.Session(graph=self.graph)
            self.sess.run(tf.compat.v1.global_variables_initializer())

    def check_plan(self):
        """Every weight on the rules, the grouped kernels through their calls."""
        methods = [w.method for w in self.plan.weights]
        assert methods == ["rules"] * len(self.weights), str(self.plan)
        calls = [w for w in self.plan.weights if any("PartitionedCall" in o for o in w.ops)]
        assert len(calls) == (5 if self.full else 3), str(self.plan)

    def check_numbers(self):
        """Gradients, norms (and with `full` sum_grad_squared and the clipped mean) as
        the loop's."""
        got, norms, squares, means = self.sess.run(
            [self.grads, self.norms, self.squares, self.means], self.feed)
        want = self.loop.run(self.sess, self.feed, B)                     # [B, *w] each
        assert all(np.abs(g).max() > 0 for g in want), "a zero gradient"
        common.assert_all_close(got, want, what="grouped: per-example gradients",
                                kind="deep")
        want64 = [g.astype(np.float64) for g in want]
        want_norms = np.sqrt(sum(np.sum(g.reshape(B, -1) ** 2, axis=1) for g in want64))
        common.assert_all_close(norms, want_norms.astype(np.float32), kind="deep",
                                what="grouped: norms")
        if not self.full:
            return f"grouped: {len(self.weights)} weights on the rules, as the loop's"
        common.assert_all_close(squares, [np.sum(g ** 2, axis=0).astype(np.float32)
                                          for g in want64],
                                what="grouped: sum_grad_squared", kind="deep")
        factors = CLIP / np.maximum(want_norms, CLIP)
        assert (want_norms > CLIP).any(), want_norms                       # some clipped
        common.assert_all_close(means, [(np.tensordot(factors, g, axes=1) / B).astype(
            np.float32) for g in want64], what="grouped: clipped mean", kind="deep")
        return f"grouped: {len(self.weights)} weights on the rules, as the loop's"

    def check_depthwise_form(self):
        """The groups = channels convolutions take the depthwise rule's backward-filter
        kernel (the equal-strides one) or its patches (the [1, 2]-strided one), and no
        grouped way contracts a tap at a time."""
        types = [op.type for op in self.built_ops]
        assert types.count("DepthwiseConv2dNativeBackpropFilter") == 1, types
        assert types.count("ExtractImagePatches") >= 1, types

    def close(self):
        self.sess.close()


def _relaid_call(body, shape, weight_shape):
    """ys of a jit-compiled function `body(x, kernel)` on x [B, *shape], and the kernel."""
    x = tf.compat.v1.placeholder(tf.float32, [None] + shape, name="x")
    kernel = tf.compat.v1.get_variable("kernel", weight_shape)
    h = tf.function(body, jit_compile=True)(x, tf.convert_to_tensor(kernel))
    return tf.reduce_sum(tf.tanh(h) ** 2, axis=list(range(1, h.shape.rank))), kernel


def _transposed(x, kernel):
    return tf.nn.conv2d(tf.transpose(x, [0, 2, 1, 3]), kernel, 1, "VALID")


def _batch_folded(x, kernel):
    h = tf.nn.conv2d(tf.reshape(x, [-1, 5, 5, 1]), kernel, 1, "VALID")   # [2B, 3, 3, 3]
    return tf.reshape(h, [-1, 2, 3, 3, 3])                              # [B, 2, 3, 3, 3]


def check_other_bodies_refused():
    """A body whose path from the batch argument to the convolution is no re-layout of
    this kind (a Transpose; a Reshape that folds channels into the batch axis) leaves the
    weight to the towers, naming the op."""
    for body, weight_shape, reason in [
            (_transposed, [3, 3, 2, 3], "not an argument of the function"),
            (_batch_folded, [3, 3, 1, 3], "(Reshape) moves the batch axis")]:
        graph = tf.Graph()
        with graph.as_default():
            ys, kernel = _relaid_call(body, [5, 5, 2], weight_shape)
            plan = pertower.explain(ys, [kernel])
            assert plan.weights[0].method == "towers", str(plan)
            assert reason in plan.weights[0].reason, str(plan)


def check_sparse_matmul():
    """SparseMatMul (`tf.matmul(..., b_is_sparse=True)`, as LocallyConnected
    implementation=2 multiplies) on the MatMul rule, both sides' sparsity hints, against
    the loop."""
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(2)
        x = tf.compat.v1.placeholder(tf.float32, [None, 4], name="x")
        w1 = tf.compat.v1.get_variable("w1", [4, 5])
        w2 = tf.compat.v1.get_variable("w2", [3, 5])
        h = tf.tanh(tf.matmul(x, w1, b_is_sparse=True))                     # [B, 5]
        z = tf.matmul(h, w2, a_is_sparse=True, transpose_b=True)            # [B, 3]
        ys = tf.reduce_sum(z ** 2, axis=1)                                  # [B]
        assert [op.type for op in graph.get_operations()].count("SparseMatMul") == 2
        plan = pertower.explain(ys, [w1, w2])
        assert [w.method for w in plan.weights] == ["rules", "rules"], str(plan)
        grads = pertower.per_example_gradients(ys, [w1, w2])
        feed = {x: np.random.default_rng(3).normal(size=(B, 4)).astype("float32")}
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            common.assert_all_close(sess.run(grads, feed),
                                    oracle.SliceLoop(ys, [w1, w2]).run(sess, feed, B),
                                    what="SparseMatMul: per-example gradients", kind="deep")


@pytest.fixture(scope="module")
def grouped():
    model = GroupedModel(full=False)
    yield model
    model.close()


def test_grouped_weights_on_the_rules_through_calls(grouped):
    grouped.check_plan()


def test_grouped_convolutions_match_loop(grouped):
    grouped.check_numbers()


def test_groups_equal_to_channels_take_the_depthwise_form(grouped):
    grouped.check_depthwise_form()


def test_other_bodies_are_refused_naming_the_op():
    check_other_bodies_refused()


def test_sparse_matmul_matches_loop():
    check_sparse_matmul()


@pytest.mark.heavy
def test_all_grouped_kinds_with_squares_and_clipped_mean():
    """With Conv2D and Conv3D groups < channels too, sum_grad_squared and a DP
    clipped mean (σ = 0)."""
    model = GroupedModel(full=True)
    try:
        model.check_plan()
        model.check_depthwise_form()
        model.check_numbers()
    finally:
        model.close()


@pytest.mark.heavy
def test_convnext_tiny_depthwise_stages():
    """ConvNeXtTiny (weights=None, 32x32): its 18 depthwise 7x7 stages (groups =
    channels, 96-768) each take one backward-filter kernel, and every weight is on the
    rules and as the loop's."""
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(5)
        x = tf.compat.v1.placeholder(tf.float32, [None, 32, 32, 3], name="images")
        labels = tf.compat.v1.placeholder(tf.int32, [None], name="labels")
        model = keras.applications.ConvNeXtTiny(weights=None, input_shape=(32, 32, 3),
                                                classes=NUM_CLASSES,
                                                classifier_activation=None)
        loss = tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=labels, logits=model(x, training=False))                 # [B]
        weights = list(model.trainable_weights)
        plan = pertower.explain(loss, weights)
        assert all(w.method == "rules" for w in plan.weights), str(plan)
        before = len(graph.get_operations())
        grads = pertower.per_example_gradients(loss, weights)
        types = [op.type for op in graph.get_operations()[before:]]
        assert types.count("DepthwiseConv2dNativeBackpropFilter") == 18, types
        loop = oracle.SliceLoop(loss, weights)
        rng = np.random.default_rng(6)
        feed = {x: rng.random((2, 32, 32, 3), dtype="float32"),
                labels: rng.integers(0, NUM_CLASSES, 2).astype("int32")}
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            common.assert_all_close(sess.run(grads, feed), loop.run(sess, feed, 2),
                                    kind="network", what="convnext_tiny: per-example")

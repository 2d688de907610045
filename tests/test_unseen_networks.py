"""Networks and Keras layers beyond the zoo (issue 20, item 1), against the one-example loop.

Each case is a small tf_keras model (B=3, inference mode, per-example softmax
cross-entropy `ys`) built in a graph and session of its own, shared by the module:

    grouped      Conv2D(groups=4) -> Conv2D(groups=2): tf_keras runs a grouped Conv2D as
                 a call of a jit-compiled tf.function whose body is Conv2D -> Identity
                 (ConvNeXt's depthwise stages, RegNet); `rules/function_call.py` gives
                 the weight the body op's rule on the call's tensors
    groupnorm    GroupNormalization reshapes gamma and beta to
                 [1, 1, 1, G, tf.shape(x)[-1] // G]: a constant computed from a static
                 axis of the batch's shape (`_batch_axis.static.constant_sizes`), so a
                 function of the weights alone
    regularized  Dense layers with kernel and bias regularizers, `ys` = the loss +
                 sum(model.losses)

Regularised losses (decided here): `ys` = loss_i + R(w), R a function of the weights alone
(kernel_regularizer, bias_regularizer), has the per-example gradient of its definition,
the one-example loop's: grad_i = grad loss_i + grad R, every example carrying the whole
regularizer's gradient (for DP-SGD, where that gradient would be clipped with each
example, leave R out of `ys` and add its gradient to the noised sum). An
activity_regularizer sums over the batch's activations (and Keras divides it by the batch
size): it couples the examples, and pertower refuses it, naming the op.

Every case runs under tf.compat.v1.disable_v2_behavior() too (legacy shape mode, in
tests/legacy/test_unseen_networks.py). The application
networks (ConvNeXtTiny, RegNetX002, RegNetY002, ...) are heavy.
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
L = keras.layers


def _grouped(inputs):
    h = L.Conv2D(4, 3, groups=4, padding="same")(inputs)                   # [B, 6, 6, 4]
    h = L.Conv2D(4, 3, groups=2, activation="relu")(h)                     # [B, 4, 4, 4]
    return L.Dense(NUM_CLASSES)(L.Flatten()(h))


def _groupnorm(inputs):
    h = L.GroupNormalization(2)(L.Conv2D(4, 3)(inputs))                    # [B, 4, 4, 4]
    return L.Dense(NUM_CLASSES)(L.Flatten()(h))


def _regularized(inputs):
    h = L.Dense(5, activation="tanh", kernel_regularizer="l1_l2")(inputs)   # [B, 6, 6, 5]
    return L.Dense(NUM_CLASSES, kernel_regularizer=keras.regularizers.l2(0.1),
                   bias_regularizer="l1",
                   kernel_constraint=keras.constraints.MaxNorm(2.0))(L.Flatten()(h))


def _activity_regularized(inputs):
    h = L.Dense(5, activation="tanh", activity_regularizer="l2")(inputs)
    return L.Dense(NUM_CLASSES)(L.Flatten()(h))


# name -> (body, input channels)
CASES = {"grouped": (_grouped, 4), "groupnorm": (_groupnorm, 2),
         "regularized": (_regularized, 2)}


class Case:
    """One model in a graph and session of its own: its plan, per-example gradients and
    norms (built before the first run: a session that ran a function call before
    anything differentiated it cannot run a gradient through it) and one batch."""

    def __init__(self, name, body=None, channels=None, seed=0):
        body, channels = (body, channels) if body is not None else CASES[name]
        self.name = name
        self.graph = tf.Graph()
        with self.graph.as_default():
            common.seed_weights(seed)
            x = tf.compat.v1.placeholder(tf.float32, [None, 6, 6, channels], name="x")
            labels = tf.compat.v1.placeholder(tf.int32, [None], name="labels")
            inputs = keras.Input((6, 6, channels))
            self.model = keras.Model(inputs, body(inputs))
            logits = self.model(x, training=False)                          # [B, C]
            self.loss = tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=labels, logits=logits)                                # [B]
            if self.model.losses:
                self.loss = self.loss + tf.add_n(self.model.losses)         # [B] + []
            self.weights = list(self.model.trainable_weights)
            rng = np.random.default_rng(seed + 1)
            self.feed = {x: rng.normal(size=(B, 6, 6, channels)).astype("float32"),
                         labels: rng.integers(0, NUM_CLASSES, B).astype("int32")}
            self.plan = pertower.explain(self.loss, self.weights)
            self.loop = oracle.SliceLoop(self.loss, self.weights)
            self.sess = tf.compat.v1.Session(graph=self.graph)
            self._built = None

    def build(self):
        """Per-example gradients and norms, without batch_size."""
        if self._built is None:
            with self.graph.as_default():
                self._built = (pertower.per_example_gradients(self.loss, self.weights),
                               pertower.per_example_norms(self.loss, self.weights))
                self.sess.run(tf.compat.v1.global_variables_initializer())
        return self._built

    def check(self):
        """Every weight on the rules; gradients and norms as the loop's. Returns the
        plan's methods, one line."""
        methods = [w.method for w in self.plan.weights]
        assert methods == ["rules"] * len(self.weights), f"{self.name}: {self.plan}"
        grads, norms = self.build()
        got, got_norms = self.sess.run([grads, norms], self.feed)
        want = self.loop.run(self.sess, self.feed, B)
        common.assert_all_close(got, want, what=f"{self.name}: per-example gradients",
                                kind="deep")
        want_norms = np.sqrt(sum(np.sum(g.reshape(B, -1).astype(np.float64) ** 2, axis=1)
                                 for g in want))
        common.assert_all_close(got_norms, want_norms.astype(np.float32),
                                what=f"{self.name}: norms", kind="deep")
        assert all(np.abs(g).max() > 0 for g in want), f"{self.name}: a zero gradient"
        return f"{self.name}: {len(methods)} weights on the rules"

    def close(self):
        self.sess.close()


def check_case(name):
    case = Case(name)
    try:
        return case.check()
    finally:
        case.close()


def check_grouped_ops_in_plan(case):
    """The grouped convolutions' kernels are computed through their calls, and the
    call's rule gives the body rule's sum of squared per-example gradients."""
    calls = [w for w in case.plan.weights if any("PartitionedCall" in o for o in w.ops)]
    assert len(calls) == 2, str(case.plan)
    with case.graph.as_default():
        squares = pertower.sum_grad_squared(case.loss, case.weights)
    case.build()
    got = case.sess.run(list(squares), case.feed)
    want = [np.sum(g.astype(np.float64) ** 2, axis=0).astype(np.float32)
            for g in case.loop.run(case.sess, case.feed, B)]
    common.assert_all_close(got, want, what="grouped: sum_grad_squared", kind="deep")


def check_activity_regularizer_refused():
    """An activity regularizer couples the examples: refused, naming the op."""
    case = Case("activity", _activity_regularized, 2)
    try:
        with case.graph.as_default():
            with pytest.raises(ValueError, match=r"ActivityRegularizer.*couples the examples"):
                pertower.per_example_gradients(case.loss, case.weights)
    finally:
        case.close()


def _call_with_bias(inputs, kernel, bias):
    return tf.nn.conv2d(inputs, kernel, 1, "VALID") + bias


def check_call_doing_more_falls_back():
    """A jit-compiled function that adds a bias to its convolution inside is not one
    covered op: its weights fall back to the towers with the reason, which give the
    loop's numbers with batch_size."""
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(3)
        x = tf.compat.v1.placeholder(tf.float32, [None, 5, 5, 2], name="x")
        kernel = tf.compat.v1.get_variable("kernel", [3, 3, 2, 3])
        bias = tf.compat.v1.get_variable("bias", [3])
        h = tf.function(_call_with_bias, jit_compile=True)(    # the weights' values passed
            x, tf.convert_to_tensor(kernel), tf.convert_to_tensor(bias))     # [B, 3, 3, 3]
        ys = tf.reduce_sum(tf.tanh(h) ** 2, axis=[1, 2, 3])                  # [B]
        plan = pertower.explain(ys, [kernel, bias])
        assert [w.method for w in plan.weights] == ["towers", "towers"], str(plan)
        assert "than return it once" in plan.weights[0].reason, str(plan)
        grads = pertower.per_example_gradients(ys, [kernel, bias], batch_size=B)
        loop = oracle.SliceLoop(ys, [kernel, bias])
        feed = {x: np.random.default_rng(4).normal(size=(B, 5, 5, 2)).astype("float32")}
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            got = sess.run(grads, feed)
            common.assert_all_close(got, loop.run(sess, feed, B), kind="deep",
                                    what="call doing more: per-example gradients")


@pytest.fixture(scope="module")
def cases():
    built = {}
    yield lambda name: built.setdefault(name, Case(name))
    for case in built.values():
        case.close()


@pytest.mark.parametrize("name", sorted(CASES))
def test_case_matches_loop(cases, name):
    cases(name).check()


def test_grouped_convolutions_read_through_their_calls(cases):
    check_grouped_ops_in_plan(cases("grouped"))


def test_activity_regularizer_is_refused():
    check_activity_regularizer_refused()


def test_call_doing_more_falls_back_with_reason():
    check_call_doing_more_falls_back()


# -- published networks beyond the zoo (heavy) -----------------------------------------

# name -> (tf_keras.applications class, keyword arguments), on [B, 32, 32, 3]
APPLICATIONS = {
    "convnext_tiny": ("ConvNeXtTiny", {}),
    "regnetx002": ("RegNetX002", {}),
    "regnety002": ("RegNetY002", {}),
    "mobilenet_v3_small": ("MobileNetV3Small", {"alpha": 0.75}),
    "efficientnet_v2_b0": ("EfficientNetV2B0", {}),
    "resnet50_v2": ("ResNet50V2", {}),
}


def check_application(name, batch=2):
    """A tf_keras.applications network (weights=None, 32x32, inference mode) with every
    weight on the rules, against the loop."""
    class_name, kwargs = APPLICATIONS[name]
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(5)
        x = tf.compat.v1.placeholder(tf.float32, [None, 32, 32, 3], name="images")
        labels = tf.compat.v1.placeholder(tf.int32, [None], name="labels")
        model = getattr(keras.applications, class_name)(
            weights=None, input_shape=(32, 32, 3), classes=NUM_CLASSES,
            classifier_activation=None, **kwargs)
        loss = tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=labels, logits=model(x, training=False))                 # [B]
        weights = list(model.trainable_weights)
        plan = pertower.explain(loss, weights)
        off = [w.name for w in plan.weights if w.method != "rules"]
        assert not off, f"{name}: not on the rules: {off[:5]}\n{plan}"
        grads = pertower.per_example_gradients(loss, weights)
        loop = oracle.SliceLoop(loss, weights)
        rng = np.random.default_rng(6)
        feed = {x: rng.random((batch, 32, 32, 3), dtype="float32"),
                labels: rng.integers(0, NUM_CLASSES, batch).astype("int32")}
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            from benchmarks import zoo  # pylint: disable=import-outside-toplevel
            zoo.randomize_batch_norm_statistics(sess, graph, 7)
            got = sess.run(grads, feed)
            common.assert_all_close(got, loop.run(sess, feed, batch), kind="network",
                                    what=f"{name}: per-example gradients")
    return f"{name}: {len(weights)} weights on the rules"


@pytest.mark.heavy
@pytest.mark.parametrize("name", sorted(APPLICATIONS))
def test_application_matches_loop(name):
    check_application(name)

"""Rules for what published networks are made of, against the one-example loop:
FusedBatchNorm/V2/V3 in inference mode (rules/fused_batch_norm.py) and a weight
broadcast into an elementwise op (rules/broadcast.py, one rule for every op type).

Each `check_*` function builds its own graph, asserts that `pertower.explain` puts every
weight on the rules (none on the towers, no batch_size given) and that the results
match `pertower.oracle`. The tests here run them in this process (graph mode, TF2
behaviour); tests/legacy/test_rules_published.py runs the same functions under
`tf.compat.v1.disable_v2_behavior()` (legacy shape mode, reference variables).
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import pertower
from pertower import oracle
from pertower.tools import plan_summary
from tests import common
from tests import test_zoo

B = 3


def _session(graph):
    sess = tf.compat.v1.Session(graph=graph)
    sess.run(tf.compat.v1.global_variables_initializer())
    return sess


def _assert_all_on_rules(ys, xs, op_type=None):
    """explain: every weight of xs on the rules (none on the towers), and, when op_type
    is given, at least one weight computed by a rule of that op type."""
    plan = pertower.explain(ys, xs)
    methods = {w.name: w.method for w in plan.weights}
    off = {w.name: w.reason for w in plan.weights if w.method != "rules"}
    assert not off, f"weights not on the rules: {off}"
    assert len(methods) == len(xs)
    if op_type is not None:
        assert any(f"({op_type})" in op for w in plan.weights for op in w.ops), (
            f"no weight is computed by a {op_type} rule:\n{plan}")
    return plan


def _check_against_loop(sess, ys, xs, feed, what, kind="deep", with_norms=True):
    """Per-example gradients (method="rules", no batch_size) and, with `with_norms`,
    per-example norms against the one-example loop; the sum over examples against
    tf.gradients."""
    grads = pertower.per_example_gradients(ys, xs, method="rules")
    norms = pertower.per_example_norms(ys, xs, method="rules") if with_norms else []
    batch_grads = tf.gradients(tf.reduce_sum(ys), xs)
    got, got_norms, batch_values = sess.run([grads, norms, batch_grads], feed)
    want = oracle.loop_per_example_gradients(sess, ys, xs, feed)
    common.assert_all_close(got, want, what=f"{what}: per-example gradients", kind=kind)
    if with_norms:
        want_norms = np.sqrt(sum(np.sum(g.reshape(len(g), -1) ** 2, axis=1) for g in want))
        common.assert_all_close([got_norms], [want_norms], what=f"{what}: norms", kind=kind)
    common.assert_all_close([g.sum(axis=0) for g in got], batch_values,
                            what=f"{what}: sum over examples", kind=kind)
    assert all(np.abs(g).max() > 0 for g in want), f"{what}: a weight has zero gradients"


def _randomize_batch_norms(sess, layers, seed):
    """Random gamma, beta and moving statistics (inference mode normalizes with the
    moving ones: a rule that used x for x_hat, or the batch's statistics, would differ)."""
    rng = np.random.RandomState(seed)
    assignments = []
    for layer in layers:
        if not hasattr(layer, "moving_variance"):   # BatchNormalization (V1 under legacy mode)
            continue
        for weight, low, high in ((layer.gamma, 0.5, 1.5), (layer.beta, -0.3, 0.3),
                                  (layer.moving_mean, -0.3, 0.3),
                                  (layer.moving_variance, 0.5, 1.5)):
            if weight is not None:
                value = rng.uniform(low, high, weight.shape).astype(np.float32)
                assignments.append(tf.compat.v1.assign(weight, value))
    assert assignments, "no BatchNormalization layer"
    sess.run(tf.group(assignments))   # one run: each run of a grown graph re-sends it


# -- FusedBatchNorm --------------------------------------------------------------------

def check_raw_fused_batch_norm(op_type, data_format):
    """tf.raw_ops.FusedBatchNorm{,V2,V3}(is_training=False) on [B, 2, 3, 4] with its
    scale and offset as weights, k = 1 row per example."""
    with tf.Graph().as_default() as graph:
        x = tf.compat.v1.placeholder(tf.float32, [None, 2, 3, 4], name="x")
        C = 4 if data_format == "NHWC" else 2
        rng = np.random.RandomState(0)
        scale = tf.compat.v1.get_variable("scale", initializer=rng.uniform(
            0.5, 1.5, C).astype(np.float32))
        offset = tf.compat.v1.get_variable("offset", initializer=rng.uniform(
            -0.5, 0.5, C).astype(np.float32))
        mean = tf.constant(rng.uniform(-0.5, 0.5, C).astype(np.float32))
        variance = tf.constant(rng.uniform(0.5, 2.0, C).astype(np.float32))
        kwargs = dict(x=x, scale=scale, offset=offset, mean=mean, variance=variance,
                      epsilon=0.01, data_format=data_format, is_training=False)
        y = getattr(tf.raw_ops, op_type)(**kwargs)[0]                  # [B, 2, 3, 4]
        c = tf.constant(rng.randn(2, 3, 4).astype(np.float32))
        ys = tf.reduce_sum(tf.tanh(y) * c, axis=[1, 2, 3])              # [B]
        xs = [scale, offset]
        _assert_all_on_rules(ys, xs, op_type)
        sess = _session(graph)
        feed = {x: rng.randn(B, 2, 3, 4).astype(np.float32)}
        _check_against_loop(sess, ys, xs, feed, f"{op_type} {data_format}")


def check_keras_batch_norm_net():
    """A small Keras conv net called with training=False: Conv2D -> BatchNormalization
    (NHWC) -> ReLU -> Permute to [B, C, H, W] -> BatchNormalization(axis=1) (NCHW) ->
    Flatten -> Dense, a softmax cross-entropy per example."""
    with tf.Graph().as_default() as graph:
        common.seed_weights(20)
        x = tf.compat.v1.placeholder(tf.float32, [None, 6, 6, 3], name="images")
        labels = tf.compat.v1.placeholder(tf.int32, [None], name="labels")
        inputs = keras.Input((6, 6, 3))
        h = keras.layers.Conv2D(4, 3)(inputs)                          # [B, 4, 4, 4]
        h = keras.layers.BatchNormalization()(h)
        h = keras.layers.ReLU()(h)
        h = keras.layers.Permute((3, 1, 2))(h)                         # [B, C, H, W]
        h = keras.layers.BatchNormalization(axis=1)(h)
        outputs = keras.layers.Dense(5)(keras.layers.Flatten()(h))     # [B, 5]
        model = keras.Model(inputs, outputs)
        logits = model(x, training=False)
        ys = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
        xs = list(model.trainable_weights)
        plan = _assert_all_on_rules(ys, xs, "FusedBatchNormV3")
        formats = {op.get_attr("data_format") for op in graph.get_operations()
                   if op.type == "FusedBatchNormV3"}
        assert formats == {b"NHWC", b"NCHW"}, f"expected both data formats, got {formats}"
        sess = _session(graph)
        _randomize_batch_norms(sess, model.layers, 21)
        rng = np.random.RandomState(22)
        feed = {x: rng.randn(B, 6, 6, 3).astype(np.float32),
                labels: rng.randint(0, 5, B).astype(np.int32)}
        _check_against_loop(sess, ys, xs, feed, "Keras BatchNormalization net")
        return str(plan)


def check_application(name="mobilenet_v2"):
    """A zoo network (benchmarks/zoo.py: a tf_keras.applications network with
    weights=None at a small input, inference mode, softmax cross-entropy per example)
    with random moving statistics: every weight on the rules, no batch_size, gradients
    as the one-example loop's (tests/test_zoo.py)."""
    built = test_zoo.Built(name, batch_size=B, seed=30)
    try:
        counts = plan_summary.method_counts(built.plan)
        assert counts["rules"] == len(built.network.weights), (
            plan_summary.summarize(built.plan, name))
        assert any("(FusedBatchNormV3)" in op or "(FusedBatchNorm)" in op
                   for w in built.plan.weights for op in w.ops), str(built.plan)
        # the norms' rules are those checked on the small nets
        return test_zoo.check_network(built, with_norms=False)
    finally:
        built.close()


# -- a weight broadcast into an elementwise op -------------------------------------------

def _raw(op_type):
    """The binary op `op_type` as f(first, second)."""
    return lambda first, second: getattr(tf.raw_ops, op_type)(x=first, y=second)


# op type -> f(first, second) with the op at the top; every operand is positive.
BROADCAST_OPS = {op_type: _raw(op_type) for op_type in (
    "Add", "AddV2", "Sub", "Mul", "MulNoNan", "Div", "RealDiv", "DivNoNan", "Maximum",
    "Minimum", "SquaredDifference", "Pow", "Atan2", "Xdivy", "Xlogy", "Xlog1py")}


def _broadcast_op_term(op_type, x, rng):
    """The two weights of `op_type` and its term of ys [B]: a weight w0 [3] as the FIRST
    operand of op(w0, A) on A [B*4, 3] (k = 4 rows per example), and a weight w1
    [1, 4, 1] as the SECOND operand of op(A', w1) on A' [B, 4, 3] (broadcast over axes 0
    and 2); for SelectV2 the two value inputs."""
    w0 = tf.compat.v1.get_variable(f"{op_type}/w0", initializer=rng.uniform(
        0.5, 1.5, [3]).astype(np.float32))
    w1 = tf.compat.v1.get_variable(f"{op_type}/w1", initializer=rng.uniform(
        0.5, 1.5, [1, 4, 1]).astype(np.float32))
    positive = tf.nn.softplus(x) + 0.5                              # [B, 4, 3]
    rows = tf.reshape(positive, [-1, 3])                           # [B*4, 3]
    if op_type == "SelectV2":
        first = tf.raw_ops.SelectV2(condition=rows > 1.0, t=w0, e=rows)
        second = tf.raw_ops.SelectV2(condition=positive > 1.0, t=positive, e=w1)
    else:
        first = BROADCAST_OPS[op_type](w0, rows)                   # [B*4, 3]
        second = BROADCAST_OPS[op_type](positive, w1)              # [B, 4, 3]
    assert first.op.type == op_type and second.op.type == op_type
    z = tf.reshape(first, [-1, 4, 3]) * 0.7 + second               # [B, 4, 3]
    c = tf.constant(rng.randn(4, 3).astype(np.float32))
    return [w0, w1], tf.reduce_sum(tf.tanh(z) * c, axis=[1, 2])     # [B]


def check_broadcast_ops(op_types, with_norms=True):
    """Each op type of `op_types` with its two broadcast weights (`_broadcast_op_term`),
    all in one graph, ys [B] the sum of their terms: every weight on the rules of its
    own op type, the per-example gradients (and, with `with_norms`, the norms) against
    the loop."""
    with tf.Graph().as_default() as graph:
        rng = np.random.RandomState(40)
        x = tf.compat.v1.placeholder(tf.float32, [None, 4, 3], name="x")
        xs, terms = [], []
        for op_type in op_types:
            weights, term = _broadcast_op_term(op_type, x, rng)
            xs += weights
            terms.append(term)
        ys = tf.add_n(terms)                                            # [B]
        plan = _assert_all_on_rules(ys, xs)
        for weight, op_type in zip(plan.weights, [t for t in op_types for _ in range(2)]):
            assert weight.name.startswith(f"{op_type}/"), str(plan)
            assert any(f"({op_type})" in op for op in weight.ops), str(plan)
        sess = _session(graph)
        feed = {x: rng.randn(B, 4, 3).astype(np.float32)}
        _check_against_loop(sess, ys, xs, feed, ", ".join(op_types), with_norms=with_norms)


def check_broadcast_op(op_type):
    """`check_broadcast_ops` of the one op type `op_type`."""
    check_broadcast_ops([op_type])


BROADCAST_OP_TYPES = sorted(BROADCAST_OPS) + ["SelectV2"]


def check_every_broadcast_op():
    for op_type in BROADCAST_OP_TYPES:
        check_broadcast_op(op_type)


def check_broadcast_dp_step():
    """DPOptimizer (noise 0) through a FusedBatchNorm (inference) and a Maximum with a
    broadcast bound: the clipped sum of both rules (the batch gradient of dZ scaled per
    example) against the loop's per-example gradients clipped in NumPy; and microbatch
    gradients (2 groups of 2 examples) against the loop."""
    with tf.Graph().as_default() as graph:
        rng = np.random.RandomState(50)
        x = tf.compat.v1.placeholder(tf.float32, [None, 2, 2, 3], name="x")
        scale = tf.compat.v1.get_variable("scale", initializer=rng.uniform(
            0.5, 1.5, 3).astype(np.float32))
        offset = tf.compat.v1.get_variable("offset", initializer=rng.uniform(
            -0.5, 0.5, 3).astype(np.float32))
        bound = tf.compat.v1.get_variable("bound", initializer=rng.uniform(
            -0.2, 0.2, [2, 1, 3]).astype(np.float32))
        y = tf.compat.v1.nn.fused_batch_norm(
            x, scale, offset, mean=tf.constant([0.1, -0.2, 0.3]),
            variance=tf.constant([0.5, 1.0, 1.5]), is_training=False)[0]   # [B, 2, 2, 3]
        z = tf.maximum(y, bound)                                       # [B, 2, 2, 3]
        ys = tf.reduce_sum(tf.sin(z), axis=[1, 2, 3])                  # [B]
        xs = [scale, offset, bound]
        _assert_all_on_rules(ys, xs)
        feed = {x: rng.randn(4, 2, 2, 3).astype(np.float32)}
        sess = _session(graph)
        per_example = oracle.loop_per_example_gradients(sess, ys, xs, feed)
        norms = np.sqrt(sum(np.sum(g.reshape(4, -1) ** 2, axis=1) for g in per_example))
        clip = float(np.median(norms))
        factors = clip / np.maximum(norms, clip)                        # [4]
        want = [np.tensordot(factors, g, axes=1) / 4 for g in per_example]
        dp = pertower.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                  l2_norm_clip=clip, noise_multiplier=0.0)
        grads_and_vars = dp.compute_gradients(ys, var_list=xs, batch_size=4)
        got = sess.run([g for g, _ in grads_and_vars], feed)
        assert (norms > clip * 1.01).any() and (norms < clip * 0.99).any()
        common.assert_all_close(got, want, what="DP gradient", kind="tight")
        micro = pertower.microbatch_gradients(ys, xs, num_microbatches=2, method="rules")
        common.assert_all_close(sess.run(micro, feed),
                                oracle.loop_microbatch_gradients(sess, ys, xs, feed, 2),
                                what="microbatch gradients")


# -- tests (this process: graph mode, TF2 behaviour) --------------------------------------

@pytest.mark.parametrize("data_format", ["NHWC", "NCHW"])
@pytest.mark.parametrize("op_type", ["FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"])
def test_fused_batch_norm_in_inference_mode_matches_the_loop(op_type, data_format):
    check_raw_fused_batch_norm(op_type, data_format)


def test_keras_batch_normalization_net_is_on_rules_and_matches_the_loop():
    check_keras_batch_norm_net()


@pytest.mark.heavy
@pytest.mark.parametrize("name", ["mobilenet_v2", "resnet50", "densenet121"])
def test_application_network_is_on_rules_and_matches_the_loop(name):
    check_application(name)


def test_broadcast_weights_of_every_op_type_in_one_graph_match_the_loop():
    """Every op type of the broadcast rule at once (one graph, one plan, one loop), the
    per-example gradients (the broadcast rule's norms: tests/test_rules.py's clipped
    sums on its "broadcast" model; each op type's with -m heavy below)."""
    check_broadcast_ops(BROADCAST_OP_TYPES, with_norms=False)


@pytest.mark.heavy
@pytest.mark.parametrize("op_type", BROADCAST_OP_TYPES)
def test_broadcast_weight_in_elementwise_op_matches_the_loop(op_type):
    """Each op type in a graph of its own, with the norms (heavy: the default run
    checks them all in one graph above)."""
    check_broadcast_op(op_type)


def test_dp_step_through_batch_norm_and_broadcast_rules_matches_numpy():
    check_broadcast_dp_step()


def test_batch_norm_in_training_mode_is_not_on_the_rules():
    """is_training=True normalizes with the batch's statistics: the weights fall back,
    and explain says why."""
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 2, 2, 3], name="x")
        scale = tf.compat.v1.get_variable("scale", initializer=tf.ones([3]))
        offset = tf.compat.v1.get_variable("offset", initializer=tf.zeros([3]))
        y = tf.compat.v1.nn.fused_batch_norm(x, scale, offset, is_training=True)[0]
        ys = tf.reduce_sum(y ** 2, axis=[1, 2, 3])
        plan = pertower.explain(ys, [scale, offset], batch_size=3)
        assert [w.method for w in plan.weights] != ["rules", "rules"]
        assert "is_training=True" in str(plan)


def test_a_moving_statistic_as_a_weight_falls_back_with_the_reason():
    """The moving mean and variance get no gradient from TensorFlow's FusedBatchNorm
    gradient in inference mode; as weights they are left to the towers, saying so, while
    scale and offset stay on the rules."""
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 2, 2, 3], name="x")
        scale = tf.compat.v1.get_variable("scale", initializer=tf.ones([3]))
        offset = tf.compat.v1.get_variable("offset", initializer=tf.zeros([3]))
        mean = tf.compat.v1.get_variable("moving_mean", initializer=tf.zeros([3]))
        variance = tf.compat.v1.get_variable("moving_variance", initializer=tf.ones([3]))
        y = tf.compat.v1.nn.fused_batch_norm(x, scale, offset, mean, variance,
                                             is_training=False)[0]
        ys = tf.reduce_sum(y ** 2, axis=[1, 2, 3])
        plan = pertower.explain(ys, [scale, offset, mean, variance])
        assert [w.method for w in plan.weights] == ["rules", "rules", "towers", "towers"]
        assert all("moving statistic" in w.reason for w in plan.weights[2:]), str(plan)

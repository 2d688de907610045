"""Weights read through functions of the weights alone (rules/_weight_functions.py),
against the one-example loop: Keras' mixed_float16 casts, weight normalization g·v/||v||,
tanh(W), abs(W), Transpose, a ConcatV2 of partitions, and Keras' non-fused batch norm in
inference mode (scale = gamma·rsqrt(var + eps), shift = beta - mean·scale) on 2-D and
4-D inputs; norms, microbatches and a DPOptimizer step (the clipped sum: one VJP).

Each `check_*` function builds its own graph, asserts that `pertower.explain` puts every
weight on the rules (none on the towers, no batch_size) "through" the weight-only ops,
and compares with `pertower.oracle`. The tests here run them in this process (graph
mode, TF2 behaviour); tests/legacy/test_rules_weight_functions.py runs them under
`tf.compat.v1.disable_v2_behavior()` (legacy shape mode, reference variables).
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import pertower
from pertower import oracle
from tests import common

B = 4   # two microbatches of two examples
# float16 carries 11 significant bits (a rounding error of 2^-11 ~ 5e-4 per operation):
# the batched and the one-example float16 products round differently, and the errors of
# a few roundings add up, so mixed_float16 results are compared at 1e-2 relative, 1e-3
# absolute (float32 weights get the table's "deep" tolerances).
FLOAT16_TOLERANCE = dict(rtol=1e-2, atol=1e-3)


def _session(graph):
    sess = tf.compat.v1.Session(graph=graph)
    sess.run(tf.compat.v1.global_variables_initializer())
    return sess


def _plan_through(ys, xs):
    """explain: every weight on the rules; returns {weight name: its rule column}."""
    plan = pertower.explain(ys, xs)
    off = {w.name: w.reason for w in plan.weights if w.method != "rules"}
    assert not off, f"weights not on the rules: {off}\n{plan}"
    assert plan.request.batch_size is None and not plan.fallback, str(plan)
    return plan, {w.name: ", ".join(w.ops) for w in plan.weights}


def _check_against_loop(sess, ys, xs, feed, what, tolerance=None, micro=False):
    """Per-example gradients and norms (no batch_size) and microbatch gradients against
    the loop; the sum over examples against tf.gradients."""
    tolerance = tolerance or common.tolerance(np.float32, "deep")
    grads = pertower.per_example_gradients(ys, xs, method="rules")
    norms = pertower.per_example_norms(ys, xs, method="rules")
    batch_grads = [tf.convert_to_tensor(g) for g in tf.gradients(tf.reduce_sum(ys), xs)]
    fetches = [grads, norms, batch_grads]
    if micro:
        fetches.append(pertower.microbatch_gradients(ys, xs, num_microbatches=2,
                                                     method="rules"))
    got = sess.run(fetches, feed)
    want = oracle.loop_per_example_gradients(sess, ys, xs, feed)
    common.assert_all_close(got[0], want, what=f"{what}: per-example gradients", **tolerance)
    want_norms = np.sqrt(sum(np.sum(g.reshape(len(g), -1) ** 2, axis=1) for g in want))
    common.assert_all_close([got[1]], [want_norms], what=f"{what}: norms", **tolerance)
    common.assert_all_close([g.sum(axis=0) for g in got[0]], got[2],
                            what=f"{what}: sum over examples", **tolerance)
    if micro:
        common.assert_all_close(got[3], oracle.loop_microbatch_gradients(sess, ys, xs, feed, 2),
                                what=f"{what}: microbatch gradients", **tolerance)
    assert all(np.abs(g).max() > 0 for g in want), f"{what}: a weight has zero gradients"


def _check_dp_step_against_loop(sess, ys, xs, feed, what):
    """A DP step's gradient (noise 0, clip norm the median example norm, so that some
    examples are clipped and some not) against the loop's clipped mean."""
    per_example = oracle.loop_per_example_gradients(sess, ys, xs, feed)
    norms, _ = common.loop_clipped_mean(per_example, 1.0)
    clip = float(np.median(norms))
    _, want = common.loop_clipped_mean(per_example, clip)
    dp = pertower.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                              l2_norm_clip=clip, noise_multiplier=0.0)
    got = sess.run([tf.convert_to_tensor(g) for g, _ in
                    dp.compute_gradients(ys, var_list=xs)], feed)
    common.assert_all_close(got, want, what=f"{what}: DP gradient", kind="deep")


def _direct(plan, k):
    """Whether weight k's uses pull back directly (no vectorized VJP)."""
    return all(getattr(u.rule, "steps", None) is not None for u in plan.uses[k])


# -- the checks -------------------------------------------------------------------------

def check_weight_functions():
    """One graph, each weight behind a function of the weights alone: tanh(K) in a
    Conv2D, abs(W) and a weight-normalized g·v/||v|| in MatMuls, a transposed weight, a
    ConcatV2 of two partitions feeding a MatMul, and Conv2D weight norm over [0, 1, 2]."""
    with tf.Graph().as_default() as graph:
        rng = np.random.RandomState(60)
        x = tf.compat.v1.placeholder(tf.float32, [None, 5, 5, 2], name="x")

        def var(name, shape, low=-0.8, high=0.8):
            return tf.compat.v1.get_variable(name, initializer=rng.uniform(
                low, high, shape).astype(np.float32))

        kernel, conv_g = var("kernel", [3, 3, 2, 3]), var("conv_g", [4], 0.5, 1.5)
        conv_v = var("conv_v", [2, 2, 3, 4])
        w_abs, g, v = var("w_abs", [16, 6]), var("g", [5], 0.5, 1.5), var("v", [6, 5])
        w_t, p1, p2 = var("w_t", [4, 5]), var("part1", [2, 3]), var("part2", [2, 3])
        h = tf.nn.relu(tf.nn.conv2d(x, tf.tanh(kernel), 1, "VALID"))     # [B, 3, 3, 3]
        # a Conv2D kernel normalized per output channel: g v / ||v|| over [0, 1, 2]
        normalized = conv_g * conv_v * tf.math.rsqrt(
            tf.reduce_sum(tf.square(conv_v), axis=[0, 1, 2]))             # [2, 2, 3, 4]
        h = tf.nn.conv2d(h, normalized, 1, "VALID")                      # [B, 2, 2, 4]
        h = tf.tanh(tf.matmul(tf.reshape(h, [-1, 16]), tf.abs(w_abs)))   # [B, 6]
        h = tf.tanh(tf.matmul(h, g * v / tf.norm(v, axis=0)))            # [B, 5]
        h = tf.tanh(tf.matmul(h, tf.transpose(w_t)))                     # [B, 4]
        h = tf.matmul(h, tf.concat([p1, p2], axis=0))                    # [B, 3]
        ys = tf.reduce_sum(tf.sin(h) * tf.constant([1.0, -0.5, 2.0]), axis=1)   # [B]
        xs = [kernel, conv_g, conv_v, w_abs, g, v, w_t, p1, p2]
        plan, through = _plan_through(ys, xs)
        for name, op_type in (("kernel", "Tanh"), ("w_abs", "Abs"), ("g", "RealDiv"),
                              ("v", "RealDiv"), ("w_t", "Transpose"), ("part1", "ConcatV2"),
                              ("part2", "ConcatV2"), ("conv_v", "Rsqrt")):
            assert "through" in through[f"{name}:0"] and f"({op_type})" in through[
                f"{name}:0"], f"{name}: {through[f'{name}:0']}"
        names = [w.name for w in plan.weights]
        assert [_direct(plan, names.index(n)) for n in ("w_t:0", "part1:0", "part2:0")] == [
            True, True, True], "re-layouts and concat slices pull back directly"
        assert not _direct(plan, names.index("v:0")), "weight norm needs the VJP"
        sess = _session(graph)
        feed = {x: rng.randn(B, 5, 5, 2).astype(np.float32)}
        _check_against_loop(sess, ys, xs, feed, "weight functions", micro=True)
        return str(plan)


def check_partitioned_variable():
    """A `get_variable` with a fixed_size_partitioner: its value is the ConcatV2 of the
    parts, each part an entry of xs, pulled back by slicing the MatMul's rule."""
    with tf.Graph().as_default() as graph:
        common.seed_weights(67)
        x = tf.compat.v1.placeholder(tf.float32, [None, 5], name="x")
        weight = tf.compat.v1.get_variable(
            "partitioned", [5, 3], partitioner=tf.compat.v1.fixed_size_partitioner(2))
        ys = tf.reduce_sum(tf.sin(tf.matmul(x, weight)), axis=1)          # [B]
        xs = list(weight)
        assert [p.shape.as_list() for p in xs] == [[3, 3], [2, 3]]
        plan, through = _plan_through(ys, xs)
        assert all("(ConcatV2)" in ops for ops in through.values()), through
        assert _direct(plan, 0) and _direct(plan, 1)
        sess = _session(graph)
        feed = {x: np.random.RandomState(68).randn(B, 5).astype(np.float32)}
        _check_against_loop(sess, ys, xs, feed, "partitioned variable")


def check_mixed_float16_dense():
    """Keras Dense and Conv2D layers under the mixed_float16 policy: float32 master
    weights cast to float16 before the MatMul, Conv2D and BiasAdd."""
    with tf.Graph().as_default() as graph:
        common.seed_weights(61)
        x = tf.compat.v1.placeholder(tf.float32, [None, 4, 4, 2], name="x")
        labels = tf.compat.v1.placeholder(tf.int32, [None], name="labels")
        # each layer's own policy (the global one needs V2 dtype behaviour, which
        # disable_v2_behavior() turns off)
        mixed = keras.mixed_precision.Policy("mixed_float16")
        inputs = keras.Input((4, 4, 2))
        h = keras.layers.Conv2D(3, 3, activation="tanh", dtype=mixed)(inputs)   # [B, 2, 2, 3]
        h = keras.layers.Dense(6, activation="tanh", dtype=mixed)(
            keras.layers.Flatten(dtype=mixed)(h))
        h = keras.layers.Dense(5, dtype=mixed)(h)
        model = keras.Model(inputs, keras.layers.Dense(4, dtype="float32")(h))
        logits = model(x)                                                # [B, 4] float32
        ys = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
        xs = list(model.trainable_weights)
        assert all(w.dtype == tf.float32 for w in xs)
        plan, through = _plan_through(ys, xs)
        casts = [name for name, ops in through.items() if "(Cast)" in ops]
        assert len(casts) == 6, f"the float16 layers' weights are read through a Cast: {through}"
        names = [w.name for w in plan.weights]
        assert all(_direct(plan, names.index(n)) for n in casts), "casts pull back directly"
        sess = _session(graph)
        rng = np.random.RandomState(62)
        feed = {x: rng.randn(B, 4, 4, 2).astype(np.float32),
                labels: rng.randint(0, 4, B).astype(np.int32)}
        _check_against_loop(sess, ys, xs, feed, "mixed_float16", tolerance=FLOAT16_TOLERANCE)
        return str(plan)


def _randomize(sess, layer, seed):
    rng = np.random.RandomState(seed)
    sess.run(tf.group([tf.compat.v1.assign(w, rng.uniform(low, high, w.shape).astype(
        np.float32)) for w, low, high in ((layer.gamma, 0.5, 1.5), (layer.beta, -0.3, 0.3),
                                          (layer.moving_mean, -0.3, 0.3),
                                          (layer.moving_variance, 0.5, 1.5))]))


def check_non_fused_batch_norm(rank):
    """Keras BatchNormalization in inference mode without the fused op: on 2-D input
    (Keras never fuses it) and on 4-D input with fused=False. Its gamma reaches the
    batch through scale = gamma·rsqrt(var + eps) (a Mul) and shift = beta - mean·scale
    (an AddV2), beta through the shift."""
    with tf.Graph().as_default() as graph:
        common.seed_weights(63)
        shape = [5] if rank == 2 else [4, 4, 2]
        x = tf.compat.v1.placeholder(tf.float32, [None] + shape, name="x")
        inputs = keras.Input(shape)
        if rank == 2:
            h = keras.layers.Dense(4)(inputs)
        else:
            h = keras.layers.Conv2D(3, 3)(inputs)                       # [B, 2, 2, 3]
        norm = keras.layers.BatchNormalization(fused=False if rank == 4 else None)
        h = keras.layers.Flatten()(keras.layers.ReLU()(norm(h)))
        model = keras.Model(inputs, keras.layers.Dense(3)(h))
        out = model(x, training=False)                                  # [B, 3]
        ys = tf.reduce_sum(tf.sin(out), axis=1)                          # [B]
        xs = list(model.trainable_weights)
        plan, through = _plan_through(ys, xs)
        assert not any(op.type.startswith("FusedBatchNorm") for op in graph.get_operations())
        assert "through" in through[norm.gamma.name] and "through" in through[norm.beta.name]
        sess = _session(graph)
        _randomize(sess, norm, 64 + rank)
        rng = np.random.RandomState(65)
        feed = {x: rng.randn(B, *shape).astype(np.float32)}
        _check_against_loop(sess, ys, xs, feed, f"non-fused batch norm on {rank}-D input")
        return str(plan)


def check_dp_step():
    """DPOptimizer (noise 0) through a non-fused batch norm (VJP), a weight norm (VJP),
    a transposed weight (direct) and a Cast: the clipped sum, one VJP per exit, against
    the loop's per-example gradients clipped in NumPy."""
    with tf.Graph().as_default() as graph:
        rng = np.random.RandomState(66)
        x = tf.compat.v1.placeholder(tf.float32, [None, 4], name="x")

        def var(name, shape, low=-0.8, high=0.8, dtype=np.float32):
            return tf.compat.v1.get_variable(name, initializer=rng.uniform(
                low, high, shape).astype(dtype))

        g, v, w_t = var("g", [3], 0.5, 1.5), var("v", [4, 3]), var("w_t", [2, 3])
        gamma, beta, w64 = var("gamma", [3], 0.5, 1.5), var("beta", [3]), var(
            "w64", [2, 2], dtype=np.float64)
        mean, variance = tf.constant([0.1, -0.2, 0.3]), tf.constant([0.5, 1.0, 1.5])
        h = tf.matmul(x, g * v / tf.norm(v, axis=0))                     # [B, 3]
        scale = gamma * tf.math.rsqrt(variance + 1e-3)
        h = tf.tanh(h * scale + (beta - mean * scale))                   # [B, 3]
        h = tf.matmul(h, tf.transpose(w_t))                              # [B, 2]
        h = tf.matmul(h, tf.cast(w64, tf.float32))                       # [B, 2]
        ys = tf.reduce_sum(tf.sin(h), axis=1)                            # [B]
        xs = [g, v, w_t, gamma, beta, w64]
        _plan_through(ys, xs)
        feed = {x: rng.randn(4, 4).astype(np.float32)}
        sess = _session(graph)
        per_example = oracle.loop_per_example_gradients(sess, ys, xs, feed)
        norms = np.sqrt(sum(np.sum(p.reshape(4, -1) ** 2, axis=1) for p in per_example))
        clip = float(np.median(norms))
        factors = clip / np.maximum(norms, clip)                          # [4]
        want = [np.tensordot(factors, p, axes=1) / 4 for p in per_example]
        dp = pertower.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                  l2_norm_clip=clip, noise_multiplier=0.0)
        grads_and_vars = dp.compute_gradients(ys, var_list=xs)
        got = sess.run([gv for gv, _ in grads_and_vars], feed)
        assert (norms > clip * 1.01).any() and (norms < clip * 0.99).any()
        # the graph computes in float32 (w64 too, after its Cast): float32's tight tolerances
        common.assert_all_close(got, want, what="DP gradient",
                                **common.tolerance(np.float32, "tight"))


def check_not_followed():
    """Not covered: a weight-only Mul with a random mask (DropConnect) and a Mul of the
    weight with the batch's size (a batch-dependent input); explain says why."""
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        w1 = tf.compat.v1.get_variable("w1", initializer=tf.ones([3, 2]))
        w2 = tf.compat.v1.get_variable("w2", initializer=tf.ones([2, 2]))
        mask = tf.cast(tf.random.uniform([3, 2]) > 0.5, tf.float32)
        h = tf.matmul(x, w1 * mask)
        size = tf.cast(tf.shape(x)[0], tf.float32)
        ys = tf.reduce_sum(tf.matmul(h, w2 * size), axis=1)
        plan = pertower.explain(ys, [w1, w2], batch_size=3)
        assert [w.method for w in plan.weights] == ["towers", "towers"], str(plan)
        assert "random or stateful" in plan.weights[0].reason, plan.weights[0].reason
        assert "'mul_1' (Mul)" in plan.weights[1].reason, plan.weights[1].reason


# -- tests (this process: graph mode, TF2 behaviour) --------------------------------------

def test_weight_functions_are_pulled_back_and_match_the_loop():
    check_weight_functions()


def test_partitioned_variable_matches_the_loop():
    check_partitioned_variable()


def test_mixed_float16_keras_layers_match_the_loop():
    check_mixed_float16_dense()


# the same scale and shift on 4-D input after a Conv2D with -m heavy (and in the legacy
# process's check_non_fused_batch_norms)
@pytest.mark.parametrize("rank", [2, pytest.param(4, marks=pytest.mark.heavy)])
def test_non_fused_keras_batch_norm_in_inference_mode_matches_the_loop(rank):
    check_non_fused_batch_norm(rank)


def test_dp_step_through_weight_functions_matches_numpy():
    check_dp_step()


def test_random_and_batch_dependent_weight_functions_are_not_followed():
    check_not_followed()

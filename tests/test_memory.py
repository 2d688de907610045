"""The memory guard: its estimate against the size of real results, its refusal's
words, the default limit, and the ways to change it."""

import math

import numpy as np
import pytest
import tensorflow as tf

import pertower
from pertower import oracle
from pertower import _dispatch
from pertower._guards import memory
from tests import cases
from tests import common


@pytest.fixture(scope="module")
def mlp_batch_size():
    """The shared `mlp` fixture (tests/conftest.py) with 6 examples in this module."""
    return 6


def _nbytes(values):
    return sum(np.asarray(v).nbytes for v in values)


def _weights(case):
    return sum(int(np.prod(x.shape.as_list())) for x in case.xs)


def test_estimate_matches_the_size_of_the_results(mlp):
    with mlp.graph.as_default():
        per_example = pertower.per_example_gradients(mlp.ys, mlp.xs, batch_size=mlp.B)
        micro = pertower.microbatch_gradients(mlp.ys, mlp.xs, num_microbatches=2,
                                              batch_size=mlp.B)
        jacobians = pertower.per_example_jacobians(mlp.outputs, mlp.xs, batch_size=mlp.B)
        estimates = [pertower.estimate_memory(mlp.ys, mlp.xs, batch_size=mlp.B),
                     pertower.estimate_memory(mlp.ys, mlp.xs, batch_size=mlp.B,
                                              num_microbatches=2),
                     pertower.estimate_memory(mlp.outputs, mlp.xs, batch_size=mlp.B,
                                              outputs_per_example=3)]
    values = mlp.sess.run([per_example, micro, jacobians], mlp.feed)
    P = _weights(mlp)
    for estimate, value, rows, K in zip(estimates, values, [6, 2, 6], [1, 1, 3]):
        assert estimate.num_weights == P
        assert estimate.result_bytes == _nbytes(value) == rows * K * P * 4
        # every weight of this MLP has a rule: no tower gradients are held
        assert estimate.tower_gradient_bytes == 0
    with mlp.graph.as_default():
        towers = pertower.estimate_memory(mlp.ys, mlp.xs, batch_size=mlp.B, method="towers")
    assert towers.result_bytes == towers.tower_gradient_bytes == 6 * P * 4
    # activations: the non-elementwise floating outputs from x to cost, per example,
    # x 6 examples x 4 bytes: the MatMuls of widths 16, 8, 3 and the slice out[:, :1]
    assert estimates[0].activation_bytes == 6 * 4 * (16 + 8 + 3 + 1)


def test_estimate_uses_batch_size_when_the_batch_axis_is_not_static(mlp):
    with mlp.graph.as_default():
        assert pertower.estimate_memory(mlp.ys, mlp.xs) is None  # B unknown
        estimate = pertower.estimate_memory(mlp.ys, mlp.xs, batch_size=1000)
    assert estimate.batch_size == 1000 and estimate.rows == 1000
    assert estimate.result_bytes == 1000 * _weights(mlp) * 4


def test_estimate_reads_a_static_batch_axis():
    case = cases.build_static_mlp(B=4)
    with case.graph.as_default():
        estimate = pertower.estimate_memory(case.ys, case.xs)
    assert estimate.batch_size == 4 and estimate.result_bytes == 4 * _weights(case) * 4
    case.sess.close()


def test_float64_weights_count_eight_bytes():
    case = cases.build_mlp(B=2, dtype=tf.float64, name="mlp64")
    with case.graph.as_default():
        estimate = pertower.estimate_memory(case.ys, case.xs, batch_size=2)
    assert estimate.result_bytes == 2 * _weights(case) * 8
    case.sess.close()


@pytest.mark.parametrize("function", ["per_example_gradients", "microbatch_gradients",
                                      "per_example_jacobians", "per_example_norms"])
def test_a_result_above_the_limit_is_refused_with_the_estimate_and_what_to_do(mlp, function):
    with mlp.graph.as_default():
        ops_before = len(mlp.graph.get_operations())
        ys = mlp.outputs if function == "per_example_jacobians" else mlp.ys
        # norms hold per-example gradients only where towers form them
        method = "towers" if function == "per_example_norms" else "auto"
        with pytest.raises(ValueError) as refusal:
            getattr(pertower, function)(ys, mlp.xs, batch_size=mlp.B, memory_limit=1000,
                                        method=method)
        assert len(mlp.graph.get_operations()) == ops_before  # refused before building
    message = str(refusal.value)
    for words in (f"pertower.{function}: the per-example result would need about",
                  "above the limit of 0.001 MB (the memory_limit you passed)",
                  "microbatch_gradients with fewer microbatches",
                  "smaller batch", "memory_limit=<bytes>", "memory_limit=float('inf')"):
        assert words in message, (words, message)
    assert ("per_example_norms if you only need the norms" in message) == (
        function != "per_example_norms")
    P = _weights(mlp)
    rows = "6 x 3 outputs x" if function == "per_example_jacobians" else "6 x"
    assert f"the result {rows} {P} weights" in message


def test_norms_by_rules_form_no_per_example_gradients_so_the_guard_lets_them_through(mlp):
    """Dense layers' norms come from ||a_i||^2 ||dz_i||^2 (no [B, P] result): a limit
    far below B x P bytes does not refuse them, and they equal the oracle's norms."""
    with mlp.graph.as_default():
        norms = pertower.per_example_norms(mlp.ys, mlp.xs, batch_size=mlp.B,
                                           memory_limit=1000)
        want = oracle.loop_per_example_gradients(mlp.sess, mlp.ys, mlp.xs, mlp.feed)
    want = np.sqrt(sum(np.sum(g.reshape(mlp.B, -1) ** 2, axis=1) for g in want))
    np.testing.assert_allclose(mlp.sess.run(norms, mlp.feed), want, rtol=1e-5)


def test_the_default_limit_is_half_the_physical_memory(mlp):
    physical = memory.physical_memory_bytes()
    assert physical > 0
    assert memory.default_memory_limit() == int(0.5 * physical)
    huge = int(memory.default_memory_limit() // (_weights(mlp) * 4)) + 1  # B over the limit
    with mlp.graph.as_default():
        with pytest.raises(ValueError, match=r"above the limit of .* \(the default, half of "
                                             r"this machine's physical memory\)"):
            pertower.per_example_gradients(mlp.ys, mlp.xs, batch_size=huge)


# the cnn (scenario 3: a [16384, 128] kernel, the largest estimate of the test models:
# 26 MB against the next 14 kB) by default, the others heavy
@pytest.mark.parametrize("name", [name if name == "cnn" else
                                  pytest.param(name, marks=pytest.mark.heavy)
                                  for name in cases.BUILDERS])
def test_no_refusal_by_default_on_the_test_models(name):
    case = cases.BUILDERS[name]()
    with case.graph.as_default():
        # make_plan runs the guard with the default limit: it would raise
        estimate = _dispatch.make_plan(case.ys, case.xs, None, case.B, validate=False).estimate
    assert estimate is not None and estimate.total_bytes < memory.default_memory_limit(), name
    case.sess.close()


def test_an_infinite_limit_switches_the_guard_off(mlp):
    with mlp.graph.as_default():
        huge = 10 ** 9   # 10^9 examples: far above any machine's memory
        plan = _dispatch.make_plan(mlp.ys, mlp.xs, None, huge, memory_limit=math.inf,
                                   validate=False)
        assert plan.estimate.total_bytes > memory.default_memory_limit()
        grads = pertower.per_example_gradients(mlp.ys, mlp.xs, batch_size=mlp.B,
                                               memory_limit=float("inf"))
    assert len(grads) == len(mlp.xs)


@pytest.mark.parametrize("bad", [0, -5, "1GB", True])
def test_a_bad_memory_limit_is_refused(mlp, bad):
    with mlp.graph.as_default():
        with pytest.raises(ValueError, match=r"`memory_limit` must be a positive number of "
                                             r"bytes, None .* or float\('inf'\)"):
            pertower.per_example_gradients(mlp.ys, mlp.xs, batch_size=mlp.B, memory_limit=bad)


def test_a_limit_of_1_3_times_the_result_is_enough_for_a_rules_covered_mlp():
    """The guard runs on the plan: the rules write the result once, so an MLP whose
    every weight has a rule needs little more than the result's own bytes."""
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(0)
        x = tf.compat.v1.placeholder(tf.float32, [None, 100])
        h = x
        for width in (256, 256):
            h = tf.compat.v1.layers.dense(h, width, tf.nn.relu)
        cost = tf.square(tf.compat.v1.layers.dense(h, 1))                  # [B, 1]
        xs = tf.compat.v1.trainable_variables()
        B = 32
        P = sum(int(np.prod(v.shape.as_list())) for v in xs)
        result_bytes = B * P * 4
        plan = pertower.explain(cost, xs, batch_size=B)
        assert all(w.method == "rules" for w in plan.weights), str(plan)
        assert plan.estimate.result_bytes == result_bytes
        assert plan.estimate.total_bytes <= 1.3 * result_bytes
        grads = pertower.per_example_gradients(cost, xs, batch_size=B,
                                               memory_limit=1.3 * result_bytes)
        with pytest.raises(ValueError, match="per-example result would need about"):
            pertower.per_example_gradients(cost, xs, batch_size=B, method="towers",
                                           memory_limit=1.3 * result_bytes)
        feed = {x: np.random.RandomState(0).randn(B, 100).astype(np.float32)}
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            want = oracle.loop_per_example_gradients(sess, cost, xs, feed)
            common.assert_all_close(sess.run(grads, feed), want, kind="deep", what="mlp")

"""Functions of a weight inside a TF2 while loop's body (issue 32, items 2 and 3): a kernel
split into gates (`GRU(reset_after=False)`, `LSTM(implementation=1)`), the `Cast` of every
mixed_float16 RNN, tanh(W), a row slice. Each is a weight-side placement of the loop's plan
(`pertower._loops.placements.Function`): the weights stay on the rules, per step, with no
batch_size, against the one-example loop at two fed batch sizes; per-example norms too
(formed, as a pulled-back gradient's norm is not the piece's).
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import pertower
from pertower import oracle
from tests import common

SIZES = (3, 4)          # two batch sizes fed to one graph
CLIP = 0.5
T, FEATURES, UNITS = 4, 3, 5


def _session_of(graph, build, batch_size):
    """In `graph`: `build(batch_size)` -> (ys [B], xs, [x], feature shape), seeded weights,
    its plan and the fetches of its per-example gradients and norms and a noiseless DP
    gradient (clipped to CLIP)."""
    with graph.as_default():
        common.seed_weights(3)
        ys, xs, batch, shape = build(batch_size)
        plan = pertower.explain(ys, xs, batch=batch)
        dp = pertower.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                  l2_norm_clip=CLIP, noise_multiplier=0.0)
        fetches = [pertower.per_example_gradients(ys, xs, batch=batch),
                   pertower.per_example_norms(ys, xs, batch=batch),
                   [g for g, _ in dp.compute_gradients(ys, xs, batch=batch)]]
        loop = oracle.SliceLoop(ys, xs)
        sess = tf.compat.v1.Session(graph=graph)
        sess.run(tf.compat.v1.global_variables_initializer())
    return sess, plan, fetches, loop, batch[0], shape


def _check(build, tol=None, static=False):
    """Asserts every weight of `build`'s graph is on the rules with a read per step, and
    compares per-example gradients, norms and a noiseless DP gradient with the one-example loop at two fed batch
    sizes (with a None batch dimension; when `static`, a graph with batch dimension 3
    too, against the same loop) with the tolerances `tol` (default the "deep" ones)."""
    sess, plan, fetches, loop, x, shape = _session_of(tf.Graph(), build, None)
    for row in plan.weights:
        assert row.method == "rules", f"{row}\n{plan}"
        assert any("per step" in op for op in row.ops), f"{row}\n{plan}"
    static_run = _session_of(tf.Graph(), build, SIZES[0]) if static else None
    try:
        for B in SIZES:
            feed = {x: np.random.RandomState(B).randn(B, *shape).astype(np.float32)}
            want = loop.run(sess, feed, B)
            want_norms, want_dp = common.loop_clipped_mean(want, CLIP)
            runs = [(sess, fetches, feed)]
            if static_run is not None and B == SIZES[0]:
                runs.append((static_run[0], static_run[2], {static_run[4]: feed[x]}))
            for session, found, fed in runs:
                got, got_norms, got_dp = session.run(found, fed)
                what = f"B={B}{' static' if session is not sess else ''}"
                common.assert_all_close(got, want, kind="deep", what=f"gradients {what}",
                                        **(tol or {}))
                common.assert_all_close([got_norms], [want_norms], kind="deep",
                                        what=f"norms {what}", **(tol or {}))
                common.assert_all_close(got_dp, want_dp, kind="deep", what=f"DP {what}",
                                        **(tol or {}))
    finally:
        sess.close()
        if static_run is not None:
            static_run[0].close()
    return plan


def _recurrent(layer):
    """x [B, T, FEATURES] -> `layer()` (return_sequences) -> ys = sum of squares, [B]."""
    def build(batch_size):
        x = tf.compat.v1.placeholder(tf.float32, [batch_size, T, FEATURES], name="x")
        h = tf.cast(layer()(x), tf.float32)                                     # [B, T, U]
        ys = tf.reduce_sum(h ** 2, axis=[1, 2])                                 # [B]
        return ys, tf.compat.v1.trainable_variables(), [x], [T, FEATURES]
    return build


def test_gru_reset_after_false_slices_its_recurrent_kernel():
    """GRU(reset_after=False) reads recurrent_kernel[:, :2u] and [:, 2u:] (StridedSlice)."""
    _check(_recurrent(lambda: keras.layers.GRU(UNITS, reset_after=False,
                                               return_sequences=True)), static=True)


def test_lstm_implementation_1_splits_its_kernels():
    """LSTM(implementation=1) splits kernel and bias into gates (Split) and slices
    recurrent_kernel (StridedSlice)."""
    _check(_recurrent(lambda: keras.layers.LSTM(UNITS, implementation=1,
                                                return_sequences=True)))


def test_mixed_float16_gru_casts_its_weights_in_the_body():
    """Under mixed_float16 the body reads each weight through a Cast to float16."""
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        _check(_recurrent(lambda: keras.layers.GRU(UNITS, return_sequences=True)),
               tol=dict(rtol=1e-2, atol=1e-3))   # both sides compute in float16
    finally:
        keras.mixed_precision.set_global_policy(previous)


def test_tanh_cast_and_a_row_slice_of_a_weight_in_a_raw_while_loop():
    """tf.while_loop: h @ tanh(w)[:3] + cast(b) (b float64, summed in float32), with a
    None and a static batch dimension."""
    def build(batch_size):
        x = tf.compat.v1.placeholder(tf.float32, [batch_size, 3], name="x")
        w = tf.compat.v1.get_variable("w", [4, 3])
        b = tf.compat.v1.get_variable("b", [3], dtype=tf.float64)

        def body(i, h):
            kernel = tf.tanh(w)[:3]                                             # [3, 3]
            return i + 1, tf.tanh(tf.nn.bias_add(tf.matmul(h, kernel), tf.cast(b, tf.float32)))

        _, h = tf.while_loop(lambda i, h: i < 3, body, [tf.constant(0), x])
        return tf.reduce_sum(h ** 2, axis=1), [w, b], [x], [3]

    _check(build, tol=dict(rtol=1e-4, atol=1e-5), static=True)


@pytest.mark.parametrize("step", [
    lambda z, scale, shift: z * scale + shift,
    lambda z, scale, shift: tf.maximum(z / tf.exp(scale), shift[None]),
], ids=["scale and shift", "divided, floored"])
def test_broadcast_weights_of_the_state_in_a_raw_while_loop(step):
    """tf.while_loop: h <- tanh(step(h @ w, scale, shift)), scale [3] and shift [3] read by
    two-input broadcast ops (Mul, AddV2; RealDiv by exp(scale), Maximum with shift [1, 3])
    whose other input carries the batch: on the rules per step, rebuilt on each step's
    input, with a None and a static batch dimension."""
    def build(batch_size):
        x = tf.compat.v1.placeholder(tf.float32, [batch_size, 3], name="x")
        w = tf.compat.v1.get_variable("w", [3, 3])
        scale = tf.compat.v1.get_variable("scale", [3])
        shift = tf.compat.v1.get_variable("shift", [3])

        def body(i, h):
            return i + 1, tf.tanh(step(tf.matmul(h, w), scale, shift))

        _, h = tf.while_loop(lambda i, h: i < 3, body, [tf.constant(0), x])
        return tf.reduce_sum(h ** 2, axis=1), [w, scale, shift], [x], [3]

    _check(build, tol=dict(rtol=1e-4, atol=1e-5), static=True)


@pytest.mark.parametrize("body, reader", [
    (lambda i, h, w: tf.tanh(w[0]) * h, "'mul' (Mul)"),
    (lambda i, h, w: tf.matmul(h, tf.tanh(w[i])), "'strided_slice' (StridedSlice)"),
], ids=["mixed with the batch", "sliced by the step"])
def test_a_function_of_the_weight_and_a_loop_value_is_a_read(body, reader):
    """tanh(w[0]) * h mixes the weight with batch data; w[i] differs at each step: both
    are reads (by a rule that does not cover them, [3, 3] broadcast along the batch axis,
    or by none), not weight-side functions; the weight stays on the towers and the plan
    names the op."""
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        w = tf.compat.v1.get_variable("w", [3, 3, 3])
        _, h = tf.while_loop(lambda i, h: i < 3, lambda i, h: (i + 1, tf.tanh(body(i, h, w))),
                             [tf.constant(0), x])
        plan = pertower.explain(tf.reduce_sum(h, axis=1), [w], batch=[x])
    (row,) = plan.weights
    assert row.method == "towers", str(plan)
    assert reader in row.reason, str(plan)


@pytest.mark.parametrize("function", [tf.identity, tf.tanh], ids=["read", "tanh"])
def test_a_weight_passed_to_the_next_step_stays_on_the_towers(function):
    """A body returning w (or tanh(w)) as a loop variable: the rules would miss the
    gradient through that variable (they returned wrong numbers before), so the weight
    stays on the towers and the plan says why."""
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        w = tf.compat.v1.get_variable("w", [3, 3])

        def body(i, h, c):
            kernel = function(w)
            return i + 1, tf.tanh(tf.matmul(h, kernel)), kernel

        _, h, c = tf.while_loop(lambda i, h, c: i < 3, body,
                                [tf.constant(0), x, tf.zeros([3, 3])])
        plan = pertower.explain(tf.reduce_sum(tf.matmul(h, c), axis=1), [w], batch=[x])
    (row,) = plan.weights
    assert row.method == "towers", str(plan)
    assert "to the next step" in row.reason, str(plan)


def test_a_nested_while_loop_stays_on_the_towers_and_says_so():
    """A while loop inside a loop body: the outer body is read (its callee from the outer
    library), and the plan names the nested loop as the reason for the towers."""
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        w = tf.compat.v1.get_variable("w", [3, 3])

        def inner(j, h):
            return j + 1, tf.tanh(tf.matmul(h, w))

        def body(i, h):
            return i + 1, tf.while_loop(lambda j, h: j < 2, inner, [tf.constant(0), h])[1]

        _, h = tf.while_loop(lambda i, h: i < 3, body, [tf.constant(0), x])
        plan = pertower.explain(tf.reduce_sum(h ** 2, axis=1), [w], batch=[x])
    (row,) = plan.weights
    assert row.method == "towers", str(plan)
    assert "nested while loop" in row.reason, str(plan)

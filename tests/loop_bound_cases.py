"""Graphs that pertower once answered with silently wrong numbers, each against the
one-example loop (`pertower.oracle`). Every check runs in both modes: in the test
process (TensorFlow 2 behaviour in graph mode: v2 `While` loops, resource variables)
by tests/test_loops_bounded_by_the_batch.py, and under tf.compat.v1.disable_v2_behavior() (v1
loops, reference variables, `Dimension` shapes) by tests/legacy/test_loops_bounded_by_the_batch.py
(`CHECKS` and `LEGACY_ONLY_CHECKS`; those of HEAVY in the heavy run).

Loops bounded by a reduction over the batch: `tf.reduce_max(lengths)` steps on the
batch, `lengths[i]` steps for example i alone. The analysis proves the loop only when
its body keeps each example's state fixed past its own end (dynamic_rnn's select on
`time >= sequence_length`); otherwise the default run-time check must catch it.
"""

import warnings

import numpy as np
import tensorflow as tf

import pertower
from pertower import oracle
from tests import common

__all__ = ["CHECKS", "LEGACY_ONLY_CHECKS"]

B, D, T = 4, 2, 5
LENGTHS = np.array([1, 3, 2, 4], dtype=np.int32)   # [B]: example 3 runs 4 steps, 0 runs 1


def loop_kind(graph):
    """"LoopCond" when `graph` has a v1 loop, "While" for a v2 loop, else ""."""
    types = {op.type for op in graph.get_operations()}
    return next((t for t in ("LoopCond", "While", "StatelessWhile") if t in types), "")


def _loop_model(bound, mask):
    """A while loop over a state h [B, D] with the weight w in its body and w2 after it:
    ys = sum((h_final @ w2)^2, 1), [B]. `bound(lengths)` gives the trip count, `mask`
    (None, "where" for tf.compat.v1.where on [B], "where_v2" for tf.where on [B, 1],
    "other" for a select on other lengths) how the body keeps h past an example's end."""
    x = tf.compat.v1.placeholder(tf.float32, [None, D], name="x")
    lengths = tf.compat.v1.placeholder(tf.int32, [None], name="lengths")
    others = tf.compat.v1.placeholder(tf.int32, [None], name="others")
    w = tf.compat.v1.get_variable("w", [D, D], initializer=tf.constant_initializer(
        [[0.5, -0.3], [0.2, 0.4]]))
    w2 = tf.compat.v1.get_variable("w2", [D, 3])
    steps = bound(lengths)

    def body(i, h):
        new = tf.tanh(tf.matmul(h, w) + 0.1)
        if mask == "where":
            new = tf.compat.v1.where(i >= lengths, h, new)
        elif mask == "where_v2":
            new = tf.where((i >= lengths)[:, None], h, new)
        elif mask == "other":
            new = tf.compat.v1.where(i >= others, h, new)
        return i + 1, new

    _, h = tf.compat.v1.while_loop(lambda i, h: i < steps, body, [tf.constant(0), x])
    ys = tf.reduce_sum(tf.matmul(h, w2) ** 2, axis=1)                     # [B]
    rs = np.random.RandomState(1)
    feed = {x: rs.randn(B, D).astype(np.float32), lengths: LENGTHS,
            others: LENGTHS[::-1].copy()}
    return ys, [w, w2], feed


def _run(graph, ys, xs, feed, **kwargs):
    """(pertower's per-example gradients or the error fetching them raised, the loop's,
    the plan)."""
    plan = pertower.explain(ys, xs, batch_size=B)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        grads = pertower.per_example_gradients(ys, xs, batch_size=B, **kwargs)
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        want = oracle.loop_per_example_gradients(sess, ys, xs, feed)
        try:
            got = sess.run(grads, feed)
        except tf.errors.InvalidArgumentError as error:
            got = error
    want_kind = ("While", "StatelessWhile") if tf.compat.v1.control_flow_v2_enabled() else (
        "LoopCond",)
    assert loop_kind(graph) in want_kind, f"expected a {want_kind} loop, got {loop_kind(graph)!r}"
    return got, want, plan


def _proven_and_exact(bound, mask, what):
    with tf.Graph().as_default() as graph:
        common.seed_weights(31)
        ys, xs, feed = _loop_model(bound, mask)
        got, want, plan = _run(graph, ys, xs, feed)
    assert plan.verdict == "independent", f"{what}: not proven:\n{plan}"
    assert not isinstance(got, Exception), f"{what}: {got}"
    common.assert_all_close(got, want, kind="deep", what=what)
    return loop_kind(graph)


def _checked_and_caught(bound, mask, what):
    """Not proven; the default run-time check fails the fetch (the batch's rows differ
    from the examples' own), where the old verdict returned wrong rows."""
    with tf.Graph().as_default() as graph:
        common.seed_weights(31)
        ys, xs, feed = _loop_model(bound, mask)
        got, want, plan = _run(graph, ys, xs, feed)
    assert plan.verdict == "unproven", f"{what}: expected unproven:\n{plan}"
    assert plan.lost_at is not None and plan.lost_at[0].type in ("Max", "Min"), str(plan)
    assert "past the example's own end" in plan.lost_at[1], plan.lost_at[1]
    assert isinstance(got, tf.errors.InvalidArgumentError), (
        f"{what}: the run-time check let rows through that differ from the loop "
        f"by {max(float(np.max(np.abs(g - w))) for g, w in zip(got, want))}")
    assert "recomputed one slice of the batch at a time differs" in got.message, got.message
    return loop_kind(graph)


def check_max_bounded_loop_masked_by_where_is_proven_and_exact():
    """reduce_max(lengths) steps, h kept by tf.compat.v1.where(i >= lengths, h, new)."""
    return _proven_and_exact(tf.reduce_max, "where", "max, v1 where")


def check_max_bounded_loop_masked_by_broadcast_where_is_proven_and_exact():
    """max(1, reduce_max(lengths)) steps, h kept by tf.where((i >= lengths)[:, None], ...)."""
    return _proven_and_exact(lambda n: tf.maximum(1, tf.reduce_max(n)), "where_v2",
                      "max(1, max), broadcast where")


def check_max_bounded_loop_without_mask_is_checked_and_caught():
    """reduce_max(lengths) steps, no mask: every example runs the longest."""
    return _checked_and_caught(tf.reduce_max, None, "max, no mask")


def check_max_bounded_loop_masked_on_other_lengths_is_checked_and_caught():
    """reduce_max(lengths) steps, masked on another per-example tensor."""
    return _checked_and_caught(tf.reduce_max, "other", "max, masked on other lengths")


def check_min_bounded_loop_is_checked_and_caught():
    """reduce_min(lengths) steps: the batch stops every example at the shortest one's
    end, masked or not."""
    _checked_and_caught(tf.reduce_min, None, "min, no mask")
    return _checked_and_caught(tf.reduce_min, "where", "min, masked")


def check_dynamic_rnn_lstm_with_sequence_length_is_proven_without_check():
    """dynamic_rnn(LSTMCell, sequence_length): proven, no run-time check, exact."""
    with tf.Graph().as_default() as graph:
        common.seed_weights(32)
        x = tf.compat.v1.placeholder(tf.float32, [None, T, D], name="x")
        lengths = tf.compat.v1.placeholder(tf.int32, [None], name="lengths")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            outputs, state = tf.compat.v1.nn.dynamic_rnn(
                tf.compat.v1.nn.rnn_cell.LSTMCell(3), x, sequence_length=lengths,
                dtype=tf.float32)
        w = tf.compat.v1.get_variable("w", [3, 2])
        ys = (tf.reduce_sum(tf.tensordot(outputs, w, 1) ** 2, axis=[1, 2])
              + tf.reduce_sum(state.h ** 2, axis=1))                         # [B]
        xs = tf.compat.v1.trainable_variables()
        feed = {x: np.random.RandomState(2).randn(B, T, D).astype(np.float32),
                lengths: np.array([T, 2, 3, 1], dtype=np.int32)}
        got, want, plan = _run(graph, ys, xs, feed)
    assert plan.verdict == "independent" and not plan.validate, str(plan)
    assert not isinstance(got, Exception), str(got)
    common.assert_all_close(got, want, kind="deep", what="dynamic_rnn LSTMCell sequence_length")
    return loop_kind(graph)


# Gradients written in Python downstream of a v1 loop (issue 17, item 2): the weights
# read in the loop are computed by row passes (one backward pass of the batched graph
# per example), which only v1 loops use: these run under disable_v2_behavior() only.

@tf.custom_gradient
def _centred(h):
    """Identity whose backward centres dy over the batch (mixes the examples)."""
    def grad(dy):
        return dy - tf.reduce_mean(dy, axis=0, keepdims=True)
    return tf.identity(h), grad


@tf.custom_gradient
def _swish(h):
    """swish with its elementwise backward written by hand (row-wise)."""
    s = tf.sigmoid(h)

    def grad(dy):
        return dy * (s + h * s * (1.0 - s))
    return h * s, grad


_CENTRE_OVERRIDE = "PertowerNeverWrongCentre"


@tf.RegisterGradient(_CENTRE_OVERRIDE)
def _centre_gradient(op, dy):  # pylint: disable=unused-argument
    return dy - tf.reduce_mean(dy, axis=0, keepdims=True)


def _python_gradient_model(graph, kind):
    """A v1 loop with the weight w in its body, then `kind` ("centred", "override",
    "swish") on its result, then w2: ys = sum((f(h) @ w2)^2, 1), [B]."""
    x = tf.compat.v1.placeholder(tf.float32, [None, D], name="x")
    w = tf.compat.v1.get_variable("w", [D, D], initializer=tf.constant_initializer(
        [[0.5, -0.3], [0.2, 0.4]]))
    w2 = tf.compat.v1.get_variable("w2", [D, 3])
    _, h = tf.compat.v1.while_loop(lambda i, h: i < 3, lambda i, h: (
        i + 1, tf.tanh(tf.matmul(h, w))), [tf.constant(0), x])
    if kind == "centred":
        h = _centred(h)
    elif kind == "swish":
        h = _swish(h)
    else:
        with graph.gradient_override_map({"Identity": _CENTRE_OVERRIDE}):
            h = tf.identity(h, name="centred")
    ys = tf.reduce_sum(tf.matmul(h, w2) ** 2, axis=1)                       # [B]
    feed = {x: np.random.RandomState(3).randn(B, D).astype(np.float32)}
    return ys, [w, w2], feed


def check_row_passes_refuse_a_python_gradient_that_mixes_the_batch():
    """dy centred over the batch by tf.custom_gradient and by gradient_override_map:
    the loop's weight is refused naming the op; explain shows why."""
    for kind, op_name in (("centred", "'IdentityN'"), ("override", "'centred'")):
        with tf.Graph().as_default() as graph:
            common.seed_weights(33)
            ys, xs, _ = _python_gradient_model(graph, kind)
            plan = pertower.explain(ys, xs, batch_size=B)
            row = plan.weights[0]
            assert row.method == "passes" and "refused" in row.reason, str(plan)
            for call in (pertower.per_example_gradients, pertower.per_example_norms):
                try:
                    call(ys, xs, batch_size=B)
                except ValueError as error:
                    text = str(error)
                else:
                    raise AssertionError(f"{kind}: {call.__name__} was not refused")
                assert text.startswith(f"pertower.{call.__name__}: the weight 'w:0'"), text
                assert f"flows through {op_name}" in text and "mixes the examples" in text, text
                assert "reduces (Mean) over axis 0" in text, text
    return loop_kind(graph)


def check_row_passes_through_a_row_wise_python_gradient_match_the_loop():
    """swish with a hand-written elementwise backward (tf.custom_gradient): proven
    row-wise, the loop's weight is on the rules (per step), loop-exact."""
    with tf.Graph().as_default() as graph:
        common.seed_weights(34)
        ys, xs, feed = _python_gradient_model(graph, "swish")
        got, want, plan = _run(graph, ys, xs, feed)
    assert plan.weights[0].method == "rules", str(plan)
    assert not isinstance(got, Exception), str(got)
    common.assert_all_close(got, want, kind="deep", what="row-wise custom gradient")
    return loop_kind(graph)


LEGACY_ONLY_CHECKS = [check_row_passes_refuse_a_python_gradient_that_mixes_the_batch,
                      check_row_passes_through_a_row_wise_python_gradient_match_the_loop]


CHECKS = [check_max_bounded_loop_masked_by_where_is_proven_and_exact,
          check_max_bounded_loop_masked_by_broadcast_where_is_proven_and_exact,
          check_max_bounded_loop_without_mask_is_checked_and_caught,
          check_max_bounded_loop_masked_on_other_lengths_is_checked_and_caught,
          check_min_bounded_loop_is_checked_and_caught,
          check_dynamic_rnn_lstm_with_sequence_length_is_proven_without_check]


# The heavy run's checks (in both modes): the same outcome as a check of the default
# run on another loop (a proof through a broadcast where: ..._masked_by_where_...; a
# loop the run-time check catches: ..._without_mask_is_checked_and_caught).
HEAVY = frozenset({"check_max_bounded_loop_masked_by_broadcast_where_is_proven_and_exact",
                   "check_max_bounded_loop_masked_on_other_lengths_is_checked_and_caught",
                   "check_min_bounded_loop_is_checked_and_caught"})

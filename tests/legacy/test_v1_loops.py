"""TF1 (v1) while loops under tf.compat.v1.disable_v2_behavior(), or restored from a meta
graph: dynamic_rnn with each cell, bidirectional_dynamic_rnn, while_loop, map_fn and
scan, the legacy LSTM example, DP through row passes.

Each test builds a small graph with v1 control flow (Enter/Exit/NextIteration/LoopCond)
and compares pertower's per-example (or microbatch) results with the one-example loop
of `pertower.oracle`.
"""

import contextlib
import io
import os
import re
import runpy
import sys
import tempfile
import warnings

import numpy as np
import pytest
import tensorflow as tf

import pertower
from pertower import oracle
from tests import common

B, T, D, UNITS = 4, 5, 2, 3
_CELLS = tf.compat.v1.nn.rnn_cell


def _feed(x, lengths=None, rows=B):
    rs = np.random.RandomState(0)
    feed = {x: rs.randn(rows, T, D).astype(np.float32)}
    if lengths is not None:
        feed[lengths] = np.array([T, 2, 3, 1, 4, 5][:rows], dtype=np.int32)
    return feed


def _v1_loops_in(graph):
    return any(op.type == "LoopCond" for op in graph.get_operations())


def _assert_refused(error_type, pattern, call):
    """Asserts that `call()` raises `error_type` with a message that `pattern` matches
    (re.search, as pytest.raises(match=...))."""
    try:
        call()
    except error_type as error:
        assert re.search(pattern, str(error)), f"{pattern!r} not in: {error}"
        return
    raise AssertionError(f"no {error_type.__name__} matching {pattern!r} was raised")


def _compare(graph, ys, xs, feed, what, num_microbatches=None, **kwargs):
    """pertower's gradients (and, once, norms) against the loop; returns the plan."""
    assert _v1_loops_in(graph), f"{what}: no v1 while loop in the graph"
    groups = num_microbatches or B
    loop = oracle.SliceLoop(ys, xs)
    if num_microbatches is None:
        grads = pertower.per_example_gradients(ys, xs, batch_size=B, **kwargs)
    else:
        grads = pertower.microbatch_gradients(ys, xs, batch_size=B,
                                              num_microbatches=num_microbatches, **kwargs)
    plan = pertower.explain(ys, xs, batch_size=B, num_microbatches=num_microbatches)
    if plan.fallback:   # the memory line names what holds the fallback's gradients
        assert f"the {groups} row passes' gradients before stacking" in str(plan), str(plan)
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        got = sess.run(grads, feed)
        want = loop.run(sess, feed, groups)
    common.assert_all_close(got, want, kind="deep", what=what)
    return plan


def _rnn_model(make_cell, with_lengths=False):
    x = tf.compat.v1.placeholder(tf.float32, [None, T, D], name="x")
    lengths = (tf.compat.v1.placeholder(tf.int32, [None], name="lengths")
               if with_lengths else None)
    outputs, _ = tf.compat.v1.nn.dynamic_rnn(make_cell(), x, sequence_length=lengths,
                                             dtype=tf.float32)
    ys = tf.reduce_sum(tf.compat.v1.layers.dense(outputs, 2), axis=[1, 2])   # [B]
    return x, lengths, ys


def _dynamic_rnn_check(make_cell, what, with_lengths=False):
    with tf.Graph().as_default() as graph:
        common.seed_weights(21)
        x, lengths, ys = _rnn_model(make_cell, with_lengths)
        xs = tf.compat.v1.trainable_variables()
        plan = _compare(graph, ys, xs, _feed(x, lengths), what)
    methods = {w.method for w in plan.weights}
    assert methods == {"rules"}, f"{what}: the cell's weights on the rules per step:\n{plan}"
    assert plan.verdict == "independent", f"{what}: not proven:\n{plan}"
    return str(plan)


@pytest.mark.heavy
def test_v1_dynamic_rnn_lstm_matches_oracle():
    """dynamic_rnn(LSTMCell) under v1 control flow: the cell's weights on the rules per
    step (`pertower._loops.frames`), as the dense layer after it; explain says so."""
    text = _dynamic_rnn_check(lambda: _CELLS.LSTMCell(UNITS), "LSTMCell")
    assert "in the TF1 loop 'rnn/while' per step" in text, text
    print(text)


def test_v1_dynamic_rnn_gru_with_sequence_length_matches_oracle():
    """dynamic_rnn(GRUCell, sequence_length): max(sequence_length) only bounds the v1
    loop, so it is no coupling; the independence is proven."""
    print(_dynamic_rnn_check(lambda: _CELLS.GRUCell(UNITS), "GRUCell sequence_length",
                              with_lengths=True))


@pytest.mark.heavy
def test_v1_dynamic_rnn_basic_rnn_and_multi_rnn_cells_match_oracle():
    """BasicRNNCell, and MultiRNNCell of two LSTMCells with sequence_length."""
    _dynamic_rnn_check(lambda: _CELLS.BasicRNNCell(UNITS), "BasicRNNCell")
    print(_dynamic_rnn_check(
        lambda: _CELLS.MultiRNNCell([_CELLS.LSTMCell(UNITS), _CELLS.LSTMCell(2)]),
        "MultiRNNCell", with_lengths=True))


@pytest.mark.heavy
def test_v1_bidirectional_dynamic_rnn_microbatches_match_oracle():
    """bidirectional_dynamic_rnn with sequence_length (ReverseSequence inside), per
    example and in 2 microbatches, and the norms."""
    with tf.Graph().as_default() as graph:
        common.seed_weights(22)
        x = tf.compat.v1.placeholder(tf.float32, [None, T, D], name="x")
        lengths = tf.compat.v1.placeholder(tf.int32, [None], name="lengths")
        (fw, bw), _ = tf.compat.v1.nn.bidirectional_dynamic_rnn(
            _CELLS.LSTMCell(UNITS), _CELLS.GRUCell(2), x, sequence_length=lengths,
            dtype=tf.float32)
        ys = tf.reduce_sum(tf.concat([fw, bw], axis=2) ** 2, axis=[1, 2])   # [B]
        xs = tf.compat.v1.trainable_variables()
        feed = _feed(x, lengths)
        loop = oracle.SliceLoop(ys, xs)          # one loop for the three comparisons
        grads = pertower.per_example_gradients(ys, xs, batch_size=B)
        halves = pertower.microbatch_gradients(ys, xs, batch_size=B, num_microbatches=2)
        norms = pertower.per_example_norms(ys, xs, batch_size=B)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            got, got_halves, got_norms = sess.run([grads, halves, norms], feed)
            want, want_halves = loop.run(sess, feed, B), loop.run(sess, feed, 2)
        common.assert_all_close(got, want, kind="deep", what="bidirectional per example")
        common.assert_all_close(got_halves, want_halves, kind="deep",
                                what="bidirectional microbatches")
        squares = sum(np.sum(w.reshape(B, -1) ** 2, axis=1) for w in want)
        common.assert_all_close([got_norms], [np.sqrt(squares)], kind="deep", what="norms")


def test_v1_while_loop_with_a_weight_in_the_body_matches_oracle():
    """tf.compat.v1.while_loop whose body reads a weight (resource and reference
    variables), also with validate=True (the run-time check replays the v1 frame), and
    the per-example Jacobians."""
    with tf.Graph().as_default() as graph:
        common.seed_weights(23)
        x = tf.compat.v1.placeholder(tf.float32, [None, D], name="x")
        w = tf.compat.v1.get_variable("w", [D, D], initializer=tf.constant_initializer(
            [[0.5, -0.3], [0.2, 0.4]]))
        v = tf.compat.v1.get_variable("v", [D], use_resource=True,
                                      initializer=tf.constant_initializer([0.1, -0.2]))

        def body(i, h):
            return i + 1, tf.tanh(tf.matmul(h, w) + v)

        _, h = tf.compat.v1.while_loop(lambda i, h: i < 3, body, [tf.constant(0), x])
        ys = tf.reduce_sum(h ** 2, axis=1)   # [B]
        xs = [w, v]
        feed = {x: np.random.RandomState(1).randn(B, D).astype(np.float32)}
        assert _v1_loops_in(graph), "no v1 while loop in the graph"
        loop = oracle.SliceLoop(ys, xs)   # one loop and one session for the three
        grads = pertower.per_example_gradients(ys, xs, batch_size=B)
        checked = pertower.per_example_gradients(ys, xs, batch_size=B, validate=True)
        plan = pertower.explain(ys, xs, batch_size=B)
        if plan.fallback:   # the memory line names what holds the fallback's gradients
            assert f"the {B} row passes' gradients before stacking" in str(plan), str(plan)
        jacobians = pertower.per_example_jacobians(h, xs, batch_size=B)   # [B, D, *x.shape]
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            got, got_checked, got_jacobians = sess.run([grads, checked, jacobians], feed)
            want = loop.run(sess, feed, B)
            want_jacobians = oracle.loop_per_example_jacobians(sess, h, xs, feed)
        common.assert_all_close(got, want, kind="deep", what="while_loop")
        common.assert_all_close(got_checked, want, kind="deep",
                                what="while_loop validate=True")
        common.assert_all_close(got_jacobians, want_jacobians, kind="deep",
                                what="while_loop Jacobians")


def test_v1_while_loops_with_resource_variables_use_row_passes():
    """v1 loops with resource variables (use_resource=True): a weight read inside the
    loop, and a loop over the batch with the weight read after it. Weights no rule
    covers are computed by one backward pass per example (method "passes" in the plan),
    also when towers are asked for; method="rules" covers the weight read inside the
    loop (per step), and sparse=True refuses a table read into the loop."""
    with tf.Graph().as_default() as graph:
        common.seed_weights(31)
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        w = tf.compat.v1.get_variable("w", [3, 3], use_resource=True)
        _, h = tf.compat.v1.while_loop(lambda i, h: i < 2,
                                       lambda i, h: (i + 1, tf.matmul(h, w)),
                                       [tf.constant(0), x])
        assert _v1_loops_in(graph), "no v1 while loop in the graph"
        inside = tf.reduce_sum(h, axis=1)                                  # [B]
        # a v1 loop over the batch alone, the weight read after it
        _, doubled = tf.compat.v1.while_loop(lambda i, h: i < 2,
                                             lambda i, h: (i + 1, 2.0 * h),
                                             [tf.constant(0), x])
        after = tf.reduce_sum(tf.matmul(doubled, w) ** 2, axis=1)          # [B]
        plan = pertower.explain(inside, [w], batch_size=2, method="towers")
        assert [p.method for p in plan.weights] == ["passes"], str(plan)
        assert "TF1 (v1) while loop" in str(plan), str(plan)
        # the rules cover it too (pertower._loops.frames): per step, without batch_size
        plan = pertower.explain(inside, [w], method="rules")
        assert [p.method for p in plan.weights] == ["rules"], str(plan)
        table = tf.compat.v1.get_variable("table", [5, 3], use_resource=True)
        ids = tf.compat.v1.placeholder(tf.int32, [None], name="ids")
        _, looked_up = tf.compat.v1.while_loop(lambda i, h: i < 2,
                                               lambda i, h: (i + 1, h * h),
                                               [tf.constant(0), tf.gather(table, ids)])
        _assert_refused(ValueError, r"pertower.per_example_gradients: sparse=True keeps "
                                    r".*\(table:0\).*TF1 \(v1\) while loop.*Pass "
                                    r"sparse=False",
                        lambda: pertower.per_example_gradients(
                            tf.reduce_sum(looked_up, axis=1), [table], batch_size=2,
                            sparse=True))
        results = [pertower.per_example_gradients(inside, [w], batch_size=2),
                   pertower.per_example_gradients(inside, [w], batch_size=2,
                                                  method="towers"),
                   pertower.per_example_gradients(after, [w], batch_size=2)]
        loops = [oracle.SliceLoop(inside, [w]), oracle.SliceLoop(inside, [w]),
                 oracle.SliceLoop(after, [w])]
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            feed = {x: np.random.RandomState(3).randn(2, 3).astype(np.float32)}
            for grads, loop, what in zip(results, loops, ["inside", "inside, towers asked",
                                                          "after"]):
                common.assert_all_close(sess.run(grads, feed), loop.run(sess, feed, 2),
                                        what=f"weight read {what} the loop")


@pytest.mark.heavy
def test_v1_map_fn_and_scan_over_time_match_oracle():
    """tf.compat.v1.map_fn and tf.compat.v1.scan over the time axis (the batch stays
    on the elements' axis 0)."""
    with tf.Graph().as_default() as graph:
        common.seed_weights(24)
        x = tf.compat.v1.placeholder(tf.float32, [None, T, D], name="x")
        w = tf.compat.v1.get_variable("w", [D, UNITS])
        u = tf.compat.v1.get_variable("u", [UNITS, UNITS])
        time_major = tf.transpose(x, [1, 0, 2])                             # [T, B, D]
        mapped = tf.compat.v1.map_fn(lambda step: tf.tanh(tf.matmul(step, w)),
                                     time_major)                           # [T, B, U]
        states = tf.compat.v1.scan(lambda h, step: tf.tanh(tf.matmul(h, u) + step),
                                   mapped, initializer=tf.zeros_like(mapped[0]))
        ys = tf.reduce_sum(states[-1] ** 2, axis=1)                          # [B]
        plan = _compare(graph, ys, [w, u], _feed(x), "map_fn and scan over time")
        assert plan.verdict == "independent", str(plan)


@pytest.mark.heavy
def test_static_rnn_with_sequence_length_matches_oracle():
    """static_rnn with sequence_length: its v1 conds on max/min(sequence_length) pick a
    branch for the whole batch, which the analysis does not prove harmless: never
    refused, checked at run time instead, and the result matches the loop."""
    with tf.Graph().as_default() as graph:
        common.seed_weights(28)
        x = tf.compat.v1.placeholder(tf.float32, [None, T, D], name="x")
        lengths = tf.compat.v1.placeholder(tf.int32, [None], name="lengths")
        outputs, _ = tf.compat.v1.nn.static_rnn(
            _CELLS.GRUCell(UNITS), tf.unstack(x, axis=1), sequence_length=lengths,
            dtype=tf.float32)
        ys = tf.reduce_sum(tf.stack(outputs, axis=1) ** 2, axis=[1, 2])   # [B]
        xs = tf.compat.v1.trainable_variables()
        loop = oracle.SliceLoop(ys, xs)
        plan = pertower.explain(ys, xs, batch_size=B)
        assert not plan.couplings and plan.verdict == "unproven" and plan.validate, str(plan)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            grads = pertower.per_example_gradients(ys, xs, batch_size=B)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            feed = _feed(x, lengths)
            common.assert_all_close(sess.run(grads, feed), loop.run(sess, feed, B),
                                    kind="deep", what="static_rnn sequence_length")
        print(str(plan))


def test_v1_loop_restored_from_a_meta_graph_matches_oracle():
    """A dynamic_rnn graph exported and restored with import_meta_graph (the user
    cannot rebuild it): the restored graph works as it is."""
    with tf.Graph().as_default() as graph:
        common.seed_weights(26)
        x, lengths, ys = _rnn_model(lambda: _CELLS.LSTMCell(UNITS), with_lengths=True)
        tf.compat.v1.add_to_collection("ys", ys)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            path = os.path.join(tempfile.mkdtemp(), "model")
            tf.compat.v1.train.Saver().save(sess, path)
    with tf.Graph().as_default() as restored:
        saver = tf.compat.v1.train.import_meta_graph(path + ".meta")
        ys = tf.compat.v1.get_collection("ys")[0]
        xs = tf.compat.v1.trainable_variables()
        x, lengths = (restored.get_tensor_by_name(n) for n in ("x:0", "lengths:0"))
        loop = oracle.SliceLoop(ys, xs)
        grads = pertower.per_example_gradients(ys, xs, batch_size=B, validate=True)
        with tf.compat.v1.Session(graph=restored) as sess:
            saver.restore(sess, path)
            feed = _feed(x, lengths)
            common.assert_all_close(sess.run(grads, feed), loop.run(sess, feed, B),
                                    kind="deep", what="restored meta graph")


def test_v1_loop_training_op_built_after_a_run():
    """A training op built through the v1 loop after pertower's gradients have run in
    the session builds and runs (the user's loop ops are left as they were)."""
    with tf.Graph().as_default() as graph:
        common.seed_weights(27)
        x, lengths, ys = _rnn_model(lambda: _CELLS.GRUCell(UNITS), with_lengths=True)
        xs = tf.compat.v1.trainable_variables()
        grads = pertower.per_example_gradients(ys, xs, batch_size=B)
        feed = _feed(x, lengths)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(grads, feed)
            train = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(
                tf.reduce_mean(ys))
            sess.run(train, feed)


def test_build_towers_refuses_v1_loops_naming_the_alternative():
    """build_towers (towers with weight copies, by definition) cannot replay v1 loops:
    the refusal names the loop op and what to use instead."""
    with tf.Graph().as_default():
        _, _, ys = _rnn_model(lambda: _CELLS.LSTMCell(UNITS))
        try:
            pertower.build_towers(ys, tf.compat.v1.trainable_variables(), batch_size=2)
        except NotImplementedError as error:
            message = str(error)
            assert message.startswith("pertower.build_towers: "), message
            assert "TF1 (v1) while loop" in message, message
            assert "per_example_gradients" in message, message
            assert "enable_control_flow_v2" in message, message
            print(message)
            return
        raise AssertionError("build_towers replayed a v1 loop")


@pytest.mark.heavy
def test_legacy_lstm_example_runs_and_matches_the_loop():
    """examples/legacy_lstm.py (a few training steps) exits 0 and reports agreement with
    the one-example loop; run here, where v1 behaviour is already on for the process."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(root, "examples", "legacy_lstm.py")
    argv, buffer = sys.argv, io.StringIO()
    sys.argv = [path, "--batch-size", "4", "--steps", "3"]
    try:
        with tf.Graph().as_default(), contextlib.redirect_stdout(buffer), \
                contextlib.redirect_stderr(io.StringIO()):
            code = runpy.run_path(path)["main"]()
    finally:
        sys.argv = argv
    out = buffer.getvalue()
    assert code == 0, out
    assert ("OK: per-example gradients and norms match the one-example loop (4 examples, "
            "5 weights") in out, out
    assert "per step" in out and "trained 3 DP-SGD steps" in out, out
    print(out)


def test_v1_dp_optimizer_clips_row_pass_gradients():
    """DPOptimizer (one microbatch per example, noise 0) on a dynamic_rnn whose cell
    weights are computed by row passes: the step's gradient is the mean of the loop's
    per-example gradients, each clipped to l2_norm_clip (half the median norm, so
    every example is clipped)."""
    with tf.Graph().as_default() as graph:
        common.seed_weights(23)
        x, _, ys = _rnn_model(lambda: _CELLS.LSTMCell(UNITS))
        xs = tf.compat.v1.trainable_variables()
        loop = oracle.SliceLoop(ys, xs)
        feed = _feed(x)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            per_example = loop.run(sess, feed, B)                      # [B, *x.shape] each
        norms = np.sqrt(sum(np.sum(g.reshape(B, -1) ** 2, axis=1) for g in per_example))
        clip = 0.5 * float(np.median(norms))
        factors = np.minimum(1.0, clip / norms)                        # [B]
        want = [np.tensordot(factors, g, axes=1) / B for g in per_example]
        dp = pertower.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                  l2_norm_clip=clip, noise_multiplier=0.0)
        pairs = dp.compute_gradients(ys, var_list=xs, batch_size=B)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            got = sess.run([g for g, _ in pairs], feed)
    common.assert_all_close(got, want, 1e-4, 1e-6, "DP step through row passes")

"""Proofs through TF1 (v1) loops (issue 17, items 9, 10 and 13), under
tf.compat.v1.disable_v2_behavior().

* dynamic_rnn's final state (every cell, with and without sequence_length) is proven;
* tf.compat.v1.map_fn over the batch (one example per iteration) is proven, whatever
  the body reduces of its one example; a loop that carries one example's value into
  the next (scan over the batch) or mixes the element with the other examples is not;
* raw_rnn written as in its docstring is not proven (its loop runs until every
  example is finished), and the default run-time check runs and passes.

Each compares pertower with the one-example loop of `pertower.oracle` and reads the
verdict from `pertower.explain`.
"""

import warnings

import numpy as np
import pytest
import tensorflow as tf

import pertower
from pertower import oracle
from tests import common

B, T, D, UNITS, CLASSES = 4, 5, 2, 3, 3
_CELLS = tf.compat.v1.nn.rnn_cell
_LENGTHS = np.array([T, 2, 3, 1], dtype=np.int32)


def _inputs(seed, shape):
    return np.random.RandomState(seed).randn(*shape).astype(np.float32)


def _compare(graph, ys, xs, feed, what, validate=None):
    """pertower's per-example gradients against the loop's; returns explain's plan."""
    assert any(op.type == "LoopCond" for op in graph.get_operations()), \
        f"{what}: no v1 while loop in the graph"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        grads = pertower.per_example_gradients(ys, xs, batch_size=B, validate=validate)
        plan = pertower.explain(ys, xs, batch_size=B)
    loop = oracle.SliceLoop(ys, xs)
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        got = sess.run(grads, feed)
        want = loop.run(sess, feed, B)
    common.assert_all_close(got, want, kind="deep", what=what)
    assert any(np.abs(w).max() > 0 for w in want), f"{what}: every gradient is zero"
    return plan


def _assert_proven(plan, what):
    text = str(plan)
    assert plan.verdict == "independent", f"{what}: not proven:\n{text}"
    assert "independence: proven" in text, text
    assert not plan.validate, f"{what}: a proven plan adds no run-time check:\n{text}"


# -- item 10: dynamic_rnn's final state, each cell --------------------------------------

def _final_state_check(make_cell, final, what, with_lengths):
    with tf.Graph().as_default() as graph:
        common.seed_weights(31)
        x = tf.compat.v1.placeholder(tf.float32, [None, T, D], name="x")
        labels = tf.compat.v1.placeholder(tf.int32, [None], name="labels")
        lengths = (tf.compat.v1.placeholder(tf.int32, [None], name="lengths")
                   if with_lengths else None)
        _, state = tf.compat.v1.nn.dynamic_rnn(make_cell(), x, sequence_length=lengths,
                                               dtype=tf.float32)
        logits = tf.compat.v1.layers.dense(final(state), CLASSES)
        ys = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
        feed = {x: _inputs(0, (B, T, D)), labels: np.array([0, 2, 1, 2], np.int32)}
        if with_lengths:
            feed[lengths] = _LENGTHS
        plan = _compare(graph, ys, tf.compat.v1.trainable_variables(), feed, what)
    _assert_proven(plan, what)
    methods = {w.method for w in plan.weights}
    assert methods == {"rules"}, f"{what}:\n{plan}"   # the cell's per step (pertower._loops.frames)
    return str(plan)


@pytest.mark.heavy
def test_v1_dynamic_rnn_final_state_of_each_cell_is_proven():
    """GRUCell, BasicRNNCell, LSTMCell and MultiRNNCell: ys from the final state
    through SparseSoftmaxCrossEntropyWithLogits, without sequence_length."""
    cells = [(lambda: _CELLS.GRUCell(UNITS), lambda s: s, "GRUCell"),
             (lambda: _CELLS.BasicRNNCell(UNITS), lambda s: s, "BasicRNNCell"),
             (lambda: _CELLS.LSTMCell(UNITS), lambda s: s.h, "LSTMCell"),
             (lambda: _CELLS.MultiRNNCell([_CELLS.GRUCell(UNITS), _CELLS.BasicRNNCell(2)]),
              lambda s: s[-1], "MultiRNNCell")]
    print("\n".join(_final_state_check(make, final, what, False)
                     for make, final, what in cells))


@pytest.mark.heavy
def test_v1_dynamic_rnn_final_state_with_sequence_length_is_proven():
    """The same cells with sequence_length: the final state's select on it copies each
    example's state through past its own end."""
    cells = [(lambda: _CELLS.GRUCell(UNITS), lambda s: s, "GRUCell lengths"),
             (lambda: _CELLS.BasicRNNCell(UNITS), lambda s: s, "BasicRNNCell lengths"),
             (lambda: _CELLS.LSTMCell(UNITS), lambda s: s.c, "LSTMCell lengths")]
    print("\n".join(_final_state_check(make, final, what, True)
                     for make, final, what in cells))


# -- item 13: tf.compat.v1.map_fn over the batch -----------------------------------------

def _map_fn_plan(body, what, seed):
    """ys = map_fn(body(w, row), x) over the batch [B, D]; returns explain's plan."""
    with tf.Graph().as_default() as graph:
        common.seed_weights(seed)
        x = tf.compat.v1.placeholder(tf.float32, [None, D], name="x")
        w = tf.compat.v1.get_variable("w", [D, D])
        ys = body(w, x)
        return _compare(graph, ys, [w], {x: _inputs(seed, (B, D))}, what)


@pytest.mark.heavy
def test_v1_map_fn_over_the_batch_is_proven():
    """Bodies that reduce every axis of their one example (sum, max, a norm), a body
    returning a vector, and map_fn followed by batch-wise ops: all proven."""
    bodies = [
        ("sum", lambda w, x: tf.compat.v1.map_fn(
            lambda row: tf.reduce_sum(tf.tanh(tf.linalg.matvec(w, row, True))), x)),
        ("max and norm", lambda w, x: tf.compat.v1.map_fn(
            lambda row: tf.reduce_max(tf.linalg.matvec(w, row, True))
            + tf.norm(tf.sigmoid(row * tf.reduce_sum(w))), x)),
        ("vector then batch ops", lambda w, x: tf.reduce_sum(tf.compat.v1.map_fn(
            lambda row: tf.tanh(tf.linalg.matvec(w, row, True)) / tf.reduce_sum(row ** 2),
            x) ** 2, axis=1)),
        ("softmax of one example", lambda w, x: tf.compat.v1.map_fn(
            lambda row: tf.reduce_sum(tf.nn.softmax(tf.linalg.matvec(w, row, True)) * row),
            x)),
    ]
    texts = []
    for seed, (what, body) in enumerate(bodies):
        plan = _map_fn_plan(body, f"map_fn over the batch ({what})", 40 + seed)
        _assert_proven(plan, what)
        texts.append(str(plan))
    print("\n".join(texts))


def test_v1_loops_over_the_batch_that_mix_examples_are_not_proven():
    """scan over the batch carries example i's value into example i + 1's iteration,
    and a map_fn body that reads the whole batch mixes the examples: neither is
    proven (the run-time check is added), and the check finds the scan's coupling."""
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, D], name="x")
        w = tf.compat.v1.get_variable("w", [D, D])
        states = tf.compat.v1.scan(lambda h, row: tf.tanh(tf.linalg.matvec(w, row + h, True)),
                                   x, initializer=tf.zeros([D]))
        scanned = tf.reduce_sum(states, axis=1)
        plan = pertower.explain(scanned, [w], batch_size=B)
        assert plan.verdict == "unproven", str(plan)
        assert "(the element a loop over the batch's examples reads)" in str(plan) or (
            "carries one example's value into the next" in str(plan)), str(plan)
        assert plan.validate, str(plan)
        _assert_check_fails(scanned, w, {x: _inputs(5, (B, D))}, "scan over the batch")

        mixed = tf.compat.v1.map_fn(
            lambda row: tf.reduce_sum(tf.linalg.matvec(w, row, True) * x), x)
        plan = pertower.explain(mixed, [w], batch_size=B)
        assert plan.verdict == "unproven" and plan.validate, str(plan)
        _assert_check_fails(mixed, w, {x: _inputs(6, (B, D))}, "map_fn reading the batch")
    print(str(plan))


def _assert_check_fails(ys, w, feed, what):
    """The default run-time check stops the run: row i of `ys` recomputed from example
    i alone differs from the batch's."""
    grads = pertower.per_example_gradients(ys, [w], batch_size=B)
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        try:
            sess.run(grads, feed)
        except tf.errors.InvalidArgumentError as error:
            assert "recomputed one" in str(error), f"{what}: {error}"
        else:
            raise AssertionError(f"{what}: the run-time check let it through")


# -- item 9: raw_rnn as in its docstring ------------------------------------------------

def _raw_rnn(make_cell, x, lengths):
    """tf.compat.v1.nn.raw_rnn as its docstring writes it (time-major inputs in a
    TensorArray, elements_finished from sequence_length, tf.cond on all finished)."""
    inputs = tf.transpose(x, [1, 0, 2])
    inputs_ta = tf.TensorArray(dtype=tf.float32, size=T).unstack(inputs)
    cell = make_cell()
    batch_size = tf.shape(x)[0]

    def loop_fn(time, cell_output, cell_state, loop_state):
        emit_output = cell_output
        if cell_output is None:
            next_cell_state = cell.zero_state(batch_size, tf.float32)
        else:
            next_cell_state = cell_state
        elements_finished = time >= lengths
        finished = tf.reduce_all(elements_finished)
        next_input = tf.cond(finished, lambda: tf.zeros([batch_size, D], dtype=tf.float32),
                             lambda: inputs_ta.read(time))
        return elements_finished, next_input, next_cell_state, emit_output, None

    outputs_ta, final_state, _ = tf.compat.v1.nn.raw_rnn(cell, loop_fn)
    return outputs_ta.stack(), final_state


@pytest.mark.heavy
def test_v1_raw_rnn_is_checked_at_run_time_and_matches_oracle():
    """raw_rnn with BasicRNNCell, GRUCell and LSTMCell: its loop runs until every
    example has finished (rnn/All), so the proof is lost there; the default run-time
    check replays the loop (its cond's constants and the inputs' TensorArray with it)
    and the numbers match the loop, from the final state and from the outputs."""
    cells = [(lambda: _CELLS.BasicRNNCell(UNITS), lambda o, s: s, "BasicRNNCell state"),
             (lambda: _CELLS.GRUCell(UNITS), lambda o, s: tf.reduce_sum(o, 0), "GRUCell outputs"),
             (lambda: _CELLS.LSTMCell(UNITS), lambda o, s: s.h, "LSTMCell state")]
    texts = []
    for seed, (make_cell, final, what) in enumerate(cells):
        with tf.Graph().as_default() as graph:
            common.seed_weights(50 + seed)
            x = tf.compat.v1.placeholder(tf.float32, [None, T, D], name="x")
            lengths = tf.compat.v1.placeholder(tf.int32, [None], name="lengths")
            outputs, state = _raw_rnn(make_cell, x, lengths)
            ys = tf.reduce_sum(final(outputs, state) ** 2, axis=1)
            plan = _compare(graph, ys, tf.compat.v1.trainable_variables(),
                            {x: _inputs(seed, (B, T, D)), lengths: _LENGTHS}, what)
        text = str(plan)
        assert plan.verdict == "unproven" and plan.validate, f"{what}:\n{text}"
        assert "run-time check: added" in text, text
        texts.append(text)
    print("\n".join(texts))

"""weights read inside TF1 (v1) while frames on the rules
(`pertower._loops.frames`), under tf.compat.v1.disable_v2_behavior() (reference
variables, control flow v1), against the one-example oracle.

`tf.compat.v1.nn.dynamic_rnn` with LSTMCell, GRUCell and BasicRNNCell, with and without
sequence_length, batch-major and time-major; a hand-written tf.while_loop over reference
variables; a scale and a shift of the state (broadcast weights) in a frame; a frame the
copy cannot reproduce (a random op in its body) keeps its row passes. Every model is fed
two batch sizes through a None batch dimension, without batch_size: per-example
gradients, norms, a noiseless DPOptimizer gradient and two microbatches against the loop
(the default run's LSTM: gradients and norms).
"""

import numpy as np
import pytest
import tensorflow as tf

import pertower
from pertower import oracle
from tests import common

T, D, UNITS, CLIP = 4, 3, 5, 0.3
SIZES = (3, 4)
_CELLS = tf.compat.v1.nn.rnn_cell


def _clipped_mean(per_example, clip):
    B = per_example[0].shape[0]
    norms = np.sqrt(sum(np.sum(g.reshape(B, -1) ** 2, axis=1) for g in per_example))
    factors = clip / np.maximum(norms, clip)
    return [np.tensordot(factors, g, axes=1) / B for g in per_example], norms


def _compare(graph, ys, xs, batch, make_feed, what, batch_axis=None, on_rules=None,
             combiners=True):
    """Per-example gradients, norms, a noiseless DP gradient and 2 microbatches of `ys`
    without batch_size (with combiners=False: the gradients and norms only), against
    the loop at each of SIZES; `on_rules` the weights the plan must show on the rules
    per step (default: all). Returns the plan's text."""
    kwargs = {"batch": batch} if batch_axis is None else {"batch": batch,
                                                         "batch_axis": batch_axis}
    with graph.as_default():
        assert any(op.type == "LoopCond" for op in graph.get_operations()), \
            f"{what}: no v1 while loop in the graph"
        plan = pertower.explain(ys, xs, **kwargs)
        wanted = on_rules if on_rules is not None else [x.name for x in xs]
        for row in plan.weights:
            if row.name in wanted:
                assert row.method == "rules" and "per step" in " ".join(row.ops), \
                    f"{what}: {row.name}\n{plan}"
        grads = pertower.per_example_gradients(ys, xs, **kwargs)
        norms = pertower.per_example_norms(ys, xs, **kwargs)
        if combiners:
            micro = pertower.microbatch_gradients(ys, xs, num_microbatches=2, **kwargs)
            dp = pertower.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                      l2_norm_clip=CLIP, noise_multiplier=0.0)
            dp_grads = [g for g, _ in dp.compute_gradients(ys, xs, **kwargs)]
        else:
            dp_grads = []
        loop = oracle.SliceLoop(ys, xs)
        loop_kwargs = {"batch": batch} if batch_axis is None else kwargs
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for seed, B in enumerate(SIZES):
                feed = make_feed(B, seed)
                want = loop.run(sess, feed, B, **loop_kwargs)
                got, got_norms, got_dp = sess.run([grads, norms, dp_grads], feed)
                where = f"{what} B={B}"
                common.assert_all_close(got, want, kind="deep", what=f"{where} gradients")
                want_dp, want_norms = _clipped_mean(want, CLIP)
                common.assert_all_close(got_norms, want_norms, kind="deep", what=f"{where} norms")
                assert (want_norms > CLIP).any(), f"{where}: no example is clipped"
                if combiners:
                    common.assert_all_close(got_dp, want_dp, kind="deep", what=f"{where} DP")
                if combiners and B % 2 == 0:
                    halves = loop.run(sess, feed, 2, **loop_kwargs)
                    common.assert_all_close(sess.run(micro, feed), halves, kind="deep",
                                            what=f"{where} 2 microbatches")
    return str(plan)


def _dynamic_rnn(cell_name, lengths, time_major, early=False, combiners=True):
    """dynamic_rnn(cell) -> Dense; ys = each example's sum of squared outputs plus its
    final state's (the frame's output TensorArray and its exits). `early`: every
    sequence shorter than T (the frame stops before T steps)."""
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(3)
        shape = [T, None, D] if time_major else [None, T, D]
        x = tf.compat.v1.placeholder(tf.float32, shape, name="x")
        batch, axes = [x], [1] if time_major else None
        sequence_length = None
        if lengths:
            sequence_length = tf.compat.v1.placeholder(tf.int32, [None], name="lengths")
            batch.append(sequence_length)
            axes = [1, 0] if time_major else None
        cell = getattr(_CELLS, cell_name)(UNITS)
        out, state = tf.compat.v1.nn.dynamic_rnn(cell, x, sequence_length=sequence_length,
                                                 dtype=tf.float32, time_major=time_major)
        if time_major:
            out = tf.transpose(out, [1, 0, 2])                                  # [B, T, U]
        out = tf.compat.v1.layers.dense(out, 2)
        final = state.h if isinstance(state, _CELLS.LSTMStateTuple) else state  # [B, U]
        ys = (tf.reduce_sum(tf.square(out), axis=[1, 2])
              + tf.reduce_sum(tf.sin(final), axis=1))                           # [B]
        xs = tf.compat.v1.trainable_variables()

    def make_feed(B, seed):
        rng = np.random.RandomState(seed)
        data = rng.randn(*((T, B, D) if time_major else (B, T, D))).astype(np.float32)
        feed = {x: data}
        if lengths:
            top = T - 1 if early else T      # T, T-1, ... (early: T-1, T-2, ...)
            feed[sequence_length] = (top - np.arange(B) % top).astype(np.int32)
        return feed

    cells = [x.name for x in xs if "dense" not in x.name]
    what = (f"dynamic_rnn({cell_name}, sequence_length={bool(lengths)}, "
            f"time_major={time_major}{', early' if early else ''})")
    return _compare(graph, ys, xs, batch, make_feed, what, axes, on_rules=cells,
                    combiners=combiners)


def test_lstm_with_lengths_time_major():
    """Per-example gradients and norms (microbatches and DPOptimizer on the same frame:
    test_dynamic_rnn_cells[LSTMCell-True-True], heavy; they combine the
    same per-example rows, and every other cell's check runs them too)."""
    print(_dynamic_rnn("LSTMCell", lengths=True, time_major=True, combiners=False))


@pytest.mark.heavy
@pytest.mark.parametrize("cell, lengths, time_major", [
    ("LSTMCell", True, True),          # with microbatches and DP (the combiners)
    ("BasicRNNCell", False, False),
    ("GRUCell", True, False),
    ("GRUCell", False, True),
    ("LSTMCell", False, False),
    ("BasicRNNCell", True, True),
])
def test_dynamic_rnn_cells(cell, lengths, time_major):
    print(_dynamic_rnn(cell, lengths=lengths, time_major=time_major))


@pytest.mark.heavy
def test_lstm_stopping_before_the_last_step():
    """Every length < T: the frame runs max(lengths) steps, its output TensorArray's
    last elements are never written (read as zeros)."""
    print(_dynamic_rnn("LSTMCell", lengths=True, time_major=False, early=True))


def _hand_written(with_random=False):
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(5)
        x = tf.compat.v1.placeholder(tf.float32, [None, D], name="x")
        w = tf.compat.v1.get_variable("w", [D, D])
        b = tf.compat.v1.get_variable("b", [D], initializer=tf.compat.v1.ones_initializer())

        def body(i, h):
            z = tf.nn.bias_add(tf.matmul(h, w), b)
            if with_random:
                z += tf.random.uniform(tf.shape(z), maxval=0.0)   # draws zeros, statefully
            return i + 1, tf.tanh(z)

        h = tf.compat.v1.while_loop(lambda i, h: i < 3, body, [0, x])[1]
        ys = tf.reduce_sum(tf.square(h - 0.5), axis=1)                       # [B]
    return graph, ys, [w, b], x


@pytest.mark.heavy
def test_hand_written_while_loop_on_reference_variables():
    """tf.while_loop(i < 3, h -> tanh(h w + b)) over reference variables: w read by a
    MatMul, b by a BiasAdd in the frame."""
    graph, ys, xs, x = _hand_written()
    text = _compare(graph, ys, xs, [x],
                    lambda B, seed: {x: np.random.RandomState(seed).randn(B, D).astype(
                        np.float32)}, "hand-written tf.while_loop")
    with graph.as_default():   # the Jacobians of the frame's exit itself, [B, D, *x.shape]
        h = ys.op.inputs[0].op.inputs[0].op.inputs[0]
        assert h.op.type == "Exit", h.op.type
        jacobians = pertower.per_example_jacobians(h, xs, batch=[x])
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            feed = {x: np.random.RandomState(5).randn(3, D).astype(np.float32)}
            common.assert_all_close(sess.run(jacobians, feed),
                                    oracle.loop_per_example_jacobians(sess, h, xs, feed),
                                    kind="deep", what="the frame's exit's Jacobians")
    print(text)


def test_functions_of_the_weights_in_a_frame():
    """tanh(w) split into two gates and b cast to float64 and back, in a frame: each
    piece's rule pulled back to the weight (`pertower._loops.placements.Function`)."""
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(5)
        x = tf.compat.v1.placeholder(tf.float32, [None, D], name="x")
        w = tf.compat.v1.get_variable("w", [D, 2 * D])
        b = tf.compat.v1.get_variable("b", [D])

        def body(i, h):
            gate, cell = tf.split(tf.tanh(w), 2, axis=1)                      # [D, D] each
            bias = tf.cast(tf.cast(b, tf.float64), tf.float32)
            z = tf.nn.bias_add(tf.matmul(h, cell), bias)
            return i + 1, tf.tanh(z) * tf.sigmoid(tf.matmul(h, gate))

        h = tf.compat.v1.while_loop(lambda i, h: i < 3, body, [0, x])[1]
        ys = tf.reduce_sum(tf.square(h - 0.5), axis=1)                       # [B]
    _compare(graph, ys, [w, b], [x], lambda B, seed: {x: np.random.RandomState(seed).randn(
        B, D).astype(np.float32)}, "functions of the weights in a frame", combiners=False)


def test_broadcast_weights_of_the_state_in_a_frame():
    """max(h w * scale + shift, -exp(shift) / 2) in a frame: scale and shift read by
    two-input broadcast ops (Mul, AddV2, Maximum through exp) whose other input carries
    the batch, rebuilt per step on the copy's A (`pertower._loops.uses.StepBroadcast`)."""
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(5)
        x = tf.compat.v1.placeholder(tf.float32, [None, D], name="x")
        w = tf.compat.v1.get_variable("w", [D, D])
        scale = tf.compat.v1.get_variable("scale", [D])
        shift = tf.compat.v1.get_variable("shift", [D])

        def body(i, h):
            z = tf.matmul(h, w) * scale + shift
            return i + 1, tf.tanh(tf.maximum(z, -0.5 * tf.exp(shift)))

        h = tf.compat.v1.while_loop(lambda i, h: i < 3, body, [0, x])[1]
        ys = tf.reduce_sum(tf.square(h - 0.5), axis=1)                       # [B]
    _compare(graph, ys, [w, scale, shift], [x], lambda B, seed: {
        x: np.random.RandomState(seed).randn(B, D).astype(np.float32)},
        "broadcast weights in a frame")


def test_a_frame_drawing_random_numbers_keeps_row_passes():
    """A random op in the body: the copy would draw again, so the weights keep their
    row passes (batch_size needed, the reason names the op) and still match."""
    graph, ys, xs, x = _hand_written(with_random=True)
    with graph.as_default():
        plan = pertower.explain(ys, xs, batch=[x], batch_size=3)
        row = plan.weights[0]
        assert row.method == "passes" and "stateful op" in row.reason \
            and "RandomUniform" in row.reason, str(plan)
        try:
            pertower.per_example_gradients(ys, xs, batch=[x])
        except ValueError as error:
            assert "batch_size" in str(error), str(error)
        else:
            raise AssertionError("expected the fed-size refusal of the row passes")
        grads = pertower.per_example_gradients(ys, xs, batch=[x], batch_size=3)
        loop = oracle.SliceLoop(ys, xs)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            feed = {x: np.random.RandomState(0).randn(3, D).astype(np.float32)}
            common.assert_all_close(sess.run(grads, feed), loop.run(sess, feed, 3, batch=[x]),
                                    kind="deep", what="random frame on row passes")
    print(str(plan))


# The default run: a dynamic_rnn frame on the rules (LSTM, lengths, time-major) and a
# frame that keeps its row passes; the heavy run the other cells and layouts, and the
# hand-written while loop (in the default run a hand-written v1 while loop over
# reference variables is checked by legacy_mode_checks.py, v1_loop_checks
# `check_v1_while_loop_with_a_weight_in_the_body_matches_oracle`).

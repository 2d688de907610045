"""
"""

import re
import warnings

import numpy as np
import pytest
import tensorflow as tf

import pertower
from pertower import oracle
from tests import common

B1, B2, T, D, U, K = 1, 2, 3, 2, 3, 4
M = B1 + B2   # microbatches of the joined examples
_CELLS = tf.compat.v1.nn.rnn_cell


class _JoinedRnn:
    """ys = concat([loss(s1, y1), loss(s2, y2)], 0): one shared `dynamic_rnn` (a v1
    while loop) on each batch, its last output through a shared head `head(h)`, then
    sparse softmax cross-entropy; with lengths, each batch has its sequence_length."""

    def __init__(self, cell, lengths=False, head=None):
        self.graph = tf.Graph()
        with self.graph.as_default():
            common.seed_weights(11)
            make = lambda name, shape, dtype: tf.compat.v1.placeholder(dtype, shape, name)
            self.s = [make(f"s{j}", [None, T, D], tf.float32) for j in (1, 2)]
            self.y = [make(f"y{j}", [None], tf.int32) for j in (1, 2)]
            self.lengths = ([make(f"l{j}", [None], tf.int32) for j in (1, 2)]
                            if lengths else [None, None])
            shared = getattr(_CELLS, cell)(U)
            width = U if head is None else U * U
            w = tf.compat.v1.get_variable("w", [width, K])

            def loss(s, y, length):
                with tf.compat.v1.variable_scope("rnn", reuse=tf.compat.v1.AUTO_REUSE):
                    outputs, _ = tf.compat.v1.nn.dynamic_rnn(
                        shared, s, sequence_length=length, dtype=tf.float32)
                h = outputs[:, -1]                                        # [n, U]
                logits = tf.matmul(h if head is None else head(h), w)    # [n, K]
                return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                                      logits=logits)

            self.ys = tf.concat([loss(s, y, n) for s, y, n in
                                 zip(self.s, self.y, self.lengths)], 0)   # [B1 + B2]
            self.xs = tf.compat.v1.trainable_variables()
            self.keys = [[self.s[j], self.y[j]] + ([self.lengths[j]] if lengths else [])
                         for j in (0, 1)]
            self.batch = self.keys[0] + self.keys[1]
            self.sizes = [B1] * len(self.keys[0]) + [B2] * len(self.keys[1])
            rng = np.random.RandomState(4)
            self.feed = {}
            for keys, n, steps in zip(self.keys, (B1, B2), ([T, 2][:B1], [1, T, 2][:B2])):
                self.feed[keys[0]] = rng.randn(n, T, D).astype(np.float32)
                self.feed[keys[1]] = rng.randint(0, K, n)
                if lengths:
                    self.feed[keys[2]] = np.array(steps)
            self.sess = tf.compat.v1.Session(graph=self.graph)
            self.sess.run(tf.compat.v1.global_variables_initializer())

    def assert_loops(self):
        assert any(op.type == "LoopCond" for op in self.graph.get_operations())

    def oracle(self, num_microbatches=None):
        with self.graph.as_default():
            return oracle.loop_several_batches_gradients(self.sess, self.ys, self.xs,
                                                         self.feed, self.keys,
                                                         num_microbatches)


def _band(h):
    """[n, U] -> [n, U*U] through MatrixBandPart (the analysis loses its proof)."""
    return tf.reshape(tf.linalg.band_part(h[:, :, None] * h[:, None, :], 0, -1), [-1, U * U])


def _joined_matches(cell, lengths=False, head=None, num_microbatches=None, **kwargs):
    case = _JoinedRnn(cell, lengths, head)
    case.assert_loops()
    with case.graph.as_default():
        plan = pertower.explain(case.ys, case.xs, batch=case.batch, batch_size=case.sizes,
                                num_microbatches=num_microbatches)
        assert plan.request.segments is not None, str(plan)
        assert plan.fallback_method == "passes" and plan.fallback, str(plan)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            if num_microbatches is None:
                grads = pertower.per_example_gradients(case.ys, case.xs, batch=case.batch,
                                                       batch_size=case.sizes, **kwargs)
            else:
                grads = pertower.microbatch_gradients(
                    case.ys, case.xs, batch=case.batch, batch_size=case.sizes,
                    num_microbatches=num_microbatches, **kwargs)
    got = case.sess.run(grads, case.feed)
    common.assert_all_close(got, case.oracle(num_microbatches), kind="deep",
                            what=f"joined {cell} lengths={lengths} M={num_microbatches}")
    return plan


@pytest.mark.heavy
def test_joined_batches_through_a_shared_dynamic_rnn():
    """GRUCell with sequence_length, per example (the proven case; heavy: the default
    run's `test_joined_batches_through_a_v1_loop_after_a_lost_proof` takes the same
    joined row passes through a GRU with sequence_length, and the proof through a v1
    frame with sequence_length is legacy_mode_checks.py's); the other cells and
    lengths: `test_joined_batches_through_the_other_cells`, microbatches:
    `test_joined_microbatches_through_a_shared_dynamic_rnn` (both heavy)."""
    _joined_matches("GRUCell", lengths=True)


@pytest.mark.heavy
def test_joined_batches_through_the_other_cells():
    """The rest of every v1 cell with and without sequence_length (heavy: the join
    does not depend on the cell; each cell's rules are checked in legacy_mode_checks.py
    and recurrent_v1_checks.py)."""
    for cell in ("LSTMCell", "GRUCell", "BasicRNNCell"):
        for lengths in (False, True):
            if (cell, lengths) != ("GRUCell", True):
                _joined_matches(cell, lengths)


@pytest.mark.heavy
def test_joined_microbatches_through_a_shared_dynamic_rnn():
    """(heavy: microbatches of joined batches through a v1 loop are checked on a GRU in
    `test_joined_batches_through_a_shared_dynamic_rnn`)"""
    _joined_matches("LSTMCell", True, num_microbatches=M)


def test_joined_batches_through_a_v1_loop_after_a_lost_proof():
    """GRUCell with sequence_length (each batch its own); the proof is lost after the
    loop (MatrixBandPart): the join is read from the graph, the default run-time check
    replays the loop per example in the joined order (and passes)."""
    plan = _joined_matches("GRUCell", lengths=True, head=_band)
    assert plan.verdict == "unproven" and plan.validate, str(plan)


@pytest.mark.heavy
def test_joined_batches_through_a_v1_loop_after_a_lost_proof_unvalidated():
    """(heavy: the join after a lost proof is checked in
    `test_joined_batches_through_a_v1_loop_after_a_lost_proof`) validate=False gives
    the same numbers as the loop."""
    _joined_matches("LSTMCell", lengths=True, head=_band, validate=False)


@pytest.mark.heavy
def test_dp_optimizer_joined_batches_through_a_v1_loop():
    """DPOptimizer with batch_size=[2, 2, 3, 3] (features and labels of two batches):
    clipped per example, against the loop's gradients clipped one by one."""
    case = _JoinedRnn("LSTMCell")
    clip = 0.1
    with case.graph.as_default():
        optimizer = pertower.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer(1.0),
                                         l2_norm_clip=clip, noise_multiplier=0.0)
        pairs = optimizer.compute_gradients(case.ys, case.xs, batch=case.batch,
                                            batch_size=case.sizes)
    got = case.sess.run([g for g, _ in pairs], case.feed)
    rows = case.oracle()
    n = B1 + B2
    norms = np.sqrt(sum(np.sum(r.reshape(n, -1) ** 2, axis=1) for r in rows))
    assert np.sum(norms > clip) >= 2, norms
    factors = clip / np.maximum(norms, clip)
    want = [np.tensordot(factors, r, axes=1) / n for r in rows]
    common.assert_all_close(got, want, kind="deep", what="DP-SGD through dynamic_rnn")


def _refused_at_run_time(sess, fetches, feed, pattern):
    try:
        sess.run(fetches, feed)
    except tf.errors.InvalidArgumentError as error:
        assert re.search(pattern, str(error)), str(error)[:2000]
        return str(error)
    raise AssertionError(f"no run-time error matching {pattern!r}")


def test_the_fed_size_message_of_row_passes():
    """Weights read inside the loop take row passes (asked for: the rules cover them
    too), built for B: the message says batch_size cannot be left out (leaving it out
    is indeed refused)."""
    with tf.Graph().as_default() as graph:
        x = tf.compat.v1.placeholder(tf.float32, [None, T, D], name="x")
        outputs, _ = tf.compat.v1.nn.dynamic_rnn(_CELLS.LSTMCell(U), x, dtype=tf.float32)
        w = tf.compat.v1.get_variable("w", [U, 1])
        ys = tf.matmul(outputs[:, -1], w)[:, 0]
        xs = [x for x in tf.compat.v1.trainable_variables() if "lstm_cell" in x.name]
        grads = pertower.per_example_gradients(ys, xs, batch_size=4, method="towers")
        try:
            pertower.per_example_gradients(ys, xs, method="towers")
        except ValueError as error:
            assert re.search(r"no `batch_size` was given, but these weights fall back to row "
                             r"passes, which are built for a fixed number of examples",
                             str(error)), str(error)
        else:
            raise AssertionError("row passes were built without batch_size")
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            message = _refused_at_run_time(
                sess, grads, {x: np.zeros((3, T, D), np.float32)},
                r"built for a batch of 4 examples \(batch_size=4\), but the batch fed to "
                r"x:0 has 3 examples\. Feed batches of 4 examples, build the gradients "
                r"again for the new batch size \(batch_size=B\): batch_size cannot be left "
                r"out, since no rule computes \S*lstm_cell/kernel\S*, \S*lstm_cell/bias\S*, "
                r"whose gradients come from row passes")
            assert "leave out" not in message


@pytest.mark.heavy
def test_the_fed_size_message_of_joined_batches_through_a_v1_loop():
    case = _JoinedRnn("LSTMCell")
    with case.graph.as_default():
        grads = pertower.per_example_gradients(case.ys, case.xs, batch=case.batch,
                                               batch_size=case.sizes)
    short = dict(case.feed)
    for key in case.keys[1]:
        short[key] = short[key][:B2 - 1]
    _refused_at_run_time(case.sess, grads, short,
                         # (s2 and y2, batch[2] and batch[3], are checked in any order)
                         rf"built for a batch of {B2} examples \(batch_size\[(2\]={B2}\), but "
                         rf"the batch fed to s2|3\]={B2}\), but the batch fed to y2):0 has "
                         rf"{B2 - 1} examples?\. Feed batches of {B2} examples, "
                         r"build the gradients again for the new batch size \(batch_size="
                         r"\[B_1, B_2, \.\.\.\]")

"""Weights read inside a TF2 while loop (Keras LSTM, GRU, SimpleRNN with unroll=False)
on the rules of `pertower._loops`, against the one-example loop: per-example
gradients, norms, microbatches and a DPOptimizer step, with a None batch dimension fed
two batch sizes and no batch_size; `explain` shows each loop weight on the rules, per
step; a loop the copy cannot reproduce keeps its weights on the towers, with the reason.

The `check_*` functions build their own graphs, so that
tests/legacy/test_rules_recurrent.py runs them again under
tf.compat.v1.disable_v2_behavior() with control flow v2 (the LSTM and GRU language
models in the heavy run).
"""

import numpy as np
import pytest
import tensorflow as tf

import pertower
from pertower import oracle
from tests import cases
from tests import common

SIZES = (3, 4)          # two batch sizes fed to one graph
T, VOCAB = cases.LM_T, cases.LM_VOCAB
CLIP = 0.5


def _language_model(layer):
    """Embedding -> recurrent layer (return_sequences) -> Dense over the vocabulary; ys
    is each example's sum over its T steps of the next-token cross-entropy, [B]."""
    graph = tf.Graph()
    with graph.as_default():
        ys, _, batch, _ = cases.language_model(layer, 7)
    return graph, ys, batch


def _feed(batch, B, seed):
    rng = np.random.RandomState(seed)
    return {t: rng.randint(0, VOCAB, size=(B, T)).astype(np.int32) for t in batch}


def _clipped_mean(per_example, clip):
    """NumPy: DP-SGD's noiseless gradient, the mean of the per-example gradients each
    clipped to norm `clip`."""
    B = per_example[0].shape[0]
    norms = np.sqrt(sum(np.sum(g.reshape(B, -1) ** 2, axis=1) for g in per_example))
    factors = clip / np.maximum(norms, clip)
    return [np.tensordot(factors, g, axes=1) / B for g in per_example], norms


class Built:
    """One recurrent model with everything pertower builds for it, built before the
    session first runs (TensorFlow's while_v2 gradient edits the forward loop)."""

    def __init__(self, layer):
        self.layer = layer
        self.graph, self.ys, self.batch = _language_model(layer)
        assert any(op.type in ("While", "StatelessWhile") for op in self.graph.get_operations()), \
            f"{layer}: no TF2 while loop in the graph"
        with self.graph.as_default():
            self.xs = tf.compat.v1.trainable_variables()
            self.plan = pertower.explain(self.ys, self.xs, batch=self.batch)
            self.gradients = pertower.per_example_gradients(self.ys, self.xs, batch=self.batch)
            self.norms = pertower.per_example_norms(self.ys, self.xs, batch=self.batch)
            self.microbatches = pertower.microbatch_gradients(self.ys, self.xs, num_microbatches=2,
                                                              batch=self.batch)
            dp = pertower.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                      l2_norm_clip=CLIP, noise_multiplier=0.0)
            self.dp = [g for g, _ in dp.compute_gradients(self.ys, self.xs)]
            self.loop = oracle.SliceLoop(self.ys, self.xs)
            self.sess = tf.compat.v1.Session(graph=self.graph)
            self.sess.run(tf.compat.v1.global_variables_initializer())

    def check_plan(self):
        for row in self.plan.weights:
            assert row.method == "rules", f"{self.layer}: {row}\n{self.plan}"
        loop_rows = [row for row in self.plan.weights if "per step" in " ".join(row.ops)]
        assert len(loop_rows) == 3, f"{self.layer}: the cell's weights\n{self.plan}"

    def check_batch(self, B, seed):
        feed = _feed(self.batch, B, seed)
        want = self.loop.run(self.sess, feed, B, batch=self.batch)
        got, norms, dp = self.sess.run([self.gradients, self.norms, self.dp], feed)
        what = f"{self.layer} B={B}"
        common.assert_all_close(got, want, kind="deep", what=f"{what} gradients")
        want_dp, want_norms = _clipped_mean(want, CLIP)
        common.assert_all_close(norms, want_norms, kind="deep", what=f"{what} norms")
        assert (want_norms > CLIP).any(), f"{what}: no example is clipped"
        common.assert_all_close(dp, want_dp, kind="deep", what=f"{what} DP gradient")
        if B % 2 == 0:
            halves = self.loop.run(self.sess, feed, 2, batch=self.batch)
            common.assert_all_close(self.sess.run(self.microbatches, feed), halves,
                                    kind="deep", what=f"{what} 2 microbatches")


def check_language_model(layer):
    """The model of `layer` on the rules, against the loop at two batch sizes."""
    built = Built(layer)
    try:
        built.check_plan()
        for seed, B in enumerate(SIZES):
            built.check_batch(B, seed)
    finally:
        built.sess.close()
    return str(built.plan)


def check_a_loop_drawing_random_numbers_stays_on_the_towers():
    """A body with a random op cannot be copied (the copy would draw other numbers):
    its weight stays on the towers, saying why; the weight outside uses its rule."""
    with tf.Graph().as_default():
        common.seed_weights(3)
        x = tf.compat.v1.placeholder(tf.float32, [None, 2], name="x")
        w = tf.compat.v1.get_variable("w", [2, 2])
        v = tf.compat.v1.get_variable("v", [2, 1])

        def body(i, h):
            noise = tf.random.uniform(tf.shape(h))
            return i + 1, tf.tanh(tf.matmul(h, w)) + 0.0 * noise

        _, h = tf.while_loop(lambda i, h: i < 3, body, [tf.constant(0), x])
        ys = tf.reduce_sum(tf.matmul(h, v), axis=1)
        plan = pertower.explain(ys, [w, v], batch=[x])
    rows = {row.name: row for row in plan.weights}
    assert rows["w:0"].method == "towers", str(plan)
    assert "stateful op" in rows["w:0"].reason and "RandomUniform" in rows["w:0"].reason, \
        str(plan)
    assert rows["v:0"].method == "rules", str(plan)
    return str(plan)


def check_a_weight_read_inside_and_outside_a_while_loop():
    """tf.while_loop reading w in its body and w read again after it: the rules add the
    loop's per-step part and the outer read's, for any fed batch size."""
    with tf.Graph().as_default() as graph:
        common.seed_weights(5)
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        w = tf.compat.v1.get_variable("w", [3, 3])

        def body(i, h):
            return i + 1, tf.tanh(tf.matmul(h, w))

        _, h = tf.while_loop(lambda i, h: i < 3, body, [tf.constant(0), x])
        ys = tf.reduce_sum(tf.matmul(h, w) ** 2, axis=1)                   # [B]
        plan = pertower.explain(ys, [w], batch=[x])
        grads = pertower.per_example_gradients(ys, [w], batch=[x])
        loop = oracle.SliceLoop(ys, [w])
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for B in SIZES:
                feed = {x: np.random.RandomState(B).randn(B, 3).astype(np.float32)}
                common.assert_all_close(sess.run(grads, feed), loop.run(sess, feed, B),
                                        kind="deep", what=f"while_loop B={B}")
    (row,) = plan.weights
    assert row.method == "rules" and len(row.ops) == 2, str(plan)
    assert any("per step" in op for op in row.ops), str(plan)
    return str(plan)


@pytest.fixture(scope="module")
def lstm_lm():
    built = Built("LSTM")
    yield built
    built.sess.close()


def test_explain_shows_the_loop_weights_on_the_rules(lstm_lm):
    lstm_lm.check_plan()
    assert "in 'lstm/while' per step" in str(lstm_lm.plan)


@pytest.mark.parametrize("B", SIZES)
def test_lstm_language_model_matches_the_loop(lstm_lm, B):
    """Gradients, norms, a noiseless DP gradient and 2 microbatches, no batch_size."""
    lstm_lm.check_batch(B, seed=B)


@pytest.mark.heavy
def test_gru_language_model_matches_the_loop():
    """GRU reads its [2, 3u] bias through Unpack: each slice's rule, placed."""
    check_language_model("GRU")


def test_a_loop_drawing_random_numbers_stays_on_the_towers():
    check_a_loop_drawing_random_numbers_stays_on_the_towers()


def test_a_weight_read_inside_and_outside_a_while_loop():
    check_a_weight_read_inside_and_outside_a_while_loop()


@pytest.mark.heavy
@pytest.mark.parametrize("layer", ["LSTM", "GRU-reset-before", "LSTM-split", "ConvLSTM2D"])
def test_the_recurrent_bench_runs_at_a_small_size(capsys, layer):
    """`python -m benchmarks.recurrent` (in this process, tiny sizes): its
    table names every timed row and the methods of the plan."""
    from benchmarks import recurrent as recurrent_bench
    recurrent_bench.run(recurrent_bench._parse(  # pylint: disable=protected-access
        ["--batch", "4", "--steps", "3", "--vocab", "13", "--units", "4", "--repeats", "1",
         "--layer", layer]))
    text = capsys.readouterr().out
    for row in ("batch gradient", "per-example gradients", "DP step", "loop"):
        assert row in text, text
    assert "methods: rules\n" in text, text

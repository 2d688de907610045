"""pertower's seam to TensorFlow's private API (`pertower._tf`): the probe's report, the
switch that forces each private way's fallback (``PERTOWER_TF_FALLBACK``,
`pertower._tf.forced_fallback`), a changed signature taking the fallback with its
reason, and every fallback against the one-example loop (`pertower.oracle`) on a small
model: a tf_keras GRU language model (TF2 While loop: the loop backward, the While edit,
the loop copies), a TF1 frame (its copy), a dense net with a shared weight (the
curvature's vectorized columns), and the ops the others serve.
"""

import contextlib
import functools
import operator
import types

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.ops import while_v2  # pylint: disable=no-name-in-module

import pertower
from pertower import _tf
from pertower import oracle
from pertower._tf import graphs as tf_graphs
from pertower._tf import probe
from tests import cases
from tests import common

B, T, VOCAB = 3, cases.LM_T, cases.LM_VOCAB
WHILE = cases.WHILE_OP_TYPES


def _language_model():
    """(ys [B], xs, batch, the While op) of Embedding -> GRU -> Dense in the default graph."""
    return cases.language_model("GRU", 5)


class Recurrent:
    """The GRU model's per-example gradients built with the ways `forced` on their
    fallback, run against the one-example loop (`later`: then a training op built
    after that first run, its batch gradient against the per-example sum)."""

    def __init__(self, forced=(), later=False):
        self.graph = tf.Graph()
        with self.graph.as_default(), _forced(forced):
            self.ys, self.xs, self.batch, self.loop = _language_model()
            self.before = len(self.loop.outputs)
            ops = set(self.graph.get_operations())
            # a fixed B, which the towers of a fallback need
            self.plan = pertower.explain(self.ys, self.xs, batch=self.batch, batch_size=B)
            grads = pertower.per_example_gradients(self.ys, self.xs, batch=self.batch,
                                                   batch_size=B)
            self.added = [op for op in self.graph.get_operations() if op not in ops]
        rng = np.random.RandomState(2)
        feed = {t: rng.randint(0, VOCAB, size=(B, T)).astype(np.int32) for t in self.batch}
        with self.graph.as_default(), tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            got = sess.run(grads, feed)
            want = oracle.SliceLoop(self.ys, self.xs).run(sess, feed, B, batch=self.batch)
            common.assert_all_close(got, want, kind="deep", what=f"GRU, forced {forced}")
            if later:
                batch_gradient = sess.run([tf.convert_to_tensor(g) for g in tf.gradients(
                    tf.reduce_sum(self.ys), self.xs)], feed)
                common.assert_all_close([g.sum(axis=0) for g in got], batch_gradient,
                                        kind="deep", what="a training op built after the run")

    def methods(self):
        return {row.method for row in self.plan.weights}

    def backward_loops(self):
        """pertower's own backward While ops (the loop backward's)."""
        return [op.name for op in self.added if op.type in WHILE
                and op.name.endswith("/backward")]


def _forced(names):
    return _tf.forced_fallback(*names) if names else contextlib.nullcontext()


def _finding(name):
    return next(f for f in _tf.report() if f.way == name)


# -- the probe and the switch ------------------------------------------------------------------

def test_the_tested_release_takes_every_private_way(monkeypatch):
    """On the TensorFlow this project tests (see setup.py), every probe finds what its
    way relies on, and the GRU's weights are served by the loop's own backward."""
    monkeypatch.delenv(_tf.ENV_VAR, raising=False)
    recurrent = Recurrent()
    assert [f for f in _tf.report() if not f.private] == []
    assert {f.way for f in _tf.report()} >= set(_tf.WAYS)
    assert recurrent.methods() == {"rules"}, recurrent.plan
    assert len(recurrent.backward_loops()) == 1, recurrent.backward_loops()


@pytest.mark.parametrize("value, forced", [
    ("1", set(_tf.WAYS)), ("all", set(_tf.WAYS)),
    ("loop_backward, pfor", {"loop_backward", "pfor"}), ("0", set()), ("", set())])
def test_the_environment_variable_forces_the_fallbacks(monkeypatch, value, forced):
    monkeypatch.setenv(_tf.ENV_VAR, value)
    report = {f.way: f for f in _tf.report()}
    assert {name for name in _tf.WAYS if not report[name].private} == forced, report
    assert all(_tf.ENV_VAR in report[name].reason for name in forced)


def test_an_unknown_way_in_the_environment_variable_is_named(monkeypatch):
    monkeypatch.setenv(_tf.ENV_VAR, "pfor,loop_bakward")
    with pytest.warns(UserWarning, match=r"unknown way\(s\) \['loop_bakward'\]"):
        report = {f.way: f for f in _tf.report()}
    assert not report["pfor"].private and report["loop_backward"].private


def test_forced_fallback_nests_and_refuses_unknown_ways(monkeypatch):
    monkeypatch.delenv(_tf.ENV_VAR, raising=False)
    with _tf.forced_fallback("pfor"):
        with _tf.forced_fallback("op_order"):
            assert not _finding("op_order").private and not _finding("pfor").private
        assert _finding("op_order").private and not _finding("pfor").private
    assert _finding("pfor").private
    with pytest.raises(ValueError, match="loop_backward"):
        with _tf.forced_fallback("no_such_way"):
            pass


def test_a_changed_signature_takes_the_fallback_with_its_reason(monkeypatch):
    """A while_v2 helper whose parameters changed (as a new TensorFlow may change them)
    turns the two ways that call it to their fallbacks, with the reason on record; a
    required name whose signature changed raises an error naming the tested range."""
    monkeypatch.delenv(_tf.ENV_VAR, raising=False)
    monkeypatch.setattr(probe, "_probed", {})
    monkeypatch.setattr(while_v2, "_preprocess_grad", lambda grad, body_output: grad)
    assert not _tf.loop_backward() and not _tf.while_edit()
    assert "_preprocess_grad" in _finding("loop_backward").reason
    assert "_preprocess_grad" in _finding("while_edit").reason
    assert _tf.loop_copy()
    monkeypatch.setattr(tf_graphs._ops.Graph, "_get_function",  # pylint: disable=protected-access
                        lambda self, function_name: None)
    with pytest.raises(RuntimeError, match=r"Graph._get_function.*>=2\.16,<2\.22"):
        _tf.get_function(tf.Graph(), "f")


def test_the_op_order_fallback_is_creation_order(monkeypatch):
    monkeypatch.delenv(_tf.ENV_VAR, raising=False)
    with tf.Graph().as_default() as graph:
        _language_model()
    ops = graph.get_operations()[::-1]
    with _tf.forced_fallback("op_order"):
        fallback = sorted(ops, key=_tf.op_order_key())
    assert fallback == sorted(ops, key=operator.attrgetter("_id")) == graph.get_operations()


# -- each fallback against the one-example loop -------------------------------------------------

def test_the_ops_fallbacks_with_the_loop_backward(monkeypatch):
    """Ops ordered by position, created by the public `create_op` (the duplicate of the
    user's loop), every op's registered gradient (no one-sided gradient): the loop
    backward still serves the GRU, and the numbers are the loop's."""
    monkeypatch.delenv(_tf.ENV_VAR, raising=False)
    recurrent = Recurrent(("op_order", "create_op", "one_sided_gradients"))
    assert recurrent.methods() == {"rules"}, recurrent.plan
    assert len(recurrent.backward_loops()) == 1, recurrent.backward_loops()


def test_the_loop_backward_fallback_is_the_loops_copy(monkeypatch):
    monkeypatch.delenv(_tf.ENV_VAR, raising=False)
    recurrent = Recurrent(("loop_backward",))
    assert recurrent.methods() == {"rules"}, recurrent.plan
    assert recurrent.backward_loops() == []
    assert len(recurrent.loop.outputs) > recurrent.before   # edited as by tf.gradients


def test_the_while_edit_fallback_runs_tensorflows_while_gradient(monkeypatch):
    """The copy edits the user's loop by TensorFlow's own While gradient; a training op
    built after the first run still works."""
    monkeypatch.delenv(_tf.ENV_VAR, raising=False)
    recurrent = Recurrent(("loop_backward", "while_edit"), later=True)
    assert recurrent.methods() == {"rules"}, recurrent.plan
    assert len(recurrent.loop.outputs) > recurrent.before


def test_every_fallback_from_the_environment_variable(monkeypatch):
    """``PERTOWER_TF_FALLBACK=1``: the loop's weights stay on pertower's fallback method
    (the towers), with the reason in the plan."""
    monkeypatch.setenv(_tf.ENV_VAR, "1")
    recurrent = Recurrent()
    loop_rows = [row for row in recurrent.plan.weights if row.method != "rules"]
    assert len(loop_rows) == 3, recurrent.plan
    assert "loop_copy" in str(recurrent.plan), recurrent.plan


@pytest.mark.parametrize("forced", [(), ("loop_copy",)])
def test_a_tf1_frame_and_its_fallback(monkeypatch, forced):
    """A TF1 while loop (control flow v1, in this process for one graph): its copy
    serves the weight, or (forced) pertower's fallback method; both match the loop."""
    monkeypatch.delenv(_tf.ENV_VAR, raising=False)
    rng = np.random.RandomState(0)
    with tf.Graph().as_default(), _forced(forced):
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        W = tf.Variable(rng.randn(3, 3).astype(np.float32) * 0.5, name="W")
        tf.compat.v1.disable_control_flow_v2()
        try:
            _, h = tf.compat.v1.while_loop(lambda i, h: i < 3,
                                           lambda i, h: (i + 1, tf.tanh(h @ W)), [0, x])
        finally:
            tf.compat.v1.enable_control_flow_v2()
        ys = tf.reduce_sum(h ** 2, axis=1)                                    # [B]
        plan = pertower.explain(ys, [W], batch=[x], batch_size=4)
        grads = pertower.per_example_gradients(ys, [W], batch=[x], batch_size=4)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            feed = {x: rng.randn(4, 3)}
            common.assert_all_close(
                sess.run(grads, feed),
                oracle.loop_per_example_gradients(sess, ys, [W], feed, batch=[x]),
                what=f"TF1 frame, forced {forced}")
    assert (plan.weights[0].method == "rules") == (not forced), plan
    assert ("loop_copy" in str(plan)) == bool(forced), plan


def _spy(monkeypatch, owner, name):
    """Counts the calls of `owner.name` (a list that grows by one per call); the spy
    keeps the function's signature (for the probes)."""
    calls, original = [], getattr(owner, name)

    @functools.wraps(original)
    def spy(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)
    monkeypatch.setattr(owner, name, spy)
    return calls


def test_the_curvature_fallback(monkeypatch):
    """`diag_ggn` of a dense net with a weight read twice, its columns' backward
    vectorized by parallel_for's `pfor`, with the way on its fallback
    (tf.vectorized_map), against the GGN of the one-example Jacobians. The private way
    is reached without the switch, and not with it."""
    way = "pfor"
    monkeypatch.delenv(_tf.ENV_VAR, raising=False)
    # the seam's own reference to the private module (tf.vectorized_map calls pfor too)
    module = getattr(tf_graphs, "_pfor")
    monkeypatch.setattr(tf_graphs, "_pfor", types.SimpleNamespace(pfor=module.pfor))
    private = _spy(monkeypatch, getattr(tf_graphs, "_pfor"), way)
    public = _spy(monkeypatch, tf, "vectorized_map")
    rng = np.random.RandomState(1)
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float64, [None, 4], name="x")
        W1 = tf.Variable(rng.randn(4, 4) * 0.5, name="W1")
        W2 = tf.Variable(rng.randn(4, 3) * 0.5, name="W2")
        h = tf.nn.relu(tf.nn.relu(x @ W1) @ W1)                               # [B, 4]
        logits = tf.sin(h @ W2 + tf.reduce_sum(h, axis=1, keepdims=True))     # [B, 3]
        pertower.diag_ggn(logits, [W1, W2], batch_size=B)
        assert private, way
        del private[:]
        before = len(public)
        with _tf.forced_fallback(way):
            result = pertower.diag_ggn(logits, [W1, W2], batch_size=B)
        assert not private and len(public) > before, (private, public)
        assert result.columns_method == "pfor", result.columns_reason
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            feed = {x: rng.randn(B, 4)}
            got = sess.run(list(result), feed)
            want = common.reference_ggn(sess, logits, [W1, W2], feed)
    common.assert_all_close(got, [w.sum(axis=0) for w in want], what=f"diag_ggn, {way} forced")


def test_onednn_enabled_answers_as_the_convolution_rules_ask():
    from pertower._convolution import options as _conv_options  # pylint: disable=import-outside-toplevel
    assert bool(_tf.onednn_enabled()) is _conv_options.onednn_enabled()

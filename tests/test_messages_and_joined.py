"""Issue 17, items 11 and 15: joined batches whose proof is lost before the join or that
pass a TF1 (v1) loop, and the messages that must give the advice that works.

Joined batches: `ys = tf.concat([f(s1), f(s2)], 0)` with B_1 != B_2, compared with
`pertower.oracle.loop_several_batches_gradients` (each row with its own batch fed one
example and every other batch an empty one). The checks that need v1 control flow
(`dynamic_rnn` under `disable_v2_behavior()`) are in
tests/legacy/test_messages_and_joined.py.

Messages: the run-time fed-batch-size message advises leaving out `batch_size` only
where that works (every weight has a rule); errors inside `DPOptimizer` name it; the
examples say how to get Keras 2 and quiet TensorFlow's logs.
"""

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import pertower
from pertower import _engine
from pertower import oracle
from tests import common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
B1, B2, D, U = 2, 3, 4, 3


def _band(h):
    """[n, U] -> [n, U*U]: the upper triangle of h_i h_i^T per example, through
    MatrixBandPart, an op the batch-axis analysis does not know (the proof is lost)."""
    return tf.reshape(tf.linalg.band_part(h[:, :, None] * h[:, None, :], 0, -1), [-1, U * U])


def _inverse(h):
    """[n, U] -> [n, U*U]: (h_i h_i^T + 3 I)^-1 per example (MatrixInverse, unknown too)."""
    return tf.reshape(tf.linalg.inv(h[:, :, None] * h[:, None, :] + 3.0 * tf.eye(U)),
                      [-1, U * U])


def _fft(h):
    """[n, U] -> [n, U]: |FFT(h_i)| per example (FFT, unknown too)."""
    return tf.abs(tf.signal.fft(tf.cast(h, tf.complex64)))


UNKNOWN_OPS = {"band_part": (_band, U * U), "inverse": (_inverse, U * U), "fft": (_fft, U)}


class _Joined:
    """ys = concat([f(s1), f(s2)], 0) (times 0.5), f a shared dense layer, an op the
    analysis does not know (`unknown`), then a shared head; with mix=True, f's rows
    first mix the examples of its batch through an FFT over the batch axis."""

    def __init__(self, unknown="band_part", mix=False):
        self.graph = tf.Graph()
        with self.graph.as_default():
            common.seed_weights(5)
            self.s1 = tf.compat.v1.placeholder(tf.float32, [None, D], name="s1")
            self.s2 = tf.compat.v1.placeholder(tf.float32, [None, D], name="s2")
            op, width = UNKNOWN_OPS[unknown]
            w = tf.compat.v1.get_variable("w", [D, U], use_resource=True)
            v = tf.compat.v1.get_variable("v", [width, 1], use_resource=True)

            def f(s):
                h = tf.tanh(tf.matmul(s, w))                                     # [n, U]
                if mix:   # |FFT| over the batch axis: every row reads every row
                    h = tf.transpose(_fft(tf.transpose(h)))                      # [n, U]
                return tf.matmul(op(h), v)[:, 0]                                 # [n]

            self.ys = 0.5 * tf.concat([f(self.s1), f(self.s2)], 0)              # [B1 + B2]
            self.xs = [w, v]
            rng = np.random.RandomState(2)
            self.feed = {self.s1: rng.randn(B1, D), self.s2: rng.randn(B2, D)}
            self.sess = tf.compat.v1.Session(graph=self.graph)
            self.sess.run(tf.compat.v1.global_variables_initializer())

    def oracle(self, num_microbatches=None):
        with self.graph.as_default():
            return oracle.loop_several_batches_gradients(
                self.sess, self.ys, self.xs, self.feed, [[self.s1], [self.s2]],
                num_microbatches)


# one op that loses the proof per microbatch setting in the default run (the same
# join and check after each of UNKNOWN_OPS); the others with -m heavy
_JOIN_DEFAULT_RUN = {("band_part", None), ("inverse", 5)}


@pytest.mark.parametrize("unknown, num_microbatches", [
    pytest.param(unknown, m, marks=() if (unknown, m) in _JOIN_DEFAULT_RUN else pytest.mark.heavy)
    for unknown in sorted(UNKNOWN_OPS) for m in (None, 5)])
def test_a_join_after_a_lost_proof_matches_the_loop_and_is_checked(unknown, num_microbatches):
    """The analysis loses its proof before the concat; the join is read from the graph
    and the default run-time check replays each batch's examples in that order."""
    case = _Joined(unknown)
    with case.graph.as_default():
        plan = pertower.explain(case.ys, case.xs, batch=[case.s1, case.s2],
                                batch_size=[B1, B2], num_microbatches=num_microbatches)
        assert plan.verdict == "unproven" and plan.validate, str(plan)
        assert plan.request.segments == (((0,), B1), ((1,), B2)), plan.request.segments
        with pytest.warns(UserWarning, match=r"could not prove .* the proof was lost at"):
            if num_microbatches is None:
                grads = pertower.per_example_gradients(case.ys, case.xs,
                                                       batch=[case.s1, case.s2],
                                                       batch_size=[B1, B2])
            else:
                grads = pertower.microbatch_gradients(
                    case.ys, case.xs, batch=[case.s1, case.s2], batch_size=[B1, B2],
                    num_microbatches=num_microbatches)
    got = case.sess.run(grads, case.feed)
    assert got[0].shape == (5, D, U)
    common.assert_all_close(got, case.oracle(num_microbatches), kind="deep",
                            what=f"joined after {unknown}")


def test_a_join_whose_batch_mixes_its_examples_fails_the_run_time_check():
    """The join read from the graph is not taken on faith: f(s2) mixes the rows of s2,
    and the default check catches it when the result is fetched."""
    case = _Joined(mix=True)
    with case.graph.as_default():
        with pytest.warns(UserWarning, match="could not prove"):
            grads = pertower.per_example_gradients(case.ys, case.xs, batch=[case.s1, case.s2],
                                                   batch_size=[B1, B2])
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"recomputed one slice of the batch at a time differs from `ys`"):
        case.sess.run(grads, case.feed)


def test_a_size_list_without_a_visible_join_says_where_the_proof_was_lost():
    with tf.Graph().as_default():
        s1 = tf.compat.v1.placeholder(tf.float32, [None, D], name="s1")
        s2 = tf.compat.v1.placeholder(tf.float32, [None, D], name="s2")
        w = tf.compat.v1.get_variable("w", [D, U], use_resource=True)
        # not a join: s2's rows are added to s1's, through an op the analysis does not know
        ys = tf.reduce_sum(_band(tf.matmul(s1, w) + tf.matmul(s2, w)), 1)
        with pytest.raises(ValueError, match=r"pertower\.per_example_gradients: `batch_size` "
                                             r"is the list \[2, 3\].*not a concat along axis "
                                             r"0.*the proof was lost at 'MatrixBandPart'"):
            pertower.per_example_gradients(ys, [w], batch=[s1, s2], batch_size=[B1, B2])


@pytest.mark.parametrize("num_microbatches", [None, 5])
def test_dp_optimizer_takes_a_size_list_for_joined_batches(num_microbatches):
    """DPOptimizer's batch_size is as in per_example_gradients: clipped (at a norm most
    examples exceed) and averaged, against the loop's gradients clipped one by one."""
    case = _Joined("band_part")
    clip = 0.05
    with case.graph.as_default():
        optimizer = pertower.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer(1.0),
                                         l2_norm_clip=clip, noise_multiplier=0.0,
                                         num_microbatches=num_microbatches)
        with pytest.warns(UserWarning, match="could not prove"):
            pairs = optimizer.compute_gradients(case.ys, case.xs, batch=[case.s1, case.s2],
                                                batch_size=[B1, B2])
    got = case.sess.run([g for g, _ in pairs], case.feed)
    rows = case.oracle(num_microbatches)          # [G, *x.shape], sums over each group
    G = rows[0].shape[0]
    rows = [r / (5 // G) for r in rows]          # the gradient of each group's mean loss
    norms = np.sqrt(sum(np.sum(r.reshape(G, -1) ** 2, axis=1) for r in rows))
    assert np.sum(norms > clip) >= 2, norms      # the clipping is exercised
    factors = clip / np.maximum(norms, clip)
    want = [np.tensordot(factors, r, axes=1) / G for r in rows]
    common.assert_all_close(got, want, kind="deep", what="DP-SGD on joined batches")


# Messages: the fed batch size -------------------------------------------------------


def _pow_model():
    """w by a MatMul (a rule), v by the bound of a ClipByValue (no rule: the towers);
    a None batch axis."""
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(3)
        x = tf.compat.v1.placeholder(tf.float32, [None, D], name="x")
        w = tf.compat.v1.get_variable("w", [D, U], use_resource=True)
        v = tf.compat.v1.get_variable("v", [], use_resource=True)
        h = tf.abs(tf.matmul(x, w)) + 1.0                                       # [B, U]
        clipped = tf.raw_ops.ClipByValue(t=h, clip_value_min=tf.zeros([]),
                                         clip_value_max=1.0 + tf.exp(v))        # [B, U]
        ys = tf.reduce_sum(clipped, 1)                                          # [B]
        sess = tf.compat.v1.Session(graph=graph)
        sess.run(tf.compat.v1.global_variables_initializer())
    return graph, sess, x, ys, [w, v]


def _feed(x, n):
    return {x: np.random.RandomState(n).randn(n, D)}


def test_the_fed_size_message_advises_leaving_out_batch_size_only_when_it_works():
    graph, sess, x, ys, (w, v) = _pow_model()
    with graph.as_default():
        rules_only = pertower.per_example_gradients(ys, [w], batch_size=4)
        mixed = pertower.per_example_gradients(ys, [w, v], batch_size=4)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"built for a batch of 4 examples \(batch_size=4\), but the "
                             r"batch fed to x:0 has 3 examples\. Feed batches of 4 examples, "
                             r"build the gradients again for the new batch size, or leave "
                             r"out batch_size \(then the rules work for any fed batch size\)"):
        sess.run(rules_only, _feed(x, 3))
    with pytest.raises(tf.errors.InvalidArgumentError) as caught:
        sess.run(mixed, _feed(x, 3))
    # (the rules' check and the towers' own check of their slices both guard this run;
    # which fails first is up to TensorFlow's scheduler, and neither advises leaving out
    # batch_size; the rules' advice for this plan is read from the plan itself)
    message = str(caught.value)
    plan = pertower.explain(ys, [w, v], batch_size=4)
    assert re.search(r"build the gradients again for the new batch size \(batch_size=B\): "
                     r"batch_size cannot be left out, since no rule computes v:0, whose "
                     r"gradients come from towers", _engine.checks.size_advice(plan.request, plan))
    assert "leave out" not in message, message
    # the advice holds: without batch_size the rules alone serve any fed size; the
    # towers refuse it
    with graph.as_default():
        anywhere = pertower.per_example_gradients(ys, [w])
        with pytest.raises(ValueError, match=r"no `batch_size` was given, but these weights "
                                             r"fall back to towers"):
            pertower.per_example_gradients(ys, [w, v])
        for n in (3, 5):
            want = oracle.loop_per_example_gradients(sess, ys, [w], _feed(x, n))
            common.assert_all_close(sess.run(anywhere, _feed(x, n)), want, what=f"B={n}")


def test_the_fed_size_message_names_the_static_batch_tensor_that_fixes_b():
    with tf.Graph().as_default() as graph:
        x = tf.compat.v1.placeholder(tf.float32, [4, D], name="x")
        y = tf.compat.v1.placeholder(tf.float32, [None], name="y")
        w = tf.compat.v1.get_variable("w", [D], use_resource=True)
        ys = tf.square(tf.reduce_sum(x * w, 1) - y)
        grads = pertower.per_example_gradients(ys, [w], batch=[x, y])
        plan = pertower.explain(ys, [w], batch=[x, y])
        # the advice of the rules' size check for this plan (the forward pass itself may
        # fail first on the mismatched rows, so the message is read from the plan)
        assert re.search(r"batch_size cannot be left out, since the batch tensor x:0 has a "
                         r"static batch size of 4", _engine.checks.size_advice(plan.request, plan))
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(w.initializer)
            with pytest.raises(tf.errors.InvalidArgumentError):
                sess.run(grads, {x: np.ones((4, D)), y: np.ones(3)})


def test_the_fed_size_message_of_joined_batches_names_each_batch_size():
    case = _Joined("band_part")
    with case.graph.as_default():
        grads = pertower.per_example_gradients(case.ys, case.xs, batch=[case.s1, case.s2],
                                               batch_size=[B1, B2], validate=False)
    short = dict(case.feed)
    short[case.s2] = short[case.s2][:2]
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"built for a batch of 3 examples \(batch_size=3\), but the batch "
                             r"fed to s2:0 has 2 examples"):
        case.sess.run(grads, short)


# Messages: DPOptimizer names itself ------------------------------------------------


@pytest.mark.parametrize("kwargs, pattern", [
    ({"batch_size": [B1, 0]}, r"`batch_size\[1\]` must be a positive integer"),
    ({"batch_size": [B1, B2], "num_microbatches": 2},
     r"`num_microbatches` \(2\) does not split the rows of `ys`"),
    ({"batch_size": [B1, B2, 4]}, r"`batch_size` has 3 entries, but there are 2 batch"),
])
def test_errors_inside_dp_optimizer_name_it(kwargs, pattern):
    case = _Joined("band_part")
    M = kwargs.pop("num_microbatches", None)
    with case.graph.as_default():
        optimizer = pertower.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer(1.0),
                                         l2_norm_clip=1.0, noise_multiplier=1.0,
                                         num_microbatches=M)
        with pytest.raises(ValueError, match=r"^pertower\.DPOptimizer\.compute_gradients: "
                                             + pattern):
            optimizer.compute_gradients(case.ys, case.xs, batch=[case.s1, case.s2], **kwargs)
        with pytest.raises(ValueError, match=r"^pertower\.DPOptimizer\.compute_gradients: "
                                             r"`loss` \(\S+\) is a scalar"):
            optimizer.compute_gradients(tf.reduce_mean(case.ys), case.xs, batch_size=[B1, B2])


# Messages: the examples ------------------------------------------------------------

_EXAMPLES = sorted(name for name in os.listdir(os.path.join(ROOT, "examples"))
                   if name.endswith(".py") and name != "digits_common.py")


def _source(name):
    with open(os.path.join(ROOT, "examples", name), encoding="utf-8") as f:
        return f.read()


@pytest.mark.parametrize("name", _EXAMPLES)
def test_every_example_sets_the_cli_environment_before_tensorflow(name):
    """As the CLI does: TF_CPP_MIN_LOG_LEVEL and TF_USE_LEGACY_KERAS set (setdefault)
    before the first import of TensorFlow or of a module that imports it."""
    text = _source(name)
    first_import = min(text.index(m.group(0)) for m in re.finditer(
        r"^(import|from) (tensorflow|tf_keras|pertower|digits_common)\b", text, re.M))
    for variable in ("TF_CPP_MIN_LOG_LEVEL", "TF_USE_LEGACY_KERAS"):
        at = text.find(f'os.environ.setdefault("{variable}"')
        assert 0 <= at < first_import, f"{name} does not set {variable} first"


@pytest.mark.parametrize("name", [n for n in _EXAMPLES if re.search(
    r"compat\.v1\.layers|rnn_cell|compat\.v1\.nn\.", _source(n))])
def test_an_example_on_keras_2_apis_says_the_fix_when_keras_3_is_asked_for(name):
    """Every example built on tf.compat.v1.layers or rnn_cell (found by reading them)
    stops with the fix under TF_USE_LEGACY_KERAS=0, not Keras 3's AttributeError."""
    env = dict(os.environ, TF_USE_LEGACY_KERAS="0", PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, os.path.join(ROOT, "examples", name)], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 1, done.stderr[-2000:]
    assert re.search(r"needs Keras 2, but TF_USE_LEGACY_KERAS='0': set it to 1 or unset it",
                     done.stderr), done.stderr[-2000:]
    assert "is not available with Keras 3" not in done.stderr


# v1 loops, in a process of their own ---------------------------------------------

SCRIPT = os.path.join(ROOT, "tests", "scripts", "messages_and_joined_checks.py")


# the checks of the heavy process "messages_joined_legacy_heavy" (the script's HEAVY)
HEAVY_CHECKS = ["check_joined_batches_through_a_shared_dynamic_rnn",
                "check_joined_batches_through_the_other_cells",
                "check_joined_microbatches_through_a_shared_dynamic_rnn",
                "check_joined_batches_through_a_v1_loop_after_a_lost_proof_unvalidated",
                "check_dp_optimizer_joined_batches_through_a_v1_loop",
                "check_the_fed_size_message_of_joined_batches_through_a_v1_loop"]


def _legacy_check_names():
    with open(SCRIPT, encoding="utf-8") as f:
        names = re.findall(r"^def (check_\w+)\(", f.read(), re.M)
    return [name for name in names if name not in HEAVY_CHECKS]

"""The one dispatch: `explain`, the strict "rules" method, the default run-time check
where the proof is lost, and the dynamic batch of the default method and DPOptimizer.
Every result is compared with the one-example loop of `pertower.oracle`."""

import warnings

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import pertower
from pertower import oracle
from tests import common


def _session(graph):
    sess = tf.compat.v1.Session(graph=graph)
    sess.run(tf.compat.v1.global_variables_initializer())
    return sess


@pytest.fixture(scope="module")
def mixed():
    """A Dense layer (rules) and a learned bound of a ClipByValue (which no rule
    covers: towers)."""
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(3)
        x = tf.compat.v1.placeholder(tf.float32, [None, 4], name="x")
        dense = keras.layers.Dense(3, name="dense")
        gain = tf.Variable(0.5, name="gain")
        h = dense(x)                                           # [B, 3]
        bound = 0.5 * tf.exp(gain * 0.1) ** 2                            # []
        clipped = tf.raw_ops.ClipByValue(t=tf.sin(h), clip_value_min=-bound,
                                         clip_value_max=bound)           # [B, 3]
        ys = tf.reduce_sum(clipped * h, axis=1)                          # [B]
        xs = dense.trainable_weights + [gain]
        sess = _session(graph)
    feed = {x: np.random.RandomState(0).randn(5, 4).astype(np.float32)}
    yield graph, sess, x, ys, xs, feed
    sess.close()


def test_explain_prints_each_weights_method_and_the_reason_it_falls_back(mixed):
    graph, _, _, ys, xs, _ = mixed
    with graph.as_default():
        ops_before = len(graph.get_operations())
        plan = pertower.explain(ys, xs, batch_size=5)
        assert len(graph.get_operations()) == ops_before   # builds nothing
    methods = {w.name: w.method for w in plan.weights}
    assert methods == {"dense/kernel:0": "rules", "dense/bias:0": "rules", "gain:0": "towers"}
    text = str(plan)
    lines = text.splitlines()
    assert lines[0].startswith("pertower plan for explain(method='auto'): ys ")
    assert "B = 5" in lines[0]
    kernel = next(line for line in lines if line.strip().startswith("dense/kernel:0"))
    assert "[4, 3]" in kernel and "rules" in kernel and "(MatMul)" in kernel
    gain = next(line for line in lines if line.strip().startswith("gain:0"))
    assert "towers" in gain and "it is read by" in gain
    assert "couplings: none found" in text
    assert "independence: proven" in text
    assert "run-time check: none" in text
    assert "memory: " in text and "the 5 towers' gradients" in text
    # the estimate counts tower gradients for `gain` only
    assert plan.estimate.tower_gradient_bytes == 5 * 1 * 4
    assert plan.estimate.result_bytes == 5 * (4 * 3 + 3 + 1) * 4


def test_explain_shows_couplings_instead_of_raising():
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        w = tf.Variable(tf.ones([3, 2]), name="w")
        h = tf.matmul(x, w)                                           # [B, 2]
        ys = h - tf.reduce_mean(h, axis=0, keepdims=True)            # couples examples
        plan = pertower.explain(ys, [w], batch_size=4)
        assert plan.verdict == "coupled"
        assert "couplings (refused):" in str(plan) and "Mean" in str(plan)
        with pytest.raises(ValueError, match="couples the examples"):
            pertower.per_example_gradients(ys, [w], batch_size=4)


def test_strict_rules_list_every_uncovered_weight(mixed):
    graph, _, _, ys, xs, _ = mixed
    with graph.as_default():
        with pytest.raises(ValueError, match=r"method='rules' is strict, and no rule covers "
                                             r"1 of the weights \(gain:0: it is read by"):
            pertower.per_example_gradients(ys, xs, batch_size=5, method="rules")
        with pytest.raises(ValueError, match=r"method='rules' is strict"):
            pertower.per_example_norms(ys, xs, batch_size=5, method="rules")
        plan = pertower.explain(ys, xs, batch_size=5, method="rules")   # shown, not raised
        assert plan.fallback == [2]


def test_auto_without_batch_size_lists_the_fallback_weights(mixed):
    graph, _, _, ys, xs, _ = mixed
    with graph.as_default():
        with pytest.raises(ValueError, match=r"no `batch_size` was given.*gain:0: it is read "
                                             r".*Pass batch_size=B"):
            pertower.per_example_gradients(ys, xs)
        # the covered weights alone need no batch_size
        grads = pertower.per_example_gradients(ys, xs[:2])
    assert all(g.shape.as_list()[0] is None for g in grads)


def test_default_method_and_dp_optimizer_work_for_two_fed_batch_sizes():
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(5)
        x = tf.compat.v1.placeholder(tf.float32, [None, 4], name="x")
        y = tf.compat.v1.placeholder(tf.int32, [None], name="y")
        net = keras.Sequential([keras.layers.Dense(6, activation="tanh"),
                                keras.layers.Dense(3)])
        loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=net(x))  # [B]
        xs = net.trainable_weights
        grads = pertower.per_example_gradients(loss, xs)
        norms = pertower.per_example_norms(loss, xs)
        dp = pertower.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                  l2_norm_clip=0.5, noise_multiplier=0.0)
        clipped = [g for g, _ in dp.compute_gradients(loss, var_list=xs)]
        sess = _session(graph)
    rng = np.random.RandomState(1)
    for B in (3, 7):
        feed = {x: rng.randn(B, 4).astype(np.float32), y: rng.randint(0, 3, B)}
        with graph.as_default():
            want = oracle.loop_per_example_gradients(sess, loss, xs, feed)
        got_grads, got_norms, got_clipped = sess.run([grads, norms, clipped], feed)
        common.assert_all_close(got_grads, want, kind="tight", what=f"gradients, B={B}")
        want_norms = np.sqrt(sum(np.sum(w.reshape(B, -1) ** 2, axis=1) for w in want))
        np.testing.assert_allclose(got_norms, want_norms, rtol=1e-5)
        factors = np.minimum(1.0, 0.5 / want_norms)                    # [B]
        want_clipped = [np.tensordot(factors, w, axes=1) / B for w in want]
        common.assert_all_close(got_clipped, want_clipped, kind="tight", what=f"DP, B={B}")
    sess.close()


def _scan_over_the_batch(x, w):
    """A running sum over the examples: row i depends on rows 0..i."""
    h = tf.matmul(x, w)                                                # [B, 2]
    return tf.scan(lambda acc, row: acc + row, h)                     # [B, 2]


def _rows_reversed_by_reshapes(x, w):
    """Rows reversed through reshapes and a transpose: row i is example B-1-i's."""
    h = tf.matmul(x, w)                                                # [B, 2]
    h = tf.reshape(h, [2, -1, 2])                                      # [2, B/2, 2]
    h = tf.transpose(tf.reverse(h, [1]), [0, 1, 2])                    # [2, B/2, 2]
    return tf.reshape(tf.reverse(h, [0]), [-1, 2])                     # [B, 2]


@pytest.mark.parametrize("build", [_scan_over_the_batch, _rows_reversed_by_reshapes])
def test_a_lost_proof_switches_the_run_time_check_on_and_it_catches_the_coupling(build):
    B = 2   # two examples couple already: fewer slices to replay and check
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        w = tf.Variable(np.arange(6, dtype=np.float32).reshape(3, 2) / 6, name="w")
        ys = build(x, w)
        sess = _session(graph)
        feed = {x: np.random.RandomState(2).randn(B, 3).astype(np.float32)}
        plan = pertower.explain(ys, [w], batch_size=B)
        if plan.verdict == "coupled":   # refused statically: also caught
            with pytest.raises(ValueError, match="couples the examples"):
                pertower.per_example_gradients(ys, [w], batch_size=B)
            return
        assert plan.verdict == "unproven" and plan.validate, str(plan)
        op, _ = plan.lost_at
        assert f"the proof was lost at {op.name}" in str(plan)
        with pytest.warns(UserWarning, match=rf"the proof was lost at '{op.name}'"):
            try:
                grads = pertower.per_example_gradients(ys, [w], batch_size=B)
            except ValueError as error:   # the slices cannot even be recomputed alone
                assert "replaying the graph from the batch to `ys` on slices" in str(error)
                return
        with warnings.catch_warnings():
            warnings.simplefilter("error")          # validate=False: no check, no warning
            unchecked = pertower.per_example_gradients(ys, [w], batch_size=B,
                                                       validate=False)
            # validate=True: the check, without the warning
            checked = pertower.per_example_gradients(ys, [w], batch_size=B, validate=True)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"recomputed one slice of the batch at a time differs"):
        sess.run(grads, feed)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"recomputed one slice of the batch at a time differs"):
        sess.run(checked, feed)
    assert sess.run(unchecked, feed)[0].shape == (B, 3, 2)
    sess.close()


def test_a_run_time_check_that_dropout_would_always_fail_is_refused_saying_why():
    """Recomputing `ys` slice by slice draws new dropout masks, so the check cannot
    pass: refused when the proof is lost (default) and with validate=True; explain
    still shows the plan, and validate=False builds it."""
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        w = tf.Variable(tf.ones([3, 2]), name="w")
        h = tf.compat.v1.nn.dropout(tf.matmul(x, w), rate=0.5)             # [B, 2]
        unproven = _rows_reversed_by_reshapes(h, tf.eye(2))               # [B, 2]
        assert pertower.explain(unproven, [w], batch_size=4).verdict == "unproven"
        with pytest.raises(ValueError, match=(
                r"could not prove.*the proof was lost at .*cannot pass: `ys` depends "
                r"on the random op .*dropout.*\(RandomUniform\).*validate=False")):
            pertower.per_example_gradients(unproven, [w], batch_size=4)
        proven = tf.reduce_sum(h, axis=1)                                  # [B]
        assert pertower.explain(proven, [w], batch_size=4).verdict == "independent"
        with pytest.raises(ValueError, match=(r"validate=True asks for the run-time check, "
                                              r"but the check .* cannot pass.*RandomUniform")):
            pertower.per_example_gradients(proven, [w], batch_size=4, validate=True)
        grads = pertower.per_example_gradients(proven, [w], batch_size=4)
        assert grads[0].shape.as_list() == [4, 3, 2]


def test_a_lost_proof_without_batch_size_asks_for_it():
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        w = tf.Variable(tf.ones([3, 2]), name="w")
        ys = _scan_over_the_batch(x, w)
        if pertower.explain(ys, [w]).verdict == "coupled":
            pytest.skip("the analysis refuses this scan statically")
        with pytest.raises(ValueError, match=r"could not be proven.*Pass batch_size=B"):
            pertower.per_example_gradients(ys, [w])


def test_validate_must_be_none_true_or_false(mixed):
    graph, _, _, ys, xs, _ = mixed
    with graph.as_default():
        with pytest.raises(ValueError, match=r"`validate` must be None \(the default"):
            pertower.per_example_gradients(ys, xs, batch_size=5, validate="yes")


def test_arguments_keep_one_order_everywhere(mixed):
    """(ys, xs, batch=None, batch_size=None, num_microbatches=None, ...)."""
    import inspect  # pylint: disable=import-outside-toplevel
    for function in (pertower.per_example_gradients, pertower.microbatch_gradients,
                     pertower.per_example_jacobians, pertower.per_example_norms,
                     pertower.explain, pertower.estimate_memory):
        names = list(inspect.signature(function).parameters)
        assert names[:4] == ["ys", "xs", "batch", "batch_size"], function.__name__
    graph, sess, _, ys, xs, feed = mixed
    with graph.as_default():
        got = pertower.microbatch_gradients(ys, xs, None, 5, 5)    # positional M = 5
        want = oracle.loop_per_example_gradients(sess, ys, xs, feed)
    common.assert_all_close(sess.run(got, feed), want, kind="tight", what="positional")

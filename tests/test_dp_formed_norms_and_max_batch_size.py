"""Issue 19, item 7: the convolutions' formed norms (`_convolution.norms`: the taps of the
channels-first input in one matmul, the squares by one reduction) and their clipped
sums, against the one-example loop `pertower.oracle`; and `max_batch_size` as a batch
capacity on every path: `DPOptimizer` with the rules alone (no towers) and
`DPSyncReplicasOptimizer` (one worker on a local session), a fed batch within it
against the loop, one above it refused at run time with the towers' message.
"""

import numpy as np
import pytest
import tensorflow as tf

import pertower
from pertower import oracle
from tests import common

B = 3
CLIP = 0.9
CONV_CLIP = 22.0   # between the conv model's per-example norms (19-30)
# the formed-norm convolutions of `conv_model` (the 1x1 one takes the engine's path)
FORMED_CONVOLUTIONS = 4


@pytest.fixture(scope="module")
def conv_model():
    """Convolutions whose norms are formed (not ghost: few channels for their
    positions): 3x3 SAME on 3 channels; 3x3 stride 2 VALID; 2x3 SAME; 1x1; and 3x3 SAME
    on two images per example (k = 2). σ = 0 DP gradients (the clipped mean), the
    per-example norms, and the loop's per-example gradients."""
    rng = np.random.RandomState(5)
    graph = tf.Graph()
    with graph.as_default():
        x, pairs, ws, loss = common.formed_norm_convs(rng)
        dp = pertower.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                  l2_norm_clip=CONV_CLIP, noise_multiplier=0.0, method="rules")
        means = [gr for gr, _ in dp.compute_gradients(loss, var_list=ws)]
        norms = pertower.per_example_norms(loss, ws, method="rules")   # [B]
        contractions = [op for op in graph.get_operations() if op.type == "Sum" and
                        op.name.split("/")[-1].startswith("formed_squares") and
                        op.name.startswith("dp_compute_gradients/")]   # `squares_of`
    (got_means, got_norms), per_example = common.run_formed_norm_convs(
        graph, x, pairs, ws, loss, [means, norms], B, rng)
    return dict(means=got_means, norms=got_norms, per_example=per_example,
                contractions=contractions)


def test_formed_conv_norms_and_clipped_sums_equal_the_loop_s(conv_model):
    norms, means = common.loop_clipped_mean(conv_model["per_example"], CONV_CLIP)
    assert (norms > CONV_CLIP).any() and (norms < CONV_CLIP).any(), norms   # some clipped
    # every convolution but the 1x1 one took the formed layout
    assert len(conv_model["contractions"]) == FORMED_CONVOLUTIONS
    common.assert_all_close(conv_model["norms"], norms, what="norms", kind="deep")
    common.assert_all_close(conv_model["means"], means, what="clipped mean", kind="deep")


def _dense_loss(x, y, xs):
    logits = tf.matmul(tf.nn.softplus(tf.matmul(x, xs[0])), xs[1])          # [B, 2]
    return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)   # [B]


N = 4   # the capacity


@pytest.fixture(scope="module")
def capacity_steps():
    """One graph: `DPOptimizer` (rules alone: no towers) and a one-worker
    `DPSyncReplicasOptimizer` (R = W = 1, local session), both σ = 0 with
    max_batch_size=N, on a dense model with a batch of varying size."""
    rng = np.random.RandomState(3)
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float64, [None, 3], name="x")
        y = tf.compat.v1.placeholder(tf.int32, [None], name="y")
        xs = [tf.Variable(rng.randn(3, 4) * 0.8), tf.Variable(rng.randn(4, 2) * 0.8)]
        loss = _dense_loss(x, y, xs)
        sgd = tf.compat.v1.train.GradientDescentOptimizer
        dp = pertower.DPOptimizer(sgd(0.5), l2_norm_clip=CLIP, noise_multiplier=0.0,
                                  method="rules")
        means = [g for g, _ in dp.compute_gradients(loss, var_list=xs, max_batch_size=N)]
        global_step = tf.compat.v1.train.get_or_create_global_step()
        sync = pertower.DPSyncReplicasOptimizer(sgd(0.5), l2_norm_clip=CLIP,
                                                noise_multiplier=0.0, replicas_to_aggregate=1)
        sums = sync.compute_gradients(loss, var_list=xs, max_batch_size=N)
        train_op = sync.apply_gradients(sums, global_step=global_step)
        loop = oracle.SliceLoop(loss, xs)
        sess = tf.compat.v1.train.MonitoredSession(
            tf.compat.v1.train.ChiefSessionCreator(), hooks=[sync.make_session_run_hook(True)],
            stop_grace_period_secs=1)
        yield dict(sess=sess, x=x, y=y, xs=xs, means=means, sums=[g for g, _ in sums],
                   train_op=train_op, loop=loop, rng=rng)
        sess.close()


def _feed(m, b):
    return {m["x"]: m["rng"].randn(b, 3), m["y"]: m["rng"].randint(2, size=b)}


@pytest.mark.parametrize("b", [1, N])
def test_a_batch_within_the_capacity_runs_as_the_loop_on_every_path(capacity_steps, b):
    m = capacity_steps
    feed = _feed(m, b)
    sess = m["sess"]
    before = sess.run(m["xs"])
    _, means = common.loop_clipped_mean(m["loop"].run(sess, feed, b), CLIP)
    got_means, pushed = sess.run([m["means"], m["sums"]], feed)
    common.assert_all_close(got_means, means, what=f"DPOptimizer b={b}", kind="tight")
    common.assert_all_close(pushed, [s * b for s in means], what=f"pushed b={b}",
                            kind="tight")
    sess.run(m["train_op"], feed)          # the worker's step: the pushed sum / b
    common.assert_all_close(sess.run(m["xs"]), [w - 0.5 * s for w, s in zip(before, means)],
                            what=f"the worker's step b={b}", kind="tight")


@pytest.mark.parametrize("which", ["means", "sums"])
def test_a_batch_above_the_capacity_fails_at_run_time_on_every_path(capacity_steps, which):
    m = capacity_steps
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=f"the DP step was built for batches of at most {N} examples "
                             f"\\(max_batch_size={N}\\).*has {N + 1} examples"):
        m["sess"].run(m["means" if which == "means" else "sums"], _feed(m, N + 1))


def test_the_two_worker_rows_alternate_and_carry_their_ratio_to_plain(monkeypatch):
    """`run_worker_bench` alternates the clusters (plain, dp, plain, dp) and pools each
    kind's steps; `plain_ratios` (the table's "x plain", the JSON's "x_plain") divides a
    cluster's rows by its own plain step, the single-process rows by theirs."""
    from benchmarks import dp, dp_workers  # pylint: disable=import-outside-toplevel
    calls = []

    def launch(model, B, steps, plain, python):
        calls.append("plain" if plain else "dp")
        n = len(calls)
        return ([40.0 + n], [20.0 + n]) if plain else ([60.0 + n], [30.0 + n])
    monkeypatch.setattr(dp_workers, "_launch", launch)
    entries = dp_workers.run_worker_bench(["mlp"], {"mlp": 8}, report=lambda line: None,
                                          rounds=2)
    assert calls == ["plain", "dp", "plain", "dp"]
    assert [(e.name, e.runs_ms) for e in entries] == [
        ("2 workers: plain step", [41.0, 43.0]), ("2 workers: dp step", [62.0, 64.0]),
        ("2 workers CPU: plain step", [21.0, 23.0]), ("2 workers CPU: dp step", [32.0, 34.0])]
    rows = [dp.DPEntry("mlp", 8, "plain step", runs_ms=[10.0]),
            dp.DPEntry("mlp", 8, "dp step[auto]", runs_ms=[15.0]),
            dp.DPEntry("mlp", 8, dp.PHILOX_UNIFORMS, runs_ms=[0.5])] + entries
    assert dp.plain_ratios(rows) == pytest.approx(
        [1.0, 1.5, 0.05, 1.0, 63.0 / 42.0, 1.0, 33.0 / 22.0])

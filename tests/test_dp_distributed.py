"""pertower.DPSyncReplicasOptimizer: DP-SGD across the workers of a TensorFlow cluster.

The cluster checks (one parameter server, two workers as threads with their own graphs
and sessions) run in a fresh interpreter, tests/scripts/dp_distributed_checks.py
(tests/test_clusters.py): one step with σ = 0 against DPOptimizer on the concatenated
batch and the loop's clipped mean; the noise against chi-square bounds (chief mode draws
once, split mode's shares uncorrelated); split mode refused with partial aggregation.
More draws, and the step under disable_v2_behavior(): heavy, here.
Here, in the test process: the arguments and one worker on a local session.
"""

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import pertower
from pertower import oracle
from tests import common

@pytest.mark.heavy
@pytest.mark.parametrize("argument", ["stats", "legacy"])
def test_noise_statistics_with_more_draws_and_one_step_under_disable_v2_behavior(argument):
    done = common.run_python("tests/scripts/dp_distributed_checks.py", argument)
    assert ", 0 failed" in done.stdout, done.stdout


def _sgd():
    return tf.compat.v1.train.GradientDescentOptimizer(0.5)


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(noise="twice"), ValueError, r"`noise` must be \"chief\" or \"split\", but "
                                      r"received 'twice'"),
    (dict(noise="split"), ValueError, r"needs `task_index`, this worker's index in "
                                      r"\[0, 2\).*received None"),
    (dict(noise="split", task_index=2), ValueError, r"received 2"),
    (dict(noise="split", task_index=0, replicas_to_aggregate=1), ValueError,
     r"`replicas_to_aggregate` \(1\) < `total_num_replicas` \(2\)"),
    (dict(replicas_to_aggregate=0), ValueError, r"`replicas_to_aggregate` must be a "
                                                r"positive integer, but received 0"),
    (dict(seed=1.5), TypeError, r"`seed` must be an int or None, but received float"),
    (dict(expected_global_batch=0), ValueError, r"expected_global_batch"),
    (dict(noise_multiplier=-1.0), ValueError, r"noise_multiplier"),
])
def test_bad_arguments_are_refused(kwargs, error, words):
    arguments = dict(optimizer=_sgd(), l2_norm_clip=1.0, noise_multiplier=1.1,
                     replicas_to_aggregate=2, total_num_replicas=2)
    arguments.update(kwargs)
    with pytest.raises(error, match=r"^pertower.DPSyncReplicasOptimizer: .*" + words):
        pertower.DPSyncReplicasOptimizer(**arguments)


@pytest.fixture(scope="module", params=[None, 10, "banded"])
def one_worker(request):
    """A local session as a one-worker cluster (R = W = 1), σ = 0; B = 4; the division
    by the pushed count (None) or by a fixed expected global batch (10); "banded": the
    chief adds a `pertower.BandedMFNoise` (`mechanism=`), dividing by the count."""
    banded = request.param == "banded"
    expected = None if banded else request.param
    rng = np.random.RandomState(11)
    weights = [rng.randn(3, 4) * 0.8, rng.randn(4, 2) * 0.8]
    x_value, y_value = rng.randn(4, 3), rng.randint(2, size=4)
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float64, [None, 3])
        y = tf.compat.v1.placeholder(tf.int32, [None])
        xs = [tf.compat.v1.get_variable(f"w{k}", initializer=tf.constant(w))
              for k, w in enumerate(weights)]
        logits = tf.matmul(tf.nn.softplus(tf.matmul(x, xs[0])), xs[1])          # [B, 2]
        loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        global_step = tf.compat.v1.train.get_or_create_global_step()
        dp = pertower.DPSyncReplicasOptimizer(
            _sgd(), l2_norm_clip=1.55, noise_multiplier=0.0, replicas_to_aggregate=1,
            expected_global_batch=expected,
            mechanism=pertower.BandedMFNoise(2, seed=3) if banded else None)
        with pytest.raises(RuntimeError, match=r"^pertower.DPSyncReplicasOptimizer."
                                               r"apply_gradients: call compute_gradients"):
            dp.apply_gradients([], global_step=global_step)
        sums = dp.compute_gradients(loss, var_list=xs)
        with pytest.raises(ValueError, match=r"`global_step` is required"):
            dp.apply_gradients(sums)
        train_op = dp.apply_gradients(sums, global_step=global_step)
        loop = oracle.SliceLoop(loss, xs)
        feed = {x: x_value, y: y_value}
        sess = tf.compat.v1.train.MonitoredSession(
            tf.compat.v1.train.ChiefSessionCreator(), hooks=[dp.make_session_run_hook(True)],
            stop_grace_period_secs=1)   # the chief's token queue runner waits on its queue
        before = sess.run(xs)
        per_example = loop.run(sess, feed, 4)           # [4, *x.shape] each, at `before`
        pushed, count, _ = sess.run([[g for g, _ in sums], dp.count, train_op], feed)
        after = sess.run(xs)
        if banded:   # the chief's release moved the mechanism's step once
            assert sess.run(dp._chief_noise.state.step) == 1  # pylint: disable=protected-access
        sess.close()
    return dict(dp=dp, divisor=expected or 4, before=before, per_example=per_example,
                pushed=pushed, count=count, after=after)


def test_one_worker_pushes_the_loops_clipped_sum_and_applies_its_mean(one_worker):
    """The push is the loop's clipped sum; the step divides it by the count, 4, or by
    expected_global_batch."""
    per_example = one_worker["per_example"]
    norms = np.sqrt(sum((g.reshape(4, -1) ** 2).sum(1) for g in per_example))
    assert (norms > 1.55).any() and (norms < 1.55).any(), norms     # some clipped, some not
    factors = 1.55 / np.maximum(norms, 1.55)
    clipped_sum = [np.tensordot(factors, g, axes=1) for g in per_example]
    common.assert_all_close(one_worker["pushed"], clipped_sum, what="pushed", kind="tight")
    assert one_worker["count"] == 4
    common.assert_all_close(one_worker["after"],
                            [w - 0.5 * s / one_worker["divisor"]
                             for w, s in zip(one_worker["before"], clipped_sum)],
                            what="the step", kind="tight")


def test_public_surface(one_worker):
    dp = one_worker["dp"]
    assert "DPSyncReplicasOptimizer" in pertower.__all__
    assert isinstance(dp.sync_optimizer, tf.compat.v1.train.SyncReplicasOptimizer)
    assert (dp.replicas_to_aggregate, dp.total_num_replicas, dp.noise) == (1, 1, "chief")
    assert dp.expected_global_batch in (None, 10.0)
    assert repr(dp).startswith("DPSyncReplicasOptimizer(GradientDescentOptimizer, "
                               "l2_norm_clip=1.55, noise_multiplier=0.0")


@pytest.mark.heavy
def test_two_worker_example_prints_loss_accuracy_and_epsilon():
    """examples/dp_two_workers.py --quick: a ps and two workers as processes, 5 steps."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, os.path.join("examples", "dp_two_workers.py"),
                           "--quick"], cwd=root, env=env, capture_output=True, text=True,
                          timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    losses = [float(v) for v in re.findall(r"\[chief\] step \d+: loss ([0-9.]+)", done.stdout)]
    assert len(losses) == 5 and all(0 < v < 10 for v in losses), done.stdout
    assert re.search(r"\[chief\] DP test accuracy 0\.\d{3} after 5 steps", done.stdout)
    eps = re.search(r"\[chief\] epsilon = ([0-9.]+) at delta = 1e-05 \(5 global steps, "
                    r"q = 0\.0333", done.stdout)
    assert eps, done.stdout
    # the global batch (50 of 1500) and the global steps, not one worker's
    assert float(eps.group(1)) == round(pertower.compute_epsilon(5, 1.1, 50 / 1500, 1e-5), 2)
    for task in range(2):
        assert re.search(rf"\[worker {task}\] DP median step [0-9.]+ ms", done.stdout)

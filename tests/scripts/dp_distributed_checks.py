"""Run in a process of its own (servers live until the process ends): DP-SGD across the
workers of a TensorFlow cluster of in-process `tf.distribute.Server`s on 127.0.0.1 (one
parameter server, two workers, each worker a thread with its own graph and session, as
between-graph replication), `pertower.DPSyncReplicasOptimizer` against the single-process
`DPOptimizer` and the one-example loop, and its noise against a chi-square bound.

    python tests/scripts/dp_distributed_checks.py [stats | legacy]

run by tests/test_dp_distributed.py with "stats" (the statistical checks with more
draws) or "legacy" (the σ = 0 step under disable_v2_behavior()), both heavy; the
default run's checks run in tests/scripts/clusters.py. Prints one line per check
(`tests.scripts.run_each`) and exits 1 if one failed.
"""

import os
import sys
import threading

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from scipy import stats  # noqa: E402

LEGACY = sys.argv[1:] == ["legacy"]   # reference variables and v1 control flow
if LEGACY:
    tf.compat.v1.disable_v2_behavior()
else:
    tf.compat.v1.disable_eager_execution()

import pertower  # noqa: E402
from pertower import oracle  # noqa: E402
from tests import common  # noqa: E402
from tests import scripts  # noqa: E402

W = 2                 # workers
SIZES = (3, 4)        # each worker's batch: the global batch is 7
LR = 0.5
# The probability that a correct implementation fails one chi-square or correlation check.
ALPHA = 1e-6


def _cluster():
    """A fresh cluster (one ps, W workers): the accumulators and the token queue have
    fixed shared names, so every configuration gets servers of its own."""
    ports = scripts.free_ports(W + 1)
    spec = tf.train.ClusterSpec({"ps": [f"127.0.0.1:{ports[0]}"],
                                 "worker": [f"127.0.0.1:{p}" for p in ports[1:]]})
    servers = [tf.distribute.Server(spec, job_name="ps", task_index=0)]
    servers += [tf.distribute.Server(spec, job_name="worker", task_index=i) for i in range(W)]
    return spec, servers[1:]


class Mlp:
    """x [B, 5] -> tanh(x W1 + b1) W2 -> softmax cross-entropy [B], float64."""

    dtype = tf.float64

    def __init__(self):
        rng = np.random.RandomState(3)
        self.weights = [rng.randn(5, 6) * 0.7, rng.randn(6) * 0.1, rng.randn(6, 3) * 0.7]
        self.x = rng.randn(sum(SIZES), 5)
        self.y = rng.randint(3, size=sum(SIZES))

    def build(self):
        x = tf.compat.v1.placeholder(tf.float64, [None, 5], name="x")
        y = tf.compat.v1.placeholder(tf.int32, [None], name="y")
        xs = [tf.compat.v1.get_variable(f"w{k}", initializer=tf.constant(w))
              for k, w in enumerate(self.weights)]
        logits = tf.matmul(tf.tanh(tf.matmul(x, xs[0]) + xs[1]), xs[2])       # [B, 3]
        loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        return (x, y), loss, xs

    def feed(self, placeholders, rows):
        return {placeholders[0]: self.x[rows], placeholders[1]: self.y[rows]}


class Probe:
    """loss_i = <a_i, v> for a [P] weight v: example i's gradient is a_i whatever v is,
    so the clipped sum is known and every update is that sum plus the noise."""

    dtype = tf.float32

    def __init__(self, P=4000):
        rng = np.random.RandomState(4)
        self.weights = [np.zeros(P, np.float32)]
        self.x = rng.randn(sum(SIZES), P).astype(np.float32) * 0.05   # norms ~3.2 > C
        self.y = None

    def build(self):
        a = tf.compat.v1.placeholder(tf.float32, [None, self.x.shape[1]], name="a")
        v = tf.compat.v1.get_variable("v", initializer=tf.constant(self.weights[0]))
        return (a,), tf.linalg.matvec(a, v), [v]                               # [B]

    def feed(self, placeholders, rows):
        return {placeholders[0]: self.x[rows]}

    def clipped_sum(self, rows, clip):
        a = self.x[rows].astype(np.float64)
        norms = np.linalg.norm(a, axis=1)
        return (a * (clip / np.maximum(norms, clip))[:, None]).sum(axis=0)


def _rows(task):
    start = sum(SIZES[:task])
    return np.arange(start, start + SIZES[task])


def run_cluster(model, steps, clip, sigma, noise="chief", seed=7, R=W, optimizer=None):
    """One PS, W worker threads; each builds its graph, runs `steps` steps on its rows;
    `optimizer`: None (gradient descent) or () -> the optimizer each worker wraps.

    Returns (the weights before, the weights after each step, each worker's pushed sums
    per step), numpy."""
    spec, servers = _cluster()
    chief_ready, after = threading.Event(), [None] * steps
    pushed, before, errors = [[] for _ in range(W)], [], []
    step_done = threading.Barrier(W)

    def worker(task):
        try:
            graph = tf.Graph()
            with graph.as_default(), tf.compat.v1.device(tf.compat.v1.train.replica_device_setter(
                    worker_device=f"/job:worker/task:{task}", cluster=spec)):
                placeholders, loss, xs = model.build()
                global_step = tf.compat.v1.train.get_or_create_global_step()
                dp = pertower.DPSyncReplicasOptimizer(
                    optimizer() if optimizer else
                    tf.compat.v1.train.GradientDescentOptimizer(LR), l2_norm_clip=clip,
                    noise_multiplier=sigma, replicas_to_aggregate=R, total_num_replicas=W,
                    noise=noise, seed=seed, task_index=task)
                sums = dp.compute_gradients(loss, var_list=xs)
                train_op = dp.apply_gradients(sums, global_step=global_step)
            hook = dp.make_session_run_hook(task == 0)
            if task == 0:
                creator = tf.compat.v1.train.ChiefSessionCreator(master=servers[0].target)
            else:
                chief_ready.wait()
                creator = tf.compat.v1.train.WorkerSessionCreator(master=servers[task].target)
            with graph.as_default():
                sess = tf.compat.v1.train.MonitoredSession(creator, hooks=[hook],
                                                           stop_grace_period_secs=1)
                if task == 0:
                    before.append(sess.run(xs))      # the weights before the first step
                    chief_ready.set()
                feed = model.feed(placeholders, _rows(task))
                for step in range(steps):
                    _, values = sess.run([train_op, [g for g, _ in sums]], feed)
                    pushed[task].append(values)
                    step_done.wait(timeout=300)    # every worker's push of this step is in
                    if task == 0:
                        after[step] = sess.run(xs)
                    step_done.wait(timeout=300)
            # (sessions stay open: the chief's queue runner waits in a take until exit)
        except Exception as error:  # pylint: disable=broad-except  # reported below
            errors.append(error)
            chief_ready.set()
            step_done.abort()

    threads = [threading.Thread(target=worker, args=(t,), daemon=True) for t in range(W)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    if errors:
        raise errors[0]
    return before[0], after, pushed


def check_one_step_equals_single_process_and_loop():
    """σ = 0: the distributed step on 3 + 4 examples equals DPOptimizer's step on the 7,
    and the loop's clipped mean (float64)."""
    model, clip = Mlp(), 0.8
    before, after, _ = run_cluster(model, 1, clip, 0.0)
    with tf.Graph().as_default():
        placeholders, loss, xs = model.build()
        dp = pertower.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer(LR),
                                  l2_norm_clip=clip, noise_multiplier=0.0)
        grads = [g for g, _ in dp.compute_gradients(loss, var_list=xs)]
        loop = oracle.SliceLoop(loss, xs)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            feed = model.feed(placeholders, np.arange(sum(SIZES)))
            single = sess.run(grads, feed)
            per_example = loop.run(sess, feed, sum(SIZES))          # [7, *x.shape] each
    norms = np.sqrt(sum((g.reshape(len(g), -1) ** 2).sum(1) for g in per_example))
    if not (norms > clip).any() or (norms > clip).all():
        raise AssertionError(f"the clip {clip} should clip some examples, not all: {norms}")
    factors = clip / np.maximum(norms, clip)
    looped = [np.tensordot(factors, g, axes=1) / len(factors) for g in per_example]
    want = [w - LR * g for w, g in zip(before, single)]
    common.assert_all_close(after[0], want, what="distributed step vs DPOptimizer", kind="tight")
    common.assert_all_close(after[0], [w - LR * g for w, g in zip(before, looped)],
                            what="distributed step vs the loop's clipped mean", kind="tight")
    return f"clipped {int((norms > clip).sum())} of {len(norms)} examples"


def _chi_square_std(samples, sigma, what):
    """Asserts that `samples` (independent, mean 0) have standard deviation `sigma`:
    n s² / σ² ~ χ²(n), two-sided at level ALPHA. Returns s / σ."""
    n = samples.size
    statistic = float((samples.astype(np.float64) ** 2).sum() / sigma ** 2)
    low, high = stats.chi2.ppf(ALPHA / 2, n), stats.chi2.ppf(1 - ALPHA / 2, n)
    if not low <= statistic <= high:
        raise AssertionError(f"{what}: s/σ = {np.sqrt(statistic / n):.4f} (n = {n}), outside "
                             f"[{np.sqrt(low / n):.4f}, {np.sqrt(high / n):.4f}]")
    return np.sqrt(statistic / n)


def _uncorrelated(a, b, what):
    """Asserts |corr(a, b)| below the two-sided ALPHA bound of independent normals."""
    r = float(np.corrcoef(a.ravel(), b.ravel())[0, 1])
    bound = stats.norm.ppf(1 - ALPHA / 2) / np.sqrt(a.size)
    if abs(r) > bound:
        raise AssertionError(f"{what}: correlation {r:.4f}, above {bound:.4f}")
    return r


def _update_noise(model, before, after, clip):
    """Per step: B * (the update / -LR) - the known clipped sum = the noise on the sum."""
    B, rows = sum(SIZES), np.arange(sum(SIZES))
    previous, noises = before[0], []
    for weights in after:
        gradient = (previous - weights[0]).astype(np.float64) / LR
        noises.append(B * gradient - model.clipped_sum(rows, clip))
        previous = weights[0]
    return np.stack(noises)                                             # [steps, P]


def noise_checks(steps, P):
    """The noise checks, with `steps` steps of a [P] probe in each mode."""
    clip, sigma = 1.0, 1.3

    def check_chief_noise_drawn_once():
        """Chief mode: the workers push un-noised sums; the update's noise has std σC/B
        (σC on the sum), not sqrt(W) times that."""
        model = Probe(P)
        before, after, pushed = run_cluster(model, steps, clip, sigma, noise="chief")
        for task in range(W):
            for values in pushed[task]:
                want = model.clipped_sum(_rows(task), clip).astype(np.float32)
                common.assert_all_close(values, [want],
                                        what=f"worker {task}'s un-noised push", kind="tight")
        ratio = _chi_square_std(_update_noise(model, before, after, clip), sigma * clip,
                                "chief-mode noise on the sum")
        return f"s/(σC) = {ratio:.4f} over {steps * P} draws"

    def check_split_noise_shares_uncorrelated():
        """Split mode: each worker's push carries N(0, σ²C²/W) of its own, the two
        uncorrelated; their sum, the update's noise, has std σC."""
        model = Probe(P)
        before, after, pushed = run_cluster(model, steps, clip, sigma, noise="split")
        shares = [np.stack([values[0] - model.clipped_sum(_rows(task), clip)
                            for values in pushed[task]]) for task in range(W)]
        ratios = [_chi_square_std(s, sigma * clip / np.sqrt(W), f"worker {t}'s noise share")
                  for t, s in enumerate(shares)]
        r = _uncorrelated(shares[0], shares[1], "the two workers' noise")
        total = _update_noise(model, before, after, clip)
        common.assert_all_close([total], [shares[0] + shares[1]], rtol=1e-4, atol=1e-3,
                                what="the update's noise = the sum of the shares")
        ratio = _chi_square_std(total, sigma * clip, "split-mode noise on the sum")
        return (f"shares s/(σC/sqrt(W)) = {ratios[0]:.4f}, {ratios[1]:.4f}; corr = {r:.4f}; "
                f"total s/(σC) = {ratio:.4f} over {steps * P} draws")

    return [check_chief_noise_drawn_once, check_split_noise_shares_uncorrelated]


def check_split_mode_refused_with_partial_aggregation():
    """noise="split" with replicas_to_aggregate < total_num_replicas is refused."""
    sgd = tf.compat.v1.train.GradientDescentOptimizer(LR)
    try:
        pertower.DPSyncReplicasOptimizer(sgd, 1.0, 1.1, replicas_to_aggregate=1,
                                         total_num_replicas=2, noise="split", task_index=0)
    except ValueError as error:
        if "`replicas_to_aggregate` (1) < `total_num_replicas` (2)" not in str(error):
            raise AssertionError(f"unexpected message: {error}") from error
        if not str(error).startswith("pertower.DPSyncReplicasOptimizer: "):
            raise AssertionError(f"the message names no function: {error}") from error
        return str(error)
    raise AssertionError("split mode with partial aggregation was accepted")


def default_checks():
    """The default run's checks (run by tests/scripts/clusters.py)."""
    return [check_one_step_equals_single_process_and_loop,
            check_split_mode_refused_with_partial_aggregation,
            *noise_checks(steps=2, P=3000)]


def main():
    if sys.argv[1:] == ["stats"]:
        checks = noise_checks(steps=5, P=20000)
    elif LEGACY:
        checks = [check_one_step_equals_single_process_and_loop]
    else:
        checks = default_checks()
    code = scripts.run_each(checks)
    sys.stdout.flush()
    # Servers cannot be stopped cleanly in-process; leave without waiting for them.
    os._exit(code)  # pylint: disable=protected-access


if __name__ == "__main__":
    main()

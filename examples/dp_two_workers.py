"""DP-SGD on two TensorFlow workers and a parameter server, as separate processes.

The script launches a cluster on 127.0.0.1 (free ports): one parameter server and two
workers, each a process of its own running this file with --job/--task. Every worker
builds the same graph (between-graph replication, `replica_device_setter`): the small
digits CNN, its per-example loss, and `pertower.DPSyncReplicasOptimizer`. Each step,
each worker clips every example of its half-batch and pushes the clipped sum and the
count to the parameter server; the chief (worker 0) adds the Gaussian noise once and
applies the noisy mean of the global batch. The chief prints the loss, the test
accuracy and the privacy spent, (ε, δ) from `pertower.compute_epsilon` with the global
batch's sampling probability (global batch / 1500) and the number of global steps.

Run:  python examples/dp_two_workers.py                   (60 steps)
      python examples/dp_two_workers.py --quick           (5 steps: a smoke test)
      python examples/dp_two_workers.py --compare         (also two plain workers, and
                                                           the median step times)
"""

import argparse
import os
import socket
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import pertower  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import digits_common  # noqa: E402  pylint: disable=wrong-import-position

tf.compat.v1.disable_eager_execution()
WORKERS = 2


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=50, help="global batch")
    parser.add_argument("--learning-rate", type=float, default=0.5)
    parser.add_argument("--l2-norm-clip", type=float, default=1.0)
    parser.add_argument("--noise-multiplier", type=float, default=1.1)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="5 steps (a smoke test)")
    parser.add_argument("--compare", action="store_true",
                        help="also run two plain (non-private) workers; print step times")
    # set by the launcher for its children
    parser.add_argument("--job", choices=["ps", "worker"], help=argparse.SUPPRESS)
    parser.add_argument("--task", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--ports", help=argparse.SUPPRESS)
    parser.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _cluster_spec(ports):
    ports = [int(p) for p in ports.split(",")]
    return tf.train.ClusterSpec({"ps": [f"127.0.0.1:{ports[0]}"],
                                 "worker": [f"127.0.0.1:{p}" for p in ports[1:]]})


def run_ps(args):
    server = tf.distribute.Server(_cluster_spec(args.ports), job_name="ps", task_index=0)
    server.join()      # until the launcher ends this process


def run_worker(args):
    """One worker: its shard of the digits, `steps` synchronous steps; the chief reports."""
    spec, task, is_chief = _cluster_spec(args.ports), args.task, args.task == 0
    server = tf.distribute.Server(spec, job_name="worker", task_index=task)
    x_train, y_train, x_test, y_test = digits_common.load_digits(args.seed)
    shard = np.arange(task, len(y_train), WORKERS)          # this worker's examples
    local_batch = args.batch_size // WORKERS
    graph = tf.Graph()
    with graph.as_default(), tf.compat.v1.device(tf.compat.v1.train.replica_device_setter(
            worker_device=f"/job:worker/task:{task}", cluster=spec)):
        digits_common.seed_graph(args.seed)
        x = tf.compat.v1.placeholder(tf.float32, [None, 8, 8, 1], name="images")
        y = tf.compat.v1.placeholder(tf.int32, [None], name="labels")
        model = digits_common.build_cnn()
        logits = model(x)                                                   # [B, 10]
        loss = digits_common.per_example_loss(logits, y)                    # [B]
        global_step = tf.compat.v1.train.get_or_create_global_step()
        sgd = tf.compat.v1.train.GradientDescentOptimizer(args.learning_rate)
        if args.plain:
            sync = tf.compat.v1.train.SyncReplicasOptimizer(sgd, WORKERS, WORKERS)
            train_op = sync.minimize(tf.reduce_mean(loss), global_step=global_step,
                                     var_list=model.trainable_weights)
            hook = sync.make_session_run_hook(is_chief, num_tokens=0)
        else:
            sync = pertower.DPSyncReplicasOptimizer(
                sgd, l2_norm_clip=args.l2_norm_clip, noise_multiplier=args.noise_multiplier,
                replicas_to_aggregate=WORKERS, total_num_replicas=WORKERS, seed=args.seed)
            train_op = sync.minimize(loss, global_step=global_step,
                                     var_list=model.trainable_weights)
            hook = sync.make_session_run_hook(is_chief)
        mean_loss = tf.reduce_mean(loss)
        if is_chief:
            creator = tf.compat.v1.train.ChiefSessionCreator(master=server.target)
        else:
            # TF's worker session checks for the chief's initialization every 30 s; poll
            # faster ourselves, then create it
            uninitialized = tf.compat.v1.report_uninitialized_variables(
                tf.compat.v1.global_variables())
            with tf.compat.v1.Session(server.target) as probe:
                while len(probe.run(uninitialized)):
                    time.sleep(0.2)
            creator = tf.compat.v1.train.WorkerSessionCreator(master=server.target)
        sess = tf.compat.v1.train.MonitoredSession(creator, hooks=[hook])
        rng = np.random.RandomState(args.seed + 1 + task)
        seconds, losses = [], []
        for step in range(args.steps):
            rows = rng.choice(shard, local_batch, replace=False)
            feed = {x: x_train[rows], y: y_train[rows]}
            start = time.perf_counter()
            _, value = sess.run([train_op, mean_loss], feed)
            seconds.append(time.perf_counter() - start)
            losses.append(value)
            if is_chief and (step + 1) % max(1, args.steps // 5) == 0:
                print(f"[chief] step {step + 1}: loss {np.mean(losses[-10:]):.3f}", flush=True)
        kind = "plain" if args.plain else "DP"
        median = float(np.median(seconds[min(3, len(seconds) - 1):]))
        print(f"[worker {task}] {kind} median step {median * 1e3:.1f} ms", flush=True)
        if is_chief:
            accuracy = digits_common.accuracy(sess, logits, x, x_test, y_test)
            print(f"[chief] {kind} test accuracy {accuracy:.3f} after {args.steps} steps of a "
                  f"global batch of {args.batch_size}", flush=True)
            if not args.plain:
                q = args.batch_size / len(y_train)
                eps = pertower.compute_epsilon(args.steps, args.noise_multiplier, q, args.delta)
                print(f"[chief] epsilon = {eps:.2f} at delta = {args.delta:g} ({args.steps} "
                      f"global steps, q = {q:.4f}, noise multiplier {args.noise_multiplier}, "
                      f"clip {args.l2_norm_clip})", flush=True)
    # The servers cannot be stopped in-process (nor the plain chief's queue runner, which
    # waits in a take): leave without waiting for them.
    sys.stdout.flush()
    os._exit(0)  # pylint: disable=protected-access


def _free_ports(n):
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def launch(args, plain):
    """Starts the ps and the workers; waits for the workers; ends the ps. Returns the
    workers' exit codes."""
    ports = ",".join(map(str, _free_ports(WORKERS + 1)))
    common = [sys.executable, os.path.abspath(__file__), "--ports", ports,
              "--steps", str(args.steps), "--batch-size", str(args.batch_size),
              "--learning-rate", str(args.learning_rate),
              "--l2-norm-clip", str(args.l2_norm_clip),
              "--noise-multiplier", str(args.noise_multiplier), "--delta", str(args.delta),
              "--seed", str(args.seed)] + (["--plain"] if plain else [])
    ps = subprocess.Popen(common + ["--job", "ps"])
    try:
        workers = [subprocess.Popen(common + ["--job", "worker", "--task", str(t)])
                   for t in range(WORKERS)]
        return [w.wait() for w in workers]
    finally:
        ps.kill()
        ps.wait()


def main(argv=None):
    args = parse_args(argv)
    if args.job == "ps":
        return run_ps(args)
    if args.job == "worker":
        return run_worker(args)
    if args.quick:
        args.steps = 5
    print(f"cluster: 1 parameter server, {WORKERS} workers on 127.0.0.1; global batch "
          f"{args.batch_size} ({args.batch_size // WORKERS} per worker)", flush=True)
    codes = launch(args, plain=False)
    if args.compare and not any(codes):
        codes = launch(args, plain=True)
    if any(codes):
        print(f"a worker failed: exit codes {codes}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

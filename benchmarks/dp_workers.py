"""`python -m benchmarks --dp-workers`: the distributed DP step on this machine, two TensorFlow
workers and a parameter server as processes of their own, against two plain workers.

Notation:
    W   workers (2)      B   examples per worker (the global batch is W*B)

For each model, the driver (`run_worker_bench`) starts a cluster on 127.0.0.1 (free
ports, `free_ports`): one parameter server and W workers, each a process running

    python -m benchmarks.dp_workers --job {ps,worker} --task T --ports ...
        --model M --batch-size B --steps S [--plain]

Every worker builds the same graph (between-graph replication, `replica_device_setter`):
the bench model on B examples and either `tf.compat.v1.train.SyncReplicasOptimizer`
around SGD ("plain", the mean loss) or `pertower.DPSyncReplicasOptimizer` (C = 1, σ = 1,
noise added once by the chief). It runs S synchronous steps and prints one JSON object,
{"task": T, "runs_ms": [...], "cpu_ms": [...]}, the wall and the process CPU times of
its steps after two warm-up steps. The rows are the median over the workers' steps of
the plain cluster, then of the DP cluster ("W workers: ... step", wall ms; "W workers
CPU: ... step", the worker process's CPU ms per step): one after the other (two
clusters cannot share the two cores fairly at once), in `rounds` alternations (plain,
dp, plain, dp, ...) so that a change of the machine's load during the run falls on both
rows alike.

Every process of a cluster runs TensorFlow on THREADS threads (intra- and inter-op):
W workers on a W-core machine, one core each. With TensorFlow's default (a pool as wide
as the machine per process) the workers oversubscribe the cores, and on a shared
machine a cluster's wall time follows how many threads it keeps runnable rather than
its work: the plain CIFAR step (a chain of large convolution kernels) ran ~2x slower in
wall time than the DP step (many independent ops), though it used ~30% less CPU.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import time

from benchmarks import peers as peers_lib

__all__ = ["WORKERS", "THREADS", "WARM_UP_STEPS", "ROUNDS", "free_ports", "run_worker_bench",
           "main"]

WORKERS = 2
# TensorFlow threads (intra- and inter-op) of each process of a cluster (module notes)
THREADS = 1
WARM_UP_STEPS = 2
# the alternations of `python -m benchmarks --dp-workers` (`run_worker_bench`'s rounds)
ROUNDS = 2
_TIMEOUT_SECONDS = 900


def free_ports(n):
    """n distinct free TCP ports on 127.0.0.1 (bound at once, then released)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _cluster(tf, ports):
    ports = [int(p) for p in ports.split(",")]
    return tf.train.ClusterSpec({"ps": [f"127.0.0.1:{ports[0]}"],
                                 "worker": [f"127.0.0.1:{p}" for p in ports[1:]]})


def _config(tf):
    return tf.compat.v1.ConfigProto(intra_op_parallelism_threads=THREADS,
                                    inter_op_parallelism_threads=THREADS)


def _launch(model, B, steps, plain, python):
    """Runs one cluster; returns (wall, cpu): every worker's step times (ms) after the
    warm-up, and its process's CPU ms in the same steps."""
    ports = ",".join(map(str, free_ports(WORKERS + 1)))
    common = [python, "-m", "benchmarks.dp_workers", "--ports", ports,
              "--model", model, "--batch-size", str(B), "--steps", str(steps)]
    common += ["--plain"] if plain else []
    env = peers_lib._child_env()  # pylint: disable=protected-access
    ps = subprocess.Popen(common + ["--job", "ps"], env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
    try:
        workers = [subprocess.Popen(common + ["--job", "worker", "--task", str(t)], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True) for t in range(WORKERS)]
        runs, cpu = [], []
        for worker in workers:
            out, err = worker.communicate(timeout=_TIMEOUT_SECONDS)
            lines = out.strip().splitlines()
            if worker.returncode != 0 or not lines:
                tail = (err.strip().splitlines() or ["no output"])[-1]
                raise RuntimeError(f"a worker exited with {worker.returncode}: {tail}"[:300])
            record = json.loads(lines[-1])
            runs.extend(record["runs_ms"])
            cpu.extend(record["cpu_ms"])
        return runs, cpu
    finally:
        ps.kill()
        ps.wait()


def run_worker_bench(models, batch_sizes, steps=12, report=print, python=None, rounds=1):
    """The rows "W workers: plain step" and "W workers: dp step" per model (wall ms per
    worker step), then "W workers CPU: plain step" and "W workers CPU: dp step" (the
    worker process's CPU ms per step).

    Args:
      models: model names of `benchmarks.models`.
      batch_sizes: a dict model -> B per worker.
      steps: synchronous steps per worker and cluster run (the first WARM_UP_STEPS are
        not timed).
      report: called with each line of progress.
      python: the workers' interpreter (default this one).
      rounds: cluster runs of each kind, alternated (plain, dp, plain, ...); a row
        holds the timed steps of all its runs.

    Returns:
      A list of `dp.DPEntry` (no runs when a cluster failed, with the reason reported).
    """
    from benchmarks import dp  # pylint: disable=import-outside-toplevel
    entries = []
    for model in models:
        B = batch_sizes[model]
        rows = [dp.DPEntry(model, B, f"{WORKERS} workers: {kind} step")
                for kind in ("plain", "dp")]
        cpu_rows = [dp.DPEntry(model, B, f"{WORKERS} workers CPU: {kind} step")
                    for kind in ("plain", "dp")]
        for _ in range(rounds):
            for plain, row, cpu_row in zip((True, False), rows, cpu_rows):
                report(f"dp {model} B={B}: {row.name} ...")
                try:
                    wall, cpu = _launch(model, B, steps, plain, python or sys.executable)
                except (RuntimeError, OSError, subprocess.TimeoutExpired) as error:
                    report(f"dp {model} B={B}: {row.name}: {error}")
                    continue
                row.runs_ms.extend(wall)
                cpu_row.runs_ms.extend(cpu)
        entries += rows + cpu_rows
    return entries


def _worker(args):
    """One worker: S synchronous steps; prints its timed steps as JSON; exits at once."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    from pertower.tools import environment  # pylint: disable=import-outside-toplevel
    tf = environment.graph_mode_tensorflow()
    import pertower  # pylint: disable=import-outside-toplevel
    from benchmarks import models  # pylint: disable=import-outside-toplevel
    from benchmarks import dp  # pylint: disable=import-outside-toplevel

    spec, task = _cluster(tf, args.ports), args.task
    server = tf.distribute.Server(spec, job_name="worker", task_index=task,
                                  config=_config(tf))
    graph = tf.Graph()
    with graph.as_default(), tf.compat.v1.device(tf.compat.v1.train.replica_device_setter(
            worker_device=f"/job:worker/task:{task}", cluster=spec)):
        tf.compat.v1.set_random_seed(args.batch_size)
        model = models.build(args.model, args.batch_size,
                             np.random.default_rng(args.batch_size + task))
        global_step = tf.compat.v1.train.get_or_create_global_step()
        sgd = tf.compat.v1.train.GradientDescentOptimizer(dp.DP_LEARNING_RATE)
        if args.plain:
            sync = tf.compat.v1.train.SyncReplicasOptimizer(sgd, WORKERS, WORKERS)
            train_op = sync.minimize(tf.reduce_mean(model.ys), global_step=global_step,
                                     var_list=model.weights)
            hook = sync.make_session_run_hook(task == 0, num_tokens=0)
        else:
            sync = pertower.DPSyncReplicasOptimizer(
                sgd, l2_norm_clip=1.0, noise_multiplier=1.0, replicas_to_aggregate=WORKERS,
                total_num_replicas=WORKERS, seed=args.batch_size)
            train_op = sync.minimize(model.ys, global_step=global_step,
                                     var_list=model.weights, batch_size=args.batch_size)
            hook = sync.make_session_run_hook(task == 0)
        if task == 0:
            creator = tf.compat.v1.train.ChiefSessionCreator(master=server.target,
                                                             config=_config(tf))
        else:   # poll for the chief's initialization faster than TF's 30 s
            uninitialized = tf.compat.v1.report_uninitialized_variables(
                tf.compat.v1.global_variables())
            with tf.compat.v1.Session(server.target, config=_config(tf)) as probe:
                while len(probe.run(uninitialized)):
                    time.sleep(0.2)
            creator = tf.compat.v1.train.WorkerSessionCreator(master=server.target,
                                                              config=_config(tf))
        sess = tf.compat.v1.train.MonitoredSession(creator, hooks=[hook])
        runs, cpu = [], []
        for step in range(args.steps):
            start, start_cpu = time.perf_counter(), time.process_time()
            sess.run(train_op, model.feed)
            if step >= WARM_UP_STEPS:
                runs.append(1e3 * (time.perf_counter() - start))
                cpu.append(1e3 * (time.process_time() - start_cpu))
    print(json.dumps({"task": task, "runs_ms": runs, "cpu_ms": cpu}), flush=True)
    # the servers (and the plain chief's queue runner) cannot be stopped in-process
    os._exit(0)  # pylint: disable=protected-access


def main(argv=None):
    """The cluster's processes (--job ps or worker)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dp_workers")
    parser.add_argument("--job", choices=["ps", "worker"], required=True)
    parser.add_argument("--task", type=int, default=0)
    parser.add_argument("--ports", required=True)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--plain", action="store_true")
    args = parser.parse_args(argv)
    if args.job == "worker":
        return _worker(args)
    from pertower.tools import environment  # pylint: disable=import-outside-toplevel
    tf = environment.graph_mode_tensorflow()
    tf.distribute.Server(_cluster(tf, args.ports), job_name="ps", task_index=0,
                         config=_config(tf)).join()
    return 0


if __name__ == "__main__":
    sys.exit(main())


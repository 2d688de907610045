"""`python -m benchmarks --peers`: the same models in PyTorch and JAX, checked against the loop.

Notation:
    B   examples        P   weights (scalars)       x   one weight
    g_i example i's gradient over all weights, n_i = ||g_i||_2
    C   clip norm (the median of the n_i, so that some examples are clipped and some
        are not)            σ   noise multiplier        lr  learning rate

For each model and B, this driver (in the bench's TensorFlow process) builds the
TensorFlow model, runs the loop of `pertower.oracle.SliceLoop` once, and writes a job
folder (see `benchmarks.peers_jobs`): the batch, the weights as numpy in
TensorFlow's layout, the loop's per-example gradients [B, *x.shape], their mean and
their clipped mean (1/B) sum_i g_i min(1, C / n_i). Then, for each round, one child
process per framework, `python -m benchmarks.peers_worker --framework F ...`,
imports only F, loads the weights into its own model (PyTorch: [out, in] and OIHW,
NCHW images), and times its entries on every job; the first round also checks each
result against the loop's. The frameworks alternate (the order rotates each round), so
a change of load on the machine hits them alike, and TensorFlow, PyTorch and JAX never
share a process. Entries:

    torch vmap(grad)        torch.func.vmap(torch.func.grad(loss of one example))
    jax jit(vmap(grad))     jax.jit(jax.vmap(jax.grad(loss of one example)))
    step: tf plain SGD      GradientDescentOptimizer(lr).minimize(mean loss): no privacy
    dp step: pertower       pertower.DPOptimizer(GradientDescentOptimizer(lr), C, σ)
    dp step: opacus hooks   Opacus PrivacyEngine, grad_sample_mode="hooks"
    dp step: opacus ghost   Opacus PrivacyEngine, grad_sample_mode="ghost" (ghost clipping)
    dp step: jax            jit of vmap(grad), clip, sum, N(0, (σC)^2), SGD

A per-example entry is compared with the loop's per-example gradients; a DP step,
run once with σ = 0, with their clipped mean; the plain step with their mean.

Models: those of `benchmarks.models` ("mlp", "cnn", "cifar"), rebuilt in each
framework with the TensorFlow model's weights.

Importing this module imports neither TensorFlow, numpy nor the peers (the command-line
parser reads `PEER_MODELS`): `prepare_job` imports them when it runs.
"""

import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks import models

import benchmarks
from benchmarks import records

__all__ = ["PEER_MODELS", "FRAMEWORKS", "ROUNDS", "missing_frameworks", "prepare_job",
           "run_jobs", "run_peers", "describe"]

PEER_MODELS = ("mlp", "cnn", "cifar")   # = benchmarks.models.MODEL_NAMES (tested)
FRAMEWORKS = ("tf", "torch", "jax")
# Child rounds (each times `repeats` passes of every entry): quick, --full.
ROUNDS = {"quick": 2, "full": 3}
LEARNING_RATE = 0.05
NOISE_MULTIPLIER = 1.0
# What each framework's child needs importable.
_NEEDS = {"tf": ("tensorflow",), "torch": ("torch",), "jax": ("jax", "jaxlib")}
_CHILD_TIMEOUT_SECONDS = 1800
# The Python of the torch child when set (torch in an environment of its own: TensorFlow
# imports torch when it is installed beside it).
PYTHON_VARIABLE = "PERTOWER_PEERS_PYTHON"


def missing_frameworks():
    """{framework: why it cannot run} for the peers whose packages are not importable
    (checked with importlib.util.find_spec, without importing them)."""
    missing = {}
    for framework, packages in _NEEDS.items():
        if framework == "torch" and os.environ.get(PYTHON_VARIABLE):
            continue   # the torch child runs that Python (its own environment)
        absent = [p for p in packages if importlib.util.find_spec(p) is None]
        if absent:
            missing[framework] = (f"{' and '.join(absent)} not installed (pip install "
                                  "-r benchmarks/requirements-peers.txt; a CPU torch)")
    return missing


# The TensorFlow side ------------------------------------------------------------------


def prepare_job(model_name, B, folder, time_loop=False):
    """Builds `model_name` at B in TensorFlow, runs the loop, writes the job folder.

    Returns:
      (P, loop_ms, max |loop|): the weights' scalar count, the wall milliseconds of a
      second pass of the loop when `time_loop` (else None), the loop result's scale.
    """
    # numpy, TensorFlow and pertower only when a job is prepared (see the docstring)
    # pylint: disable=import-outside-toplevel
    import numpy as np
    import tensorflow as tf
    from pertower import oracle
    # pylint: enable=import-outside-toplevel

    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(B)
    with tf.Graph().as_default() as graph, tf.compat.v1.Session(graph=graph) as sess:
        tf.compat.v1.set_random_seed(B)
        model = models.build(model_name, B, rng)
        loop = oracle.SliceLoop(model.ys, model.weights)
        sess.run(tf.compat.v1.global_variables_initializer())
        weights = sess.run(model.weights)
        grads = loop.run(sess, model.feed, B)                    # [B, *x.shape] each
        loop_ms = None
        if time_loop:
            start = time.perf_counter()
            loop.run(sess, model.feed, B)
            loop_ms = 1e3 * (time.perf_counter() - start)
        x_in, t_in = models.split_feed(model.feed)
        P = model.num_weights
    squares = sum(np.square(g.astype(np.float64)).reshape(B, -1).sum(axis=1)
                  for g in grads)                                # [B]
    norms = np.sqrt(squares)
    clip = float(np.median(norms))
    factors = np.minimum(1.0, clip / np.maximum(norms, 1e-30))   # [B]
    np.save(os.path.join(folder, "x.npy"), model.feed[x_in])
    np.save(os.path.join(folder, "t.npy"), model.feed[t_in])
    scale = 0.0
    for k, (w, g) in enumerate(zip(weights, grads)):
        np.save(os.path.join(folder, f"w{k}.npy"), w)
        np.save(os.path.join(folder, f"g{k}.npy"), g)
        np.save(os.path.join(folder, f"mean{k}.npy"), g.mean(axis=0, dtype=np.float64)
                .astype(np.float32))
        np.save(os.path.join(folder, f"clipped{k}.npy"),            # [B] x [B, ...]
                np.tensordot(factors, g.astype(np.float64), axes=1).astype(np.float32) / B)
        scale = max(scale, float(np.max(np.abs(g))))
    meta = {"model": model_name, "batch_size": B, "lr": LEARNING_RATE, "clip": clip,
            "noise_multiplier": NOISE_MULTIPLIER, "shapes": [list(w.shape) for w in weights]}
    with open(os.path.join(folder, "meta.json"), "w", encoding="utf-8") as handle:
        json.dump(meta, handle)
    return P, loop_ms, scale


# The children ---------------------------------------------------------------------------


def _child_env():
    """os.environ with this process's pertower, then the benchmarks, first on
    PYTHONPATH and TensorFlow quiet."""
    env = dict(os.environ)
    env["PYTHONPATH"] = benchmarks.python_path()
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


def _run_child(framework, folders, repeats, check):
    """Runs one worker; returns (versions, entry dicts) or raises RuntimeError."""
    python = (os.environ.get(PYTHON_VARIABLE) or sys.executable
              if framework == "torch" else sys.executable)
    command = [python, "-m", "benchmarks.peers_worker", "--framework",
               framework, "--repeats", str(repeats)] + (["--check"] if check else []) + folders
    done = subprocess.run(command, env=_child_env(), capture_output=True, text=True,
                          timeout=_CHILD_TIMEOUT_SECONDS, check=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"the {framework} child exited with {done.returncode}: {tail}"[:300])
    result = json.loads(lines[-1])
    return result["versions"], result["entries"]


def run_jobs(jobs, repeats, rounds, report=print, info=None, frameworks=FRAMEWORKS):
    """Runs the peers' children on prepared job folders; returns `records.Entry` rows.

    Args:
      jobs: (model name, B, P, folder) per job.
      repeats: timed passes of each entry per round.
      rounds: child processes per framework; the order of the frameworks rotates
        each round; round 0 also checks every result against the loop.
      report: called with each line of progress.
      info: a dict that receives {framework: versions, or why it did not run}.
      frameworks: the frameworks to run (default all of FRAMEWORKS).
    """
    info = {} if info is None else info
    missing = missing_frameworks()
    rows = {}
    for model_name, B, P, _ in jobs:
        for framework in frameworks:
            for name, computes in records.PEER_ENTRIES[framework]:
                entry = records.Entry(model_name, B, P, name, computes)
                if framework in missing:
                    entry.status, entry.reason = "n/a", missing[framework]
                rows[model_name, B, name] = entry
    runnable = [f for f in frameworks if f not in missing]
    info.update({f: {"missing": missing[f]} for f in frameworks if f in missing})
    folders = [folder for _, _, _, folder in jobs]
    for r in range(rounds):
        shift = r % len(runnable) if runnable else 0
        for framework in runnable[shift:] + runnable[:shift]:
            start = time.perf_counter()
            try:
                versions, results = _run_child(framework, folders, repeats, check=r == 0)
            except (RuntimeError, ValueError, subprocess.TimeoutExpired) as error:
                for (model_name, B, name), entry in rows.items():
                    if any(name == n for n, _ in records.PEER_ENTRIES[framework]):
                        entry.status, entry.reason = "error", str(error)[:300]
                report(f"  peers round {r + 1}/{rounds}: {framework} failed: {error}")
                continue
            info[framework] = versions
            for result in results:
                entry = rows[result["model"], result["batch_size"], result["name"]]
                if entry.status == "error":
                    continue
                if result["status"] != "ok":
                    entry.status, entry.reason = result["status"], result["reason"]
                    continue
                entry.runs_ms.extend(result["runs_ms"])
                if r == 0:
                    entry.build_seconds = result["build_seconds"]
                    entry.first_run_seconds = result["first_run_seconds"]
                    entry.max_abs_diff = result.get("max_abs_diff")
                    entry.max_abs_reference = result.get("max_abs_reference")
                    entry.note = _where(result)
            report(f"  peers round {r + 1}/{rounds}: {framework} child done in "
                   f"{time.perf_counter() - start:.1f} s")
    for entry in rows.values():
        if entry.status != "ok":
            entry.runs_ms, entry.max_abs_diff = [], None
            continue
        entry.median_ms = statistics.median(entry.runs_ms) if entry.runs_ms else None
        if entry.max_abs_diff is not None:
            entry.agrees = records.agrees(entry.max_abs_diff, entry.max_abs_reference)
    return list(rows.values())


def _where(result):
    """Where a child's checked result differs most from the loop's, and whether it
    changes from run to run: "w<k> example <i>; rerun max|diff| <d>" ("" unchecked)."""
    where = result.get("worst")
    if not where:
        return ""
    k, i = where
    text = f"w{k}" + ("" if i is None else f" example {i}")
    rerun = result.get("max_abs_diff_rerun")
    if rerun is not None:
        same = rerun == result.get("max_abs_diff")
        text += f"; rerun max|diff| {rerun:.1e}" + (" (same)" if same else " (CHANGED)")
    return text


def run_peers(keys, repeats, rounds, report=print, info=None, timed_loops=()):
    """Prepares a job per (model, B) in `keys`, runs the peers; returns `records.Entry`
    rows.

    Args:
      keys: (model name from PEER_MODELS, B) pairs.
      repeats, rounds, report, info: as in `run_jobs`.
      timed_loops: (model, B) pairs (models the bench itself does not run) for which a
        "loop" row is added, timed once after the reference pass.
    """
    folder = tempfile.mkdtemp(prefix="pertower-peers-")
    entries, jobs = [], []
    try:
        for model_name, B in keys:
            report(f"{model_name} B={B}: the loop's reference for the peers ...")
            job_folder = os.path.join(folder, f"{model_name}-{B}")
            timed = (model_name, B) in timed_loops
            P, loop_ms, scale = prepare_job(model_name, B, job_folder, time_loop=timed)
            jobs.append((model_name, B, P, job_folder))
            if timed:
                entries.append(records.Entry(
                    model_name, B, P, records.LOOP, "gradients", median_ms=loop_ms,
                    runs_ms=[loop_ms], max_abs_diff=0.0, max_abs_reference=scale))
        entries += run_jobs(jobs, repeats, rounds, report, info)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return entries


def describe(info):
    """One line naming each peer framework's versions (or why it did not run)."""
    parts = []
    for framework in FRAMEWORKS:
        if framework in info:
            facts = info[framework]
            parts.append(f"{framework}: " + ", ".join(f"{k} {v}" for k, v in facts.items()))
    return "; ".join(parts)


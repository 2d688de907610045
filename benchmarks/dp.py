"""`python -m benchmarks --dp`: a plain SGD step against `pertower.DPOptimizer`'s step, timed
side by side (round robin), and their table.

Notation:
    B   examples        C   clip norm       σ   noise multiplier
    P   the weights' entries (the Gaussian numbers one DP step draws)

The DP step's floor is a plain step plus the draw of P Gaussian numbers; the table's
derived row "dp − plain − noise" is what clipping costs beyond it (the first method's
step minus the plain step minus the "noise draw" row), with its ratio to the plain step.

What a DP step pays for its draw is the draw's marginal cost inside the step's one
`sess.run`, not a `sess.run` of its own (whose fixed cost, the row "sess.run overhead",
a run of one tiny op, is 0.1-0.3 ms on a quiet 2-core machine and more under load). So
the row "noise draw" is K = 10 draws of P numbers, each as the step makes it (its own
key), chained by control dependencies in ONE `sess.run`, divided by K; and with a
peers' Python the row "noise draw: torch normal_" times K in-place `normal_` fills of
the same P numbers in a child process (`peers_noise`), divided by K, right after the
model's other rows: the fastest draw we know of, which the "noise draw" row should stay
within 1.2 times of. The row "noise draw: Philox uniforms alone" is the same K chained
draws of the [2, h] stateless Philox uniforms the draw transforms, without the
transform: TensorFlow's floor for the draw (on one thread it costs about torch's whole
`normal_`), against which the ratio of the two rows above reads. The derived row
"noise in step (dp − σ=0)" is the first method's step minus its step without noise:
the draw's cost as the step sees it (noisier: the difference of two whole steps).
"""

import dataclasses
import re
import statistics

import numpy as np
import tensorflow as tf

import pertower
from pertower._dp import noise as noise_lib
from pertower.tools import timing
from benchmarks import models as models_lib
from benchmarks import peers_noise
from benchmarks import records
from benchmarks import report as report_lib

__all__ = ["DP_BATCH_SIZES", "TORCH_NOISE", "PHILOX_UNIFORMS", "SESSION_OVERHEAD",
           "DRAWS_PER_RUN", "FINE_ROWS", "DPEntry", "run_dp_bench", "format_dp_table",
           "plain_ratios"]

MODELS = models_lib.MODEL_NAMES
# DP rows: per model, the batch sizes the DP-SGD step is timed at (models the installed
# `benchmarks.models` lacks are skipped).
DP_BATCH_SIZES = {"mlp": (128,), "cnn": (32,), "cifar": (64,)}
DP_LEARNING_RATE = 1e-3   # small: the timed steps train the weights they measure
TORCH_NOISE = "noise draw: torch normal_"
# the floor of the draw in TensorFlow: its stateless Philox uniforms alone (the [2, h]
# the draw transforms), chained as the "noise draw" row
PHILOX_UNIFORMS = "noise draw: Philox uniforms alone"
SESSION_OVERHEAD = "sess.run overhead"
# draws chained in the one sess.run of the "noise draw" row (see the module notes)
DRAWS_PER_RUN = 10
# rows printed to 0.01 ms: draws of 57 k numbers take tenths of a millisecond, where one
# decimal would round their ratio to torch's by up to a third
FINE_ROWS = ("noise draw", PHILOX_UNIFORMS, TORCH_NOISE, SESSION_OVERHEAD)
# a cluster's row ("2 workers: dp step", "2 workers CPU: plain step"): its prefix up to ": "
_CLUSTER = re.compile(r"\d+ workers( CPU)?: ")


@dataclasses.dataclass
class DPEntry:
    """One DP row: the median ms of a "plain step" and a "dp step[method]", the
    process's CPU ms per run (`cpu_ms`, all its threads: steadier than the wall time on
    a loaded machine) and its minor page faults per run (`faults`: memory the allocator
    handed back to the system and touched again); `cpu_ms` and `faults` empty when not
    counted."""

    model: str
    batch_size: int
    name: str
    runs_ms: list = dataclasses.field(default_factory=list)
    faults: list = dataclasses.field(default_factory=list)
    cpu_ms: list = dataclasses.field(default_factory=list)

    @property
    def median_ms(self):
        return statistics.median(self.runs_ms) if self.runs_ms else None

    @property
    def median_faults(self):
        return statistics.median(self.faults) if self.faults else None

    @property
    def median_cpu_ms(self):
        return statistics.median(self.cpu_ms) if self.cpu_ms else None


def run_dp_bench(models=None, batch_sizes=None, repeats=11, methods=("auto",),
                 report=print, noise_python=None, ftrl=False):
    """Times a plain SGD step against DPOptimizer's step, side by side (round robin).

    "plain step": GradientDescentOptimizer.minimize of the mean per-example cost;
    "dp step[method]": `pertower.DPOptimizer` around the same optimizer, C = 1, σ = 1,
    one microbatch per example; "dp step[method] σ=0": the first method's step without
    noise (the clipping alone). Each is one sess.run of the training op. "sess.run
    overhead": one run of a [2] random draw, the fixed cost of a call; "noise draw":
    DRAWS_PER_RUN chained draws of P numbers in one run, ms divided by DRAWS_PER_RUN.

    Args:
      models: names (default: those of DP_BATCH_SIZES that `models` provides).
      batch_sizes: a list of B for every model, or a dict model -> list of B.
      repeats: timed steps of each row after one warm-up step.
      methods: DPOptimizer methods to time.
      report: called with each line of progress.
      noise_python: a Python with PyTorch for the row TORCH_NOISE (its median None when
        the child fails, with the reason reported); None leaves the row out.
      ftrl: also the row "dp-ftrl step": `pertower.DPFTRLOptimizer`, C = 1, σ = 1, the
        plain tree (its residual draws 2 nodes per step on average).

    Returns:
      A list of `DPEntry`.
    """
    available = [m for m in DP_BATCH_SIZES if m in MODELS]
    models = available if models is None else [m for m in models if m in MODELS]
    entries = []
    for model_name in models:
        sizes = (batch_sizes[model_name] if isinstance(batch_sizes, dict) else
                 batch_sizes) if batch_sizes else DP_BATCH_SIZES.get(model_name, (32,))
        for B in sizes:
            report(f"dp {model_name} B={B}: building ...")
            rng = np.random.default_rng(B)
            with tf.Graph().as_default() as graph, \
                    tf.compat.v1.Session(graph=graph) as sess:
                tf.compat.v1.set_random_seed(B)
                model = models_lib.build(model_name, B, rng)
                loss = model.ys                                  # [B, ...] per example
                sgd = tf.compat.v1.train.GradientDescentOptimizer
                steps = [("plain step", sgd(DP_LEARNING_RATE).minimize(
                    tf.reduce_mean(loss), var_list=model.weights))]
                for method in methods:
                    dp = pertower.DPOptimizer(sgd(DP_LEARNING_RATE), l2_norm_clip=1.0,
                                              noise_multiplier=1.0, method=method, seed=B)
                    steps.append((f"dp step[{method}]", dp.minimize(
                        loss, var_list=model.weights, batch_size=B)))
                if ftrl and hasattr(pertower, "DPFTRLOptimizer"):   # older: none
                    steps.append(("dp-ftrl step", pertower.DPFTRLOptimizer(
                        1.0, 1.0, DP_LEARNING_RATE, seed=B, method=methods[0]).minimize(
                            loss, var_list=model.weights, batch_size=B)))
                # the same step without its noise: what clipping costs, apart from the
                # P Gaussian draws
                dp = pertower.DPOptimizer(sgd(DP_LEARNING_RATE), l2_norm_clip=1.0,
                                          noise_multiplier=0.0, method=methods[0])
                steps.append((f"dp step[{methods[0]}] σ=0", dp.minimize(
                    loss, var_list=model.weights, batch_size=B)))
                P = sum(w.shape.num_elements() for w in model.weights)
                keys = tf.random.uniform([DRAWS_PER_RUN, 2], maxval=2 ** 62,
                                         dtype=tf.int64, seed=B)       # [K, 2]
                steps.append((SESSION_OVERHEAD, keys[0]))
                if hasattr(noise_lib, "normal_pairs"):   # older pertowers: no such draw
                    steps.append((PHILOX_UNIFORMS, _chained_draws(P, keys, loss.dtype,
                                                                   _uniforms)))
                    steps.append(("noise draw", _chained_draws(P, keys, loss.dtype)))
                else:
                    report(f"dp {model_name} B={B}: no noise draw rows: this pertower has "
                           "no pertower._dp.noise.normal_pairs (an older version)")
                sess.run(tf.compat.v1.global_variables_initializer())
                rows = [DPEntry(model_name, B, name) for name, _ in steps]
                for _, op in steps:
                    sess.run(op, model.feed)                     # warm-up
                times = timing.round_robin(
                    [(records.counted(lambda op=op: sess.run(op, model.feed), row), repeats)
                     for row, (_, op) in zip(rows, steps)])
                for row, seconds in zip(rows, times):
                    per = DRAWS_PER_RUN if row.name in ("noise draw", PHILOX_UNIFORMS) else 1
                    row.runs_ms.extend(1e3 * t / per for t in seconds)
                    row.faults[:] = [f / per for f in row.faults]
                    row.cpu_ms[:] = [c / per for c in row.cpu_ms]
                entries += rows
            if noise_python:
                entries.append(_torch_noise(model_name, B, P, repeats, noise_python, report))
    return entries


def _chained_draws(P, keys, dtype, draw=None):
    """The fetch of K = len(keys) draws of P numbers as the DP step makes them
    (`normal_pairs`, [2h] >= P, one key each; or `draw(P, key, dtype)`), draw k+1
    waiting for draw k: their first entries, [K]."""
    draw = draw or noise_lib.normal_pairs
    heads = []
    for k in range(keys.shape[0]):
        with tf.control_dependencies(heads[-1:]):
            heads.append(tf.reshape(draw(P, keys[k], dtype), [-1])[:1])   # [1]
    return tf.concat(heads, axis=0)                                        # [K]


def _uniforms(P, key, dtype):
    """[2, h]: the stateless Philox uniforms `normal_pairs` draws for P numbers (the same
    h and working dtype, `noise.uniform_pairs`), without their transform to normals."""
    return noise_lib.uniform_pairs(P, key, dtype)                            # [2, h]


def _torch_noise(model_name, B, P, repeats, python, report):
    """The DPEntry TORCH_NOISE of P draws (no runs when the child fails)."""
    row = DPEntry(model_name, B, TORCH_NOISE)
    try:
        row.runs_ms.extend(peers_noise.torch_normal_runs([P], repeats, python)[P])
    except (RuntimeError, ValueError, OSError) as error:
        report(f"dp {model_name} B={B}: {TORCH_NOISE}: {error}")
    return row


def format_dp_table(entries):
    """The DP rows as text: the median minor page faults of a run ("faults"; of a draw
    for "noise draw"), the process's median CPU ms ("cpu ms"), the median ms (the draws
    and the sess.run overhead, FINE_ROWS, to 0.01 ms) and its ratio to the plain step of
    the same run (a cluster's rows, "W workers: ..." and "W workers CPU: ...", to their
    own plain step, `plain_ratios`);
    after each model's rows, when it has a plain step, a DP step and a noise draw, the
    row "dp − plain − noise" (the first DP step's median minus the other two) and the
    same in CPU ms, "dp − plain − noise, CPU" (its "x plain" of the plain step's CPU
    ms)."""
    plain = {(e.model, e.batch_size, e.name): e.median_ms for e in entries
             if e.name.endswith("plain step")}
    rows, done = [], set()
    for j, (e, ratio) in enumerate(zip(entries, plain_ratios(entries))):
        key = (e.model, e.batch_size)
        digits = ".2f" if e.name in FINE_ROWS else ".1f"
        rows.append((e.model, str(e.batch_size), e.name, report_lib.cell(e.median_faults, ".0f"),
                     report_lib.cell(e.median_cpu_ms, digits),
                     report_lib.cell(e.median_ms, digits), report_lib.cell(ratio, ".2f")))
        last = j + 1 == len(entries) or (entries[j + 1].model,
                                         entries[j + 1].batch_size) != key
        if last and key not in done:   # (once per model: its cluster's rows come later)
            done.add(key)
            rows += _overhead_row(key, [f for f in entries
                                        if (f.model, f.batch_size) == key],
                                  plain.get(key + ("plain step",)))
    return timing.format_table(("model", "B", "step", "faults", "cpu ms", "ms", "x plain"),
                               rows)


def plain_ratios(entries):
    """Each entry's median ms divided by its plain step's (the same model and B; a
    cluster's rows, "W workers: ..." or "W workers CPU: ...", by its own plain step,
    "W workers: plain step" or "W workers CPU: plain step"), None where either is
    missing: the "x plain" column and the JSON's "x_plain"."""
    plain = {(e.model, e.batch_size, e.name): e.median_ms for e in entries
             if e.name.endswith("plain step")}
    ratios = []
    for e in entries:
        cluster = e.name.split(": ")[0] + ": " if _CLUSTER.match(e.name) else ""
        base = plain.get((e.model, e.batch_size, cluster + "plain step"))
        ratios.append(e.median_ms / base if base and e.median_ms is not None else None)
    return ratios


def _overhead_row(key, entries, base):
    """[("dp − plain − noise", ms, x plain)] for one model's entries (and, with CPU
    times, "dp − plain − noise, CPU"; with the step without noise, "noise in step
    (dp − σ=0)"), or []."""
    dp_steps = [e for e in entries if e.name.startswith("dp step[") and "σ=0" not in e.name]
    quiet = [e for e in entries if e.name.startswith("dp step[") and "σ=0" in e.name]
    noise = [e for e in entries if e.name == "noise draw"]
    if not (base and dp_steps and noise and dp_steps[0].median_ms is not None
            and noise[0].median_ms is not None):
        return []
    overhead = dp_steps[0].median_ms - base - noise[0].median_ms
    rows = [(key[0], str(key[1]), "dp − plain − noise", "-", "-",
             report_lib.cell(overhead, ".1f"), report_lib.cell(overhead / base, ".2f"))]
    plain_cpu = [e.median_cpu_ms for e in entries if e.name == "plain step"]
    if plain_cpu and None not in (plain_cpu[0], dp_steps[0].median_cpu_ms,
                                  noise[0].median_cpu_ms):
        cpu = dp_steps[0].median_cpu_ms - plain_cpu[0] - noise[0].median_cpu_ms
        rows.append((key[0], str(key[1]), "dp − plain − noise, CPU", "-",
                     report_lib.cell(cpu, ".1f"), "-",
                     report_lib.cell(cpu / plain_cpu[0], ".2f")))
    if quiet and quiet[0].median_ms is not None:
        in_step = dp_steps[0].median_ms - quiet[0].median_ms
        rows.append((key[0], str(key[1]), "noise in step (dp − σ=0)", "-", "-",
                     report_lib.cell(in_step, ".1f"), report_lib.cell(in_step / base, ".2f")))
    return rows

"""Measuring: every row for one model at one B, in one graph and one session, then
the peers (`run_bench`).

Notation:
    B   examples in the batch       P   weights (parameters) of the model
    x   one weight                  [B, *x.shape] one gradient of x per example

Each row is built (timed: "build s"), run once (timed: "1st run s", the result is
compared with the loop's: "max|diff|"), traced once for its peak memory
(`benchmarks.traced_memory`), then run `repeats` times round-robin with the other
rows, so a change of load on the machine hits every row alike ("ms" is the median). A
method that raises NotImplementedError when built is reported as "n/a" with its message.
"""

import dataclasses
import statistics
import time

import numpy as np
import tensorflow as tf

import pertower
from pertower import oracle
from pertower._api import gradients as gradients_lib
from pertower.tools import environment
from pertower.tools import timing
from benchmarks import models as models_lib
from benchmarks import baselines
from benchmarks import compare
from benchmarks import machine
from benchmarks import peers as peers_lib
from benchmarks import records
from benchmarks import traced_memory as run_memory

__all__ = ["MODELS", "QUICK", "FULL", "run_bench"]

MODELS = models_lib.MODEL_NAMES
QUICK = dict(models=("mlp", "cnn"), batch_sizes={"mlp": (32, 128), "cnn": (32,)},
             repeats=5, loop_repeats=3)
FULL = dict(models=("mlp", "cnn", "cifar"), batch_sizes={"mlp": (32, 128, 512),
                                                           "cnn": (32, 128, 512),
                                                           "cifar": (64, 128)},
            repeats=11, loop_repeats=5)


@dataclasses.dataclass
class _Candidate:
    """An entry being measured: its row and what to run."""

    entry: records.Entry
    fetches: list = None   # tensors run on the whole batch
    loop: oracle.SliceLoop = None  # the loop instead of fetches


def _estimate_bytes(model, B, method):
    """pertower.estimate_memory's total for the gradients of `model` at B by `method`,
    or None."""
    try:
        estimate = pertower.estimate_memory(model.ys, model.weights, batch_size=B,
                                            method=method)
    except Exception:  # pylint: disable=broad-except
        return None
    return None if estimate is None else estimate.total_bytes


def _bench_one(model_name, B, methods, repeats, loop_repeats, report):
    """All entries for one model at one B, in one graph and session; returns them."""
    rng = np.random.default_rng(B)
    with tf.Graph().as_default() as graph, tf.compat.v1.Session(graph=graph) as sess:
        tf.compat.v1.set_random_seed(B)
        model = models_lib.build(model_name, B, rng)
        P = model.num_weights
        result_bytes = 4 * B * P                      # [B, *x.shape] for all x, float32
        too_big = machine.too_big(2 * result_bytes, machine.MATERIALIZED_MEMORY_SHARE,
                                  f"the loop's reference holds the {B} per-example gradients")
        if too_big:
            return [records.Entry(
                model_name, B, P, records.LOOP, "gradients", status="skipped",
                reason=f"all entries of {model_name} at B={B} skipped: {too_big}")]
        candidates = []

        def add(name, computes, build):
            entry = records.Entry(model_name, B, P, name, computes)
            candidate = _Candidate(entry)
            start = time.perf_counter()
            try:
                built = build()
            except NotImplementedError as error:
                entry.status, entry.reason = "n/a", records.short_error(error)
                built = None
            except Exception as error:  # pylint: disable=broad-except
                entry.status, entry.reason = "error", records.short_error(error)
                built = None
            entry.build_seconds = time.perf_counter() - start
            if isinstance(built, oracle.SliceLoop):
                candidate.loop = built
            else:
                candidate.fetches = built
            candidates.append(candidate)
            return candidate

        loop = add(records.LOOP, "gradients",
                   lambda: oracle.SliceLoop(model.ys, model.weights))
        add(records.BATCH, "sum", lambda: baselines.batch_gradient(model))
        if model.dense_taps:
            add(records.OUTER, "gradients", lambda: baselines.outer_products(model))
        add(records.WRITE_LIMIT, "write", lambda: baselines.write_limit(model))
        for method in methods:
            add(f"gradients[{method}]", "gradients",
                lambda m=method: pertower.per_example_gradients(
                    model.ys, model.weights, batch_size=B, method=m)
                ).entry.estimate_bytes = _estimate_bytes(model, B, method)
        if model.dense_taps:
            add(records.HAND_NORMS, "norms", lambda: baselines.norms_by_hand(model))
        add(records.NORMS_FLOOR, "floor", lambda: baselines.norms_floor(model, B))
        for method in methods:
            add(f"norms[{method}]", "norms",
                lambda m=method: [pertower.per_example_norms(
                    model.ys, model.weights, batch_size=B, method=m)])
        sess.run(tf.compat.v1.global_variables_initializer())

        # The reference: the loop, once (this is also its warm-up).
        start = time.perf_counter()
        reference = loop.loop.run(sess, model.feed, B)            # [B, *x.shape] each
        loop.entry.first_run_seconds = time.perf_counter() - start
        loop.entry.max_abs_diff, loop.entry.max_abs_reference = 0.0, compare.compare(
            reference, reference)[1]
        one_example = next(oracle.slice_feeds(model.feed, None, B))
        loop.entry.peak_bytes = _traced_peak(sess, loop.loop.gradients, one_example)

        for candidate in candidates[1:]:
            if candidate.entry.status == "ok" and candidate.entry.computes in ("gradients",
                                                                              "write"):
                too_big = machine.too_big(
                    2 * result_bytes, machine.MATERIALIZED_MEMORY_SHARE,
                    f"it holds the {B} per-example gradients (towers: twice)")
                if too_big:
                    candidate.entry.status, candidate.entry.reason = "skipped", too_big
            _first_run(sess, candidate, model.feed, reference)
        batch_peak = next(c.entry.peak_bytes for c in candidates
                          if c.entry.name == records.BATCH)

        # tf.vectorized_map last: its graph is built only if its memory fits.
        too_big = machine.too_big(max(B * (batch_peak or 0), 2 * result_bytes),
                                  machine.VMAP_MEMORY_SHARE,
                                  "its backward pass holds about B x the batch gradient's peak")
        if too_big:
            candidates.append(_Candidate(records.Entry(
                model_name, B, P, records.VMAP, "gradients", status="skipped",
                reason=too_big)))
        else:
            vmap = add(records.VMAP, "gradients", lambda: baselines.vectorized_map(model))
            _first_run(sess, vmap, model.feed, reference)
        report(f"  {model_name} B={B}: built and checked {len(candidates)} entries; timing")

        _time_round_robin(sess, [c for c in candidates if c.entry.status == "ok"],
                          model.feed, B, repeats, loop_repeats)
    entries = [c.entry for c in candidates]
    for entry in entries:
        if entry.max_abs_diff is not None:
            entry.agrees = records.agrees(entry.max_abs_diff, entry.max_abs_reference)
        if entry.runs_ms:
            entry.median_ms = statistics.median(entry.runs_ms)
        if entry.cpu_ms:
            entry.median_cpu_ms = statistics.median(entry.cpu_ms)
    _ratios(entries)
    return entries


def _time_round_robin(sess, candidates, feed, B, repeats, loop_repeats):
    """Times `repeats` runs of each candidate (`loop_repeats` passes of the loop), one
    run of each in turn, so a change of load on the machine hits them alike."""
    runs = []

    def counted(entry, run):
        """`run`, adding the process's CPU ms (all threads) to `entry.cpu_ms`."""
        def counted_run():
            start = time.process_time()
            run()
            entry.cpu_ms.append(1e3 * (time.process_time() - start))
        return counted_run

    for candidate in candidates:
        if candidate.loop is not None:
            runs.append((counted(candidate.entry, lambda c=candidate: c.loop.run(sess, feed, B)),
                         loop_repeats))
        else:
            runs.append((counted(candidate.entry, lambda c=candidate: sess.run(c.fetches, feed)),
                         repeats))
    for candidate, times in zip(candidates, timing.round_robin(runs)):
        candidate.entry.runs_ms.extend(1e3 * t for t in times)


def _traced_peak(sess, fetches, feed):
    """The replayed peak bytes of one traced run, with TensorFlow's profiler lines
    (written to fd 2 by C++ logging) kept off the terminal."""
    with environment.quiet_native_logs():
        return run_memory.traced_peak_bytes(sess, fetches, feed).peak_bytes


def _first_run(sess, candidate, feed, reference):
    """Runs an entry once (warm-up), compares it with the loop, traces its memory."""
    entry = candidate.entry
    if entry.status != "ok":
        return
    try:
        start = time.perf_counter()
        values = sess.run(candidate.fetches, feed)
        entry.first_run_seconds = time.perf_counter() - start
        if entry.computes not in records.NOT_COMPARED:
            entry.max_abs_diff, entry.max_abs_reference, _ = compare.compare(
                values, compare.reference_for(entry.computes, reference))
        del values
        entry.peak_bytes = _traced_peak(sess, candidate.fetches, feed)
    except Exception as error:  # pylint: disable=broad-except
        entry.status, entry.reason = "error", records.short_error(error)


def _ratios(entries):
    """Fills the ratios of each entry's median to the loop, batch gradient, outer products."""
    medians = {e.name: e.median_ms for e in entries if e.median_ms}
    for entry in entries:
        if entry.median_ms is None:
            continue
        for attribute, name in [("ratio_to_loop", records.LOOP),
                                ("ratio_to_batch", records.BATCH),
                                ("ratio_to_outer", records.OUTER)]:
            if medians.get(name):
                setattr(entry, attribute, entry.median_ms / medians[name])


def run_bench(models=QUICK["models"], batch_sizes=None, methods=gradients_lib.METHODS,
              repeats=QUICK["repeats"], loop_repeats=QUICK["loop_repeats"], report=print,
              peers=False, peer_rounds=peers_lib.ROUNDS["quick"], peer_info=None):
    """Measures every entry for every model and batch size; returns a list of `Entry`.

    Args:
      models: names from MODELS.
      batch_sizes: a list of B for every model, or a dict model -> list of B; None
        means QUICK's.
      methods: the pertower methods to run (default all of METHODS).
      repeats: timed passes of each entry (one sess.run each), after the warm-up.
      loop_repeats: timed passes of the loop (B sess.run each).
      report: called with each line of progress.
      peers: also run the PyTorch and JAX peers and the DP-SGD steps
        (`benchmarks.peers`; models may then include its "cifar").
      peer_rounds: child processes per peer framework (each times `repeats` passes).
      peer_info: a dict that receives each peer framework's versions.

    Example:
      entries = run_bench(models=["mlp"], batch_sizes=[32], repeats=3)
      print(report.format_table(entries))   # benchmarks.report
    """
    if batch_sizes is None:
        batch_sizes = QUICK["batch_sizes"]
    groups = {}  # (model, B) -> its entries
    for model_name in models:
        known = MODELS + (peers_lib.PEER_MODELS if peers else ())
        if model_name not in known:
            raise ValueError(f"benchmarks: unknown model {model_name!r}; choose from "
                             f"{tuple(dict.fromkeys(known))} ({peers_lib.PEER_MODELS} "
                             "with peers).")
        sizes = batch_sizes[model_name] if isinstance(batch_sizes, dict) else batch_sizes
        for B in sizes:
            groups[model_name, B] = []
            if model_name in MODELS:
                start = time.perf_counter()
                report(f"{model_name} B={B}: building ...")
                groups[model_name, B] = _bench_one(model_name, B, methods, repeats,
                                                   loop_repeats, report)
                report(f"  done in {time.perf_counter() - start:.1f} s")
    if peers:
        _add_peers(groups, repeats, peer_rounds, report, peer_info)
    return [entry for group in groups.values() for entry in group]


def _add_peers(groups, repeats, rounds, report, info):
    """Appends the peers' rows to each (model, B) group (not to one whose loop was
    skipped for memory); a group the bench did not run gets the peers' timed loop."""
    keys = [key for key, group in groups.items()
            if not any(e.name == records.LOOP and e.status == "skipped" for e in group)]
    rows = peers_lib.run_peers(keys, repeats, rounds, report, info,
                               timed_loops=[key for key in keys if not groups[key]])
    for entry in rows:
        groups[entry.model, entry.batch_size].append(entry)
    for group in groups.values():
        _ratios(group)

"""`pertower bench`: every way to get per-example gradients, side by side, in one process.

Notation:
    B   examples in the batch       P   weights (parameters) of the model
    x   one weight                  [B, *x.shape] one gradient of x per example
    A   a dense layer's input [B, i]    dZ the gradient at its pre-activation [B, j]

For each model and batch size B, one graph and one session hold the model and one
entry per way of computing its per-example gradients (or their norms):

    loop              one `sess.run` of tf.gradients per example (pertower.oracle
                      SliceLoop): the reference every other result is compared with
    batch gradient    tf.gradients(tf.reduce_sum(ys), xs): one backward pass, the floor
    outer products    (MLP) dense kernel gradient of example i = a_i ⊗ dz_i, bias = dz_i,
                      written by hand from one batched tf.gradients w.r.t. the
                      pre-activations (Goodfellow 2015, arXiv 1510.01799): the
                      practical limit
    norms by hand     (MLP) ||grad_i||^2 = sum over layers ||a_i||^2 ||dz_i||^2 + ||dz_i||^2
    vectorized_map    tf.vectorized_map over the per-example losses of a function that
                      calls tf.gradients, as TensorFlow Privacy's vectorized DP
                      optimizers do
    gradients[m]      pertower.per_example_gradients(..., method=m), m in METHODS
    norms[m]          pertower.per_example_norms(..., method=m)
    memory-write limit  tf.tile writing as many bytes as the B per-example gradients
                      (B x P x 4): the physical floor of any method that returns them

The models are those of `pertower.tools.models`. Next to each pertower gradients
entry's traced peak, "est MiB" is `pertower.estimate_memory` for the same call.

Each entry is built (timed: "build s"), run once (timed: "1st run s", the result is
compared with the loop's: "max|diff|"), traced once for its peak memory
(`pertower.tools.traced_memory`), then run `repeats` times round-robin with the other entries, so
a change of load on the machine hits every entry alike ("ms" is the median). A method
that raises NotImplementedError when built is reported as "n/a" with its message.
The machine information includes the CPU facts of `pertower.tools.environment`
(allocator variables, oneDNN, AVX-512), which change these speeds several-fold.
"""

import sys

if __name__ == "__main__":
    # `python -m pertower.tools.bench ...` is `pertower bench ...`: the command sets up
    # the environment and quiets TensorFlow before importing it (and this module).
    from pertower.tools import cli as _cli
    sys.exit(_cli.main(["bench"] + sys.argv[1:]))

import dataclasses  # pylint: disable=wrong-import-position
import datetime
import os
import platform
import statistics
import time

import numpy as np
import tensorflow as tf
import tf_keras as keras

import pertower
from pertower import oracle
from pertower._api import gradients as gradients_lib
from pertower.tools import environment
from pertower.tools import models as models_lib
from pertower.tools import peers as peers_lib
from pertower.tools import timing
from pertower.tools import traced_memory as run_memory

__all__ = ["Entry", "DPEntry", "MODELS", "run_bench", "run_dp_bench", "format_table",
           "format_dp_table", "machine_info", "to_json", "plot", "main"]

MODELS = models_lib.MODEL_NAMES
QUICK = dict(models=("mlp", "cnn"), batch_sizes={"mlp": (32, 128), "cnn": (32,)},
             repeats=5, loop_repeats=3)
FULL = dict(models=("mlp", "cnn", "cifar"), batch_sizes={"mlp": (32, 128, 512),
                                                           "cnn": (32, 128, 512),
                                                           "cifar": (64, 128)},
            repeats=11, loop_repeats=5)
# tf.vectorized_map's backward pass holds about B copies of the batch's activations:
# it is skipped when B times the batch gradient's peak (or twice its B per-example
# gradients) exceeds this share of the memory available when it is about to be built.
VMAP_MEMORY_SHARE = 0.25
# Agreement with the loop in float32: max |diff| <= TOLERANCE * max(1, max |loop|).
TOLERANCE = 1e-4
# Entries that hold the B per-example gradients (B x P x 4 bytes; towers hold them
# twice) are skipped when twice that exceeds this share of the memory available when
# they are about to run; a whole (model, B) is skipped when the loop's reference
# (stacked from B rows: twice) does not fit in it.
MATERIALIZED_MEMORY_SHARE = 0.3

LOOP, BATCH, OUTER, HAND_NORMS, VMAP, WRITE_LIMIT, NORMS_FLOOR = (
    "loop", "batch gradient", "outer products", "norms by hand", "vectorized_map",
    "memory-write limit", "norms floor")
# entries whose result is not compared with the loop ("n/c")
NOT_COMPARED = ("write", "floor")


@dataclasses.dataclass
class Entry:
    """One row of the table: one way of computing one model's results at one B.

    Attributes:
      model: a name of `pertower.tools.models.MODEL_NAMES` ("mlp", "cnn", "cifar").
      batch_size: B.
      parameters: P, the number of weights (entries of all of xs).
      name: the row's name ("loop", "gradients[towers]", ...).
      computes: "gradients" ([B, *x.shape] per weight), "norms" ([B]), "sum"
        (the batch gradient, [*x.shape] per weight), "write" (the memory-write
        limit: [B, P] of filler) or "floor" (the norms floor: every layer output's
        gradient dZ); the last two are not compared with the loop.
      status: "ok", "n/a" (the method is not available), "skipped" or "error".
      reason: why the row is not "ok" (empty when it is).
      median_ms: median milliseconds of one pass (one sess.run; the loop: B of them).
      runs_ms: every timed pass, milliseconds.
      ratio_to_loop: median_ms / the loop's median_ms.
      ratio_to_batch: median_ms / the batch gradient's median_ms.
      ratio_to_outer: median_ms / the hand outer products' median_ms (MLP only).
      build_seconds: graph construction time of the entry's tensors.
      first_run_seconds: the first sess.run (includes Grappler's optimization).
      peak_bytes: peak memory of one traced sess.run (the loop: of one example's run).
      estimate_bytes: pertower.estimate_memory's total for this call (pertower
        gradients entries only).
      max_abs_diff: max |result - the loop's result| over all entries (norms: against
        the norms of the loop's gradients; the batch gradient: against their sum).
      max_abs_reference: max |the loop's result| over the same entries (its scale).
      agrees: max_abs_diff <= TOLERANCE * max(1, max_abs_reference) (None unless run).
      note: where the result differs most from the loop's (the peers: weight k and
        example i, and the max |diff| of a second run on the same inputs, which shows
        a result that changes from run to run); printed under the table when the row
        disagrees.
    """

    model: str
    batch_size: int
    parameters: int
    name: str
    computes: str
    status: str = "ok"
    reason: str = ""
    median_ms: float = None
    runs_ms: list = dataclasses.field(default_factory=list)
    ratio_to_loop: float = None
    ratio_to_batch: float = None
    ratio_to_outer: float = None
    build_seconds: float = None
    first_run_seconds: float = None
    peak_bytes: int = None
    estimate_bytes: int = None
    max_abs_diff: float = None
    max_abs_reference: float = None
    agrees: bool = None
    note: str = ""


@dataclasses.dataclass
class _Candidate:
    """An entry being measured: its row and what to run."""

    entry: Entry
    fetches: list = None   # tensors run on the whole batch
    loop: oracle.SliceLoop = None  # the loop instead of fetches


# The entries' graphs -------------------------------------------------------------------


def _dense(grads, xs):
    """tf.gradients output with None as zeros and IndexedSlices made dense."""
    return [tf.zeros_like(x) if g is None else tf.convert_to_tensor(g)
            for g, x in zip(grads, xs)]


def _batch_gradient(model):
    return _dense(tf.gradients(tf.reduce_sum(model.ys), model.weights), model.weights)


def _outer_products(model):
    """[B, *x.shape] per weight from one batched backward pass to the pre-activations:
    kernel: einsum('bi,bj->bij', A, dZ), bias: dZ (Goodfellow 2015)."""
    taps = model.dense_taps
    dZs = tf.gradients(tf.reduce_sum(model.ys), [Z for _, Z, _, _ in taps])  # [B, j] each
    grads = {}
    for (A, _, kernel, bias), dZ in zip(taps, dZs):
        grads[kernel.ref()] = tf.einsum("bi,bj->bij", A, dZ)  # [B, i, j]
        grads[bias.ref()] = dZ                                 # [B, j]
    return [grads[w.ref()] for w in model.weights]


def _norms_by_hand(model):
    """[B]: sqrt(sum over dense layers of ||a_i||^2 ||dz_i||^2 + ||dz_i||^2)."""
    taps = model.dense_taps
    dZs = tf.gradients(tf.reduce_sum(model.ys), [Z for _, Z, _, _ in taps])  # [B, j] each
    squares = []
    for (A, _, _, _), dZ in zip(taps, dZs):
        dz2 = tf.reduce_sum(tf.square(dZ), axis=1)                 # [B]
        squares += [tf.reduce_sum(tf.square(A), axis=1) * dz2, dz2]  # kernel, bias
    return [tf.sqrt(tf.add_n(squares))]


def _vectorized_map(model):
    """TensorFlow Privacy's vectorized way: map over the per-example losses [B] a
    function that takes tf.gradients of its one loss with respect to the weights."""
    ys = model.ys
    per_example = tf.reduce_sum(ys, axis=list(range(1, ys.shape.rank)))  # [B]

    def one_example(loss):
        return _dense(tf.gradients(loss, model.weights), model.weights)

    return list(tf.vectorized_map(one_example, per_example))  # [B, *x.shape] each


def _write_limit(model):
    """[B, P] float32 written by one tf.tile of a [1, P] row: the bytes of the B
    per-example gradients, written once (the row depends on the fed batch, so
    Grappler cannot fold it into a constant)."""
    B_fed = tf.shape(model.ys)[0]
    row = tf.fill([1, model.num_weights], tf.cast(B_fed, tf.float32))  # [1, P]
    return [tf.tile(row, tf.stack([B_fed, 1]))]                         # [B, P]


def _norms_floor(model, B):
    """The work every rules-based per-example norm needs before any per-layer work: the
    forward pass and ONE backward pass of sum(ys) to the output Z of every op the rules
    use ([B, ...] each), without any weight gradient. No norm from the rules can be
    cheaper than this; a batch gradient adds the weight gradients to it."""
    plan = pertower.explain(model.ys, model.weights, batch_size=B)
    outputs = {}
    for uses in plan.uses:
        for use in uses or ():
            outputs[use.output.ref()] = use.output
    if not outputs:
        raise NotImplementedError("no weight is computed by the rules")
    return _dense(tf.gradients(tf.reduce_sum(model.ys), list(outputs.values())),
                  list(outputs.values()))


def _estimate_bytes(model, B, method):
    """pertower.estimate_memory's total for the gradients of `model` at B by `method`,
    or None."""
    try:
        estimate = pertower.estimate_memory(model.ys, model.weights, batch_size=B,
                                            method=method)
    except Exception:  # pylint: disable=broad-except
        return None
    return None if estimate is None else estimate.total_bytes


# Measuring -----------------------------------------------------------------------------


def _max_abs(values, reference):
    """(max |value - reference|, max |reference|) over lists of arrays; row by row, so
    the temporaries stay the size of one example's result."""
    diff = scale = 0.0
    if len(values) != len(reference):
        return float("inf"), 0.0
    for got, want in zip(values, reference):
        got, want = np.asarray(got), np.asarray(want)
        if got.shape != want.shape:
            return float("inf"), 0.0
        rows = zip(got, want) if got.ndim else [(got, want)]
        for got_row, want_row in rows:
            if want_row.size:
                diff = max(diff, float(np.max(np.abs(got_row - want_row))))
                scale = max(scale, float(np.max(np.abs(want_row))))
    return diff, scale


def _reference_for(computes, loop_gradients):
    """What an entry's result is compared with, from the loop's [B, *x.shape] list."""
    if computes == "gradients":
        return loop_gradients
    if computes == "sum":
        return [g.sum(axis=0) for g in loop_gradients]
    squares = sum(np.square(g.astype(np.float64)).reshape(len(g), -1).sum(axis=1)
                  for g in loop_gradients)
    return [np.sqrt(squares)]                                    # [B]


def _short(error):
    """A one-line description of an exception for the table's reason column."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def _available_memory_bytes():
    """MemAvailable from /proc/meminfo (Linux), or None."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _too_big(needed_bytes, share, what):
    """A reason to skip an entry when `needed_bytes` exceed `share` of the memory
    available now, else an empty string."""
    available = _available_memory_bytes()
    if available is None or needed_bytes <= share * available:
        return ""
    return (f"{what}: about {needed_bytes / 2**30:.1f} GiB, more than {share:.0%} of the "
            f"{available / 2**30:.1f} GiB available")


def _bench_one(model_name, B, methods, repeats, loop_repeats, report):
    """All entries for one model at one B, in one graph and session; returns them."""
    rng = np.random.default_rng(B)
    with tf.Graph().as_default() as graph, tf.compat.v1.Session(graph=graph) as sess:
        tf.compat.v1.set_random_seed(B)
        model = models_lib.build(model_name, B, rng)
        P = model.num_weights
        result_bytes = 4 * B * P                      # [B, *x.shape] for all x, float32
        too_big = _too_big(2 * result_bytes, MATERIALIZED_MEMORY_SHARE,
                           f"the loop's reference holds the {B} per-example gradients")
        if too_big:
            return [Entry(model_name, B, P, LOOP, "gradients", status="skipped",
                          reason=f"all entries of {model_name} at B={B} skipped: {too_big}")]
        candidates = []

        def add(name, computes, build):
            entry = Entry(model_name, B, P, name, computes)
            candidate = _Candidate(entry)
            start = time.perf_counter()
            try:
                built = build()
            except NotImplementedError as error:
                entry.status, entry.reason = "n/a", _short(error)
                built = None
            except Exception as error:  # pylint: disable=broad-except
                entry.status, entry.reason = "error", _short(error)
                built = None
            entry.build_seconds = time.perf_counter() - start
            if isinstance(built, oracle.SliceLoop):
                candidate.loop = built
            else:
                candidate.fetches = built
            candidates.append(candidate)
            return candidate

        loop = add(LOOP, "gradients", lambda: oracle.SliceLoop(model.ys, model.weights))
        add(BATCH, "sum", lambda: _batch_gradient(model))
        if model.dense_taps:
            add(OUTER, "gradients", lambda: _outer_products(model))
        add(WRITE_LIMIT, "write", lambda: _write_limit(model))
        for method in methods:
            add(f"gradients[{method}]", "gradients",
                lambda m=method: pertower.per_example_gradients(
                    model.ys, model.weights, batch_size=B, method=m)
                ).entry.estimate_bytes = _estimate_bytes(model, B, method)
        if model.dense_taps:
            add(HAND_NORMS, "norms", lambda: _norms_by_hand(model))
        add(NORMS_FLOOR, "floor", lambda: _norms_floor(model, B))
        for method in methods:
            add(f"norms[{method}]", "norms",
                lambda m=method: [pertower.per_example_norms(
                    model.ys, model.weights, batch_size=B, method=m)])
        sess.run(tf.compat.v1.global_variables_initializer())

        # The reference: the loop, once (this is also its warm-up).
        start = time.perf_counter()
        reference = loop.loop.run(sess, model.feed, B)            # [B, *x.shape] each
        loop.entry.first_run_seconds = time.perf_counter() - start
        loop.entry.max_abs_diff, loop.entry.max_abs_reference = 0.0, _max_abs(
            reference, reference)[1]
        one_example = next(oracle.slice_feeds(model.feed, None, B))
        loop.entry.peak_bytes = _traced_peak(sess, loop.loop.gradients, one_example)

        for candidate in candidates[1:]:
            if candidate.entry.status == "ok" and candidate.entry.computes in ("gradients",
                                                                              "write"):
                too_big = _too_big(2 * result_bytes, MATERIALIZED_MEMORY_SHARE,
                                   f"it holds the {B} per-example gradients (towers: twice)")
                if too_big:
                    candidate.entry.status, candidate.entry.reason = "skipped", too_big
            _first_run(sess, candidate, model.feed, reference)
        batch_peak = next(c.entry.peak_bytes for c in candidates if c.entry.name == BATCH)

        # tf.vectorized_map last: its graph is built only if its memory fits.
        too_big = _too_big(max(B * (batch_peak or 0), 2 * result_bytes), VMAP_MEMORY_SHARE,
                           "its backward pass holds about B x the batch gradient's peak")
        if too_big:
            candidates.append(_Candidate(Entry(model_name, B, P, VMAP, "gradients",
                                               status="skipped", reason=too_big)))
        else:
            vmap = add(VMAP, "gradients", lambda: _vectorized_map(model))
            _first_run(sess, vmap, model.feed, reference)
        report(f"  {model_name} B={B}: built and checked {len(candidates)} entries; timing")

        _time_round_robin(sess, [c for c in candidates if c.entry.status == "ok"],
                          model.feed, B, repeats, loop_repeats)
    entries = [c.entry for c in candidates]
    for entry in entries:
        if entry.max_abs_diff is not None:
            entry.agrees = bool(entry.max_abs_diff
                                <= TOLERANCE * max(1.0, entry.max_abs_reference))
        if entry.runs_ms:
            entry.median_ms = statistics.median(entry.runs_ms)
    _ratios(entries)
    return entries


def _time_round_robin(sess, candidates, feed, B, repeats, loop_repeats):
    """Times `repeats` runs of each candidate (`loop_repeats` passes of the loop), one
    run of each in turn, so a change of load on the machine hits them alike."""
    runs = []
    for candidate in candidates:
        if candidate.loop is not None:
            runs.append((lambda c=candidate: c.loop.run(sess, feed, B), loop_repeats))
        else:
            runs.append((lambda c=candidate: sess.run(c.fetches, feed), repeats))
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
        if entry.computes not in NOT_COMPARED:
            entry.max_abs_diff, entry.max_abs_reference = _max_abs(
                values, _reference_for(entry.computes, reference))
        del values
        entry.peak_bytes = _traced_peak(sess, candidate.fetches, feed)
    except Exception as error:  # pylint: disable=broad-except
        entry.status, entry.reason = "error", _short(error)


def _ratios(entries):
    """Fills the ratios of each entry's median to the loop, batch gradient, outer products."""
    medians = {e.name: e.median_ms for e in entries if e.median_ms}
    for entry in entries:
        if entry.median_ms is None:
            continue
        for attribute, name in [("ratio_to_loop", LOOP), ("ratio_to_batch", BATCH),
                                ("ratio_to_outer", OUTER)]:
            if medians.get(name):
                setattr(entry, attribute, entry.median_ms / medians[name])


def machine_info():
    """A dict describing the machine and software the figures come from."""
    cpu_model = platform.processor() or ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    cpu_model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    available = _available_memory_bytes()
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu_count": os.cpu_count(),
        "usable_cpus": usable,
        "cpu_model": cpu_model,
        "load_average_1_5_15": list(load) if load else None,
        "memory_available_gib": round(available / 2**30, 1) if available else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "tf_keras": keras.__version__,
        "numpy": np.__version__,
        "pertower": pertower.__version__,
        "cpu_speed": environment.cpu_facts(),
    }


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
        (`pertower.tools.peers`; models may then include its "cifar").
      peer_rounds: child processes per peer framework (each times `repeats` passes).
      peer_info: a dict that receives each peer framework's versions.

    Example:
      entries = run_bench(models=["mlp"], batch_sizes=[32], repeats=3)
      print(format_table(entries))
    """
    if batch_sizes is None:
        batch_sizes = QUICK["batch_sizes"]
    groups = {}  # (model, B) -> its entries
    for model_name in models:
        known = MODELS + (peers_lib.PEER_MODELS if peers else ())
        if model_name not in known:
            raise ValueError(f"pertower.tools.bench: unknown model {model_name!r}; choose from "
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
            if not any(e.name == LOOP and e.status == "skipped" for e in group)]
    rows = peers_lib.run_peers(keys, repeats, rounds, report, info,
                               timed_loops=[key for key in keys if not groups[key]])
    for entry in rows:
        groups[entry.model, entry.batch_size].append(entry)
    for group in groups.values():
        _ratios(group)


# DP steps ------------------------------------------------------------------------------

# DP rows: per model, the batch sizes the DP-SGD step is timed at (models the installed
# `pertower.tools.models` lacks are skipped).
DP_BATCH_SIZES = {"mlp": (128,), "cnn": (32,), "cifar": (64,)}
DP_LEARNING_RATE = 1e-3   # small: the timed steps train the weights they measure


@dataclasses.dataclass
class DPEntry:
    """One DP row: the median ms of a "plain step" and a "dp step[method]"."""

    model: str
    batch_size: int
    name: str
    runs_ms: list = dataclasses.field(default_factory=list)

    @property
    def median_ms(self):
        return statistics.median(self.runs_ms) if self.runs_ms else None


def run_dp_bench(models=None, batch_sizes=None, repeats=11, methods=("auto",),
                 report=print):
    """Times a plain SGD step against DPOptimizer's step, side by side (round robin).

    "plain step": GradientDescentOptimizer.minimize of the mean per-example cost;
    "dp step[method]": `pertower.DPOptimizer` around the same optimizer, C = 1, σ = 1,
    one microbatch per example; "dp step[method] σ=0": the first method's step without
    noise (the clipping alone). Each is one sess.run of the training op.

    Args:
      models: names (default: those of DP_BATCH_SIZES that `models` provides).
      batch_sizes: a list of B for every model, or a dict model -> list of B.
      repeats: timed steps of each row after one warm-up step.
      methods: DPOptimizer methods to time.
      report: called with each line of progress.

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
                # the same step without its noise: what clipping costs, apart from the
                # P Gaussian draws
                dp = pertower.DPOptimizer(sgd(DP_LEARNING_RATE), l2_norm_clip=1.0,
                                          noise_multiplier=0.0, method=methods[0])
                steps.append((f"dp step[{methods[0]}] σ=0", dp.minimize(
                    loss, var_list=model.weights, batch_size=B)))
                sess.run(tf.compat.v1.global_variables_initializer())
                rows = [DPEntry(model_name, B, name) for name, _ in steps]
                for _, op in steps:
                    sess.run(op, model.feed)                     # warm-up
                times = timing.round_robin(
                    [(lambda op=op: sess.run(op, model.feed), repeats) for _, op in steps])
                for row, seconds in zip(rows, times):
                    row.runs_ms.extend(1e3 * t for t in seconds)
                entries += rows
    return entries


def format_dp_table(entries):
    """The DP rows as text: median ms and the ratio to the plain step of the same run."""
    plain = {(e.model, e.batch_size): e.median_ms for e in entries if e.name == "plain step"}
    rows = []
    for e in entries:
        base = plain.get((e.model, e.batch_size))
        rows.append((e.model, str(e.batch_size), e.name, _fmt(e.median_ms, ".1f"),
                     _fmt(e.median_ms / base if base else None, ".2f")))
    return timing.format_table(("model", "B", "step", "ms", "x plain"), rows)


# Output --------------------------------------------------------------------------------

MEMORY_FOOTNOTE = (
    "peak MiB: one sess.run traced with RunOptions(trace_level=FULL_TRACE); its step_stats "
    "are replayed: every buffer allocated in the run is live from its node's start to "
    "its last consumer's end (fetched tensors to the end of the run), plus each running "
    "node's temporaries (memory.peak_bytes); in-place outputs share their input's buffer; "
    "constants, variables and fed inputs are not counted. loop: one example's sess.run "
    "(the B results the loop stacks in numpy are not counted). est MiB: "
    "pertower.estimate_memory for the same call (result, towers' gradients, replayed "
    "activations), computed before any op is built.")


PEERS_FOOTNOTE = (
    "peers: each framework in its own child process per round (rounds alternate the "
    "frameworks), weights copied from the TensorFlow model; ms: median over the rounds' "
    "timed passes. torch vmap(grad) / jax jit(vmap(grad)): per-example gradients against "
    "the loop's; dp step: one DP-SGD step (clip C = median per-example norm, noise "
    "multiplier 1), checked once with noise 0 against the loop's clipped mean; step: tf "
    "plain SGD against the loop's mean gradient. No peak memory is traced for them.")


def _fmt(value, spec, missing="-"):
    return missing if value is None else format(value, spec)


def _mib(n_bytes):
    return _fmt(None if n_bytes is None else n_bytes / 2**20, ".2f")


def _diff_cell(entry):
    """The max|diff| cell: (ref) for the loop, n/c for a row not compared."""
    if entry.name == LOOP:
        return "(ref)"
    if entry.max_abs_diff is None:
        return "n/c"
    return _fmt(entry.max_abs_diff, ".1e") + ("" if entry.agrees else " WRONG")


def format_table(entries):
    """The entries as plain-text tables, one per model and B (a string)."""
    header = ("entry", "ms", "x loop", "x batch", "x outer", "build s", "1st run s",
              "peak MiB", "est MiB", "max|diff|")
    blocks = []
    keys = []
    for e in entries:
        if (e.model, e.batch_size) not in keys:
            keys.append((e.model, e.batch_size))
    for model_name, B in keys:
        P = next(e.parameters for e in entries if (e.model, e.batch_size) == (model_name, B))
        rows = []
        for e in entries:
            if (e.model, e.batch_size) != (model_name, B):
                continue
            if e.status != "ok":
                rows.append((e.name, f"{e.status}: {e.reason}"))
                continue
            rows.append((e.name, _fmt(e.median_ms, ".2f"), _fmt(e.ratio_to_loop, ".3f"),
                         _fmt(e.ratio_to_batch, ".1f"), _fmt(e.ratio_to_outer, ".2f"),
                         _fmt(e.build_seconds, ".2f"), _fmt(e.first_run_seconds, ".2f"),
                         _mib(e.peak_bytes), _mib(e.estimate_bytes), _diff_cell(e)))
        notes = [f"  {e.name} WRONG: largest difference at {e.note}" for e in entries
                 if (e.model, e.batch_size) == (model_name, B) and e.status == "ok"
                 and e.agrees is False and e.note]
        blocks.append(f"{model_name}, B={B}, P={P:,} weights\n"
                      + timing.format_table(header, rows)
                      + "".join("\n" + line for line in notes))
    return "\n\n".join(blocks)


def to_json(entries, machine, settings):
    """The figures as a JSON-ready dict: machine, settings, footnotes and entries
    (with a "peers" note when settings has "peers")."""
    figures = {
        "machine": machine,
        "settings": settings,
        "notes": {
            "ms": "median wall milliseconds of one pass over the batch (loop: B sess.run)",
            "ratios": "ratio_to_X = median_ms / X's median_ms (below 1: faster than X)",
            "peak_bytes": MEMORY_FOOTNOTE,
            "max_abs_diff": "max |result - loop's result|; norms against the norms of the "
                            "loop's gradients, the batch gradient against their sum; "
                            "the memory-write limit and the norms floor are not compared",
            "estimate_bytes": "pertower.estimate_memory(ys, xs, batch_size=B, method=m).total_bytes",
            "memory_write_limit": "tf.tile writing B x P float32 (the per-example "
                                  "gradients' bytes) once: the physical floor",
            "norms_floor": "the forward pass and one backward pass to the output of every "
                           "op the rules use, no weight gradient: what any rules-based "
                           "per-example norm costs at least",
            "cpu_speed": "allocator and oneDNN settings of the measuring process (see "
                         "README, CPU speed)",
        },
        "entries": [dataclasses.asdict(e) for e in entries],
    }
    if "peers" in settings:
        figures["notes"]["peers"] = PEERS_FOOTNOTE
    return figures


_FIXED_COLORS = {LOOP: "black", BATCH: "grey", OUTER: "tab:brown", HAND_NORMS: "tab:brown",
                 VMAP: "tab:purple", WRITE_LIMIT: "silver",
                 NORMS_FLOOR: "gainsboro"}
_METHOD_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:cyan", "tab:olive",
                  "tab:pink")


def _color(name):
    """One color per reference entry; gradients[m] and norms[m] share method m's color."""
    if name in _FIXED_COLORS:
        return _FIXED_COLORS[name]
    if name in peers_lib.COLORS:
        return peers_lib.COLORS[name]
    method = name[name.find("[") + 1:-1]
    methods = list(gradients_lib.METHODS)
    index = methods.index(method) if method in methods else len(methods)
    return _METHOD_COLORS[index % len(_METHOD_COLORS)]


def plot(entries, path):
    """Draws median ms and peak MiB against B, one column per model, into `path`."""
    try:
        import matplotlib  # pylint: disable=import-outside-toplevel
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
    except ImportError as error:
        raise RuntimeError(
            f"pertower bench --plot needs matplotlib ({error}); install it with "
            "`pip install matplotlib` or drop --plot.") from None
    models = list(dict.fromkeys(e.model for e in entries))
    figure, axes = plt.subplots(2, len(models), figsize=(6.5 * len(models), 8.5),
                                squeeze=False)
    for column, model_name in enumerate(models):
        mine = [e for e in entries if e.model == model_name and e.status == "ok"]
        names = list(dict.fromkeys(e.name for e in mine))
        sizes = sorted({e.batch_size for e in mine})
        for row, (attribute, scale, label) in enumerate(
                [("median_ms", 1.0, "median ms per pass"),
                 ("peak_bytes", 2.0 ** -20, "peak MiB of one run")]):
            ax = axes[row][column]
            for name in names:
                points = sorted((e.batch_size, getattr(e, attribute) * scale)
                                for e in mine if e.name == name
                                and getattr(e, attribute) is not None)
                # norms dashed, gradients solid, training steps (peers) dotted
                style = "--" if "norms" in name else ":" if "step" in name else "-"
                # a row that disagrees with the loop keeps its time, marked in the legend
                wrong = any(e.agrees is False for e in mine if e.name == name)
                if points:
                    ax.plot(*zip(*points), style, marker="o", color=_color(name),
                            label=name + (" (WRONG at some B)" if wrong else ""))
            ax.set_xscale("log", base=2)
            ax.set_xticks(sizes)
            ax.set_xticklabels([str(b) for b in sizes])
            ax.minorticks_off()
            ax.set_yscale("log")
            ax.set_xlabel("B (examples)")
            ax.set_ylabel(label)
            ax.set_title(f"{model_name}: {label}")
            ax.grid(True, which="both", alpha=0.3)
            if row == 0:
                ax.legend(fontsize=8)
    figure.suptitle("pertower bench (loop = one sess.run per example; memory of the loop: "
                    "one example)", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main(argv=None):
    """`python -m pertower.tools.bench ...`: the same as `pertower bench ...`."""
    from pertower.tools import cli  # pylint: disable=import-outside-toplevel

    return cli.main(["bench"] + list(sys.argv[1:] if argv is None else argv))

"""`python -m benchmarks --models NAME,...` on the zoo (`benchmarks.zoo`): per network and
B, what pertower costs against TensorFlow's own batch gradient, a plain SGD step and the
one-example loop, and what building it costs against `tf.gradients`.

Notation:
    B   examples in the batch       P   weights (parameters) of the network

Build time, per network: the network is built afresh in a new `tf.Graph()` for every
timed build (so that nothing one build leaves in a graph serves the next); first one
`tf.gradients` of the summed loss and one pertower build (`per_example_gradients` of
the same loss), the latter kept as "first build" (in the process' first network it
pays pertower's one-time costs, its lazily imported modules, that a user pays once per
process), then `build_repeats` alternating `tf.gradients` / pertower builds, whose
medians (wall and process CPU seconds) and the ratio of medians are reported. A network
whose plan puts a weight on towers or row passes is built with the first B as its
`batch_size`. Python's garbage is collected (`gc.collect()`) after the network is built
and before each timed build starts: the graphs of earlier builds (and of earlier
networks) are reference cycles that only a full collection frees, and freeing them costs
up to seconds; left pending, that cost falls on whichever later build triggers the
collection (most often pertower's, which allocates more), which a user building once in
a process never pays.

Run time, per network: one graph: the network (None batch dimension), `tf.gradients` of
the summed loss, pertower's per-example gradients, the norms, a plain SGD step and a
DP-SGD step (`pertower.DPOptimizer`, C = 1, σ = 1) (pertower's rows built again per B
when the plan needs a fixed B). Per B: the variables initialized again (the timed steps
of the previous B trained them; tf_keras' stateless initializers give the same weights
at every B, the v1 idioms' stateful ones their next draw), one run of the per-example
gradients checked against the loop (max relative difference), then every row timed
round-robin (medians).

The weights compared at: `zoo.build(name, seed=WEIGHTS_SEED)` under the graph's seed 0,
so every process compares at the same weights and feeds. (tf_keras' initializers given
no seed follow neither the graph's seed nor the initializer's reruns, see `zoo`: before
the bench seeded them, each process drew other weights, and a disagreement seen in one
run could not be reproduced in another.) A row over the tolerance of the loop is checked
again at the batch's own forward (`zoo_agreement`: the forwards at B and at 1 may round
to different sides of a ReLU's kink); only a row that disagrees there too is WRONG.
"""

import dataclasses
import gc
import statistics
import time

import numpy as np
import tensorflow as tf

import pertower
from pertower import oracle
from pertower.tools import plan_summary
from pertower.tools import timing
from benchmarks import zoo
from benchmarks import report as report_lib
from benchmarks import zoo_agreement as agreement
from benchmarks.zoo_agreement import RELATIVE_TOLERANCE

__all__ = ["DEFAULT_BATCH_SIZES", "DEFAULT_BUILD_REPEATS", "ROWS", "BuildTimes", "ZooRow",
           "RELATIVE_TOLERANCE", "WEIGHTS_SEED", "measure_builds", "run_zoo_bench",
           "format_zoo_table", "to_json"]

DEFAULT_BATCH_SIZES = (8, 16, 32)
DEFAULT_BUILD_REPEATS = 3
WEIGHTS_SEED = 0          # zoo.build's seed of the tf_keras initializers
LEARNING_RATE = 1e-3      # small: the timed steps train the weights they measure
_BUILD_NOTE = ("tf.gradients s / pertower s: building tf.gradients(sum(loss), weights) / "
              "pertower.per_example_gradients(loss, weights), medians of the timed builds "
              "(wall s, each in a fresh graph); build x / build x cpu: ratio of the wall / process-CPU medians; "
              "first build s: the network's first pertower build (not in the medians).")
ROWS = ("batch gradient", "plain step", "gradients", "norms", "dp step", "loop")


def _median(values):
    return statistics.median(values) if values else None


def _ratio(numerator, denominator):
    return None if numerator is None or not denominator else numerator / denominator


@dataclasses.dataclass
class BuildTimes:
    """Timed builds of one network, each in a fresh graph (seconds).

    Attributes:
      tf_gradients_s, tf_gradients_cpu_s: wall / process CPU seconds of each timed
        `tf.gradients` build (the warm-up excluded).
      pertower_s, pertower_cpu_s: the same of each timed pertower build (the first
        excluded).
      first_s, first_cpu_s: the first pertower build of the network (without
        `batch_size` when the plan allows it, else after that refused attempt).
      batch_size: the `batch_size` of the pertower builds (None: not needed).
    """

    tf_gradients_s: list = dataclasses.field(default_factory=list)
    tf_gradients_cpu_s: list = dataclasses.field(default_factory=list)
    pertower_s: list = dataclasses.field(default_factory=list)
    pertower_cpu_s: list = dataclasses.field(default_factory=list)
    first_s: float = None
    first_cpu_s: float = None
    batch_size: int = None

    @property
    def medians(self):
        """{field: median} of the four lists of runs."""
        return {name: _median(getattr(self, name)) for name in
                ("tf_gradients_s", "tf_gradients_cpu_s", "pertower_s", "pertower_cpu_s")}

    @property
    def ratio(self):
        """Median pertower wall seconds / median tf.gradients wall seconds."""
        return _ratio(_median(self.pertower_s), _median(self.tf_gradients_s))

    @property
    def cpu_ratio(self):
        """The same in process CPU seconds."""
        return _ratio(_median(self.pertower_cpu_s), _median(self.tf_gradients_cpu_s))


@dataclasses.dataclass
class ZooRow:
    """One network at one B.

    Attributes:
      network, batch_size, parameters: the zoo name, B, P.
      counts: weights per method of the plan ({"rules": n, "towers": n, ...}).
      builds: the network's `BuildTimes` (tf.gradients of sum(loss) w.r.t. the weights,
        pertower.per_example_gradients of the same), shared by its rows.
      ms: row name (ROWS) -> median milliseconds of one pass (the loop: B sess.run).
      runs_ms: row name -> every timed pass.
      max_relative_diff: max |per-example gradients - the loop's| / max |loop's|.
      forward_diff, loop_forward_diff: when max_relative_diff is over the tolerance,
        pertower's / the loop's max difference (over the examples over the tolerance,
        relative to max |loop's|) from each such example's gradient at the batch's own
        forward (`BatchForwardGradients`); None otherwise.
      error: why the network was not measured ("" when it was).
    """

    network: str
    batch_size: int
    parameters: int = 0
    counts: dict = None
    builds: BuildTimes = None
    ms: dict = dataclasses.field(default_factory=dict)
    runs_ms: dict = dataclasses.field(default_factory=dict)
    max_relative_diff: float = None
    forward_diff: float = None
    loop_forward_diff: float = None
    error: str = ""

    def build(self, name):
        """The median of `BuildTimes` field `name` ("tf_gradients_s", "pertower_cpu_s",
        ...), or None."""
        return None if self.builds is None else self.builds.medians[name]

    @property
    def build_ratio(self):
        """Median pertower build / median tf.gradients build (wall seconds)."""
        return None if self.builds is None else self.builds.ratio

    @property
    def build_cpu_ratio(self):
        """The same in process CPU seconds."""
        return None if self.builds is None else self.builds.cpu_ratio

    @property
    def agrees(self):
        """Within the tolerance of the loop, or (when not) of the gradients at the batch's
        own forward (see the module's docstring); None when not compared."""
        if self.max_relative_diff is None:
            return None
        return (self.max_relative_diff <= RELATIVE_TOLERANCE
                or (self.forward_diff is not None and self.forward_diff <= RELATIVE_TOLERANCE))

    def ratio(self, row, base):
        """ms[row] / ms[base], or None."""
        if self.ms.get(row) is None or not self.ms.get(base):
            return None
        return self.ms[row] / self.ms[base]


def _tf_gradients(loss, weights):
    return [tf.convert_to_tensor(g) for g in tf.gradients(tf.reduce_sum(loss), weights)
            if g is not None]


def _timed_build(name, pertower_build, batch_size):
    """(wall s, process CPU s) of one build in a fresh graph holding only the network,
    started with no garbage pending (see the module's docstring)."""
    with tf.Graph().as_default():
        tf.compat.v1.set_random_seed(0)
        loss, _, _, weights = zoo.build(name)
        gc.collect()
        wall, cpu = time.perf_counter(), time.process_time()
        if pertower_build:
            pertower.per_example_gradients(loss, weights, batch_size=batch_size)
        else:
            _tf_gradients(loss, weights)
        return time.perf_counter() - wall, time.process_time() - cpu


def measure_builds(name, batch_sizes=(None,), repeats=DEFAULT_BUILD_REPEATS):
    """Times building `tf.gradients` and pertower's per-example gradients of zoo network
    `name`'s loss, each build in a fresh graph.

    Args:
      name: a name from `benchmarks.zoo.ZOO`.
      batch_sizes: pertower builds without `batch_size`; when that is refused (a plan
        with towers or row passes needs a fixed B), with `batch_sizes[0]`.
      repeats: timed builds of each after the first pair (alternating).

    Returns:
      A `BuildTimes`: the first pertower build apart, then `repeats` runs of each.
    """
    times = BuildTimes()
    _timed_build(name, False, None)                        # tf.gradients' warm-up
    try:
        times.first_s, times.first_cpu_s = _timed_build(name, True, None)
    except ValueError:          # refused without batch_size (raised again if not that)
        times.batch_size = batch_sizes[0]
        times.first_s, times.first_cpu_s = _timed_build(name, True, times.batch_size)
    for _ in range(repeats):
        for pertower_build, prefix in ((False, "tf_gradients"), (True, "pertower")):
            wall, cpu = _timed_build(name, pertower_build, times.batch_size)
            getattr(times, f"{prefix}_s").append(wall)
            getattr(times, f"{prefix}_cpu_s").append(cpu)
    return times


def _pertower_rows(network, batch_size, seed):
    """{row: fetch} of pertower's rows (gradients, norms, dp step)."""
    loss, _, _, weights = network
    grads = pertower.per_example_gradients(loss, weights, batch_size=batch_size)
    dp = pertower.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer(LEARNING_RATE),
                              l2_norm_clip=1.0, noise_multiplier=1.0, seed=seed)
    rows = {"gradients": grads,
            "norms": pertower.per_example_norms(loss, weights, batch_size=batch_size),
            "dp step": dp.minimize(loss, var_list=weights, batch_size=batch_size)}
    return rows


def _method_counts(name):
    with tf.Graph().as_default():
        loss, _, _, weights = zoo.build(name)
        return plan_summary.method_counts(pertower.explain(loss, weights))


def _bench_network(name, batch_sizes, repeats, loop_repeats, build_repeats, report):
    rows_out = []
    builds = measure_builds(name, batch_sizes, build_repeats)
    counts = _method_counts(name)
    fixed_b = bool(counts["towers"] + counts["passes"])
    report(f"  {name}: build {builds.medians['pertower_s']:.2f} s vs tf.gradients "
           f"{builds.medians['tf_gradients_s']:.2f} s (medians of {build_repeats}, "
           f"{builds.ratio:.2f}x; CPU {builds.cpu_ratio:.2f}x); first build "
           f"{builds.first_s:.2f} s")
    with tf.Graph().as_default() as graph, tf.compat.v1.Session(graph=graph) as sess:
        tf.compat.v1.set_random_seed(0)
        network = zoo.build(name, seed=WEIGHTS_SEED)
        loss, _, make_feed, weights = network
        batch_grads = _tf_gradients(loss, weights)
        plain = tf.compat.v1.train.GradientDescentOptimizer(LEARNING_RATE).minimize(
            tf.reduce_mean(loss), var_list=weights)
        shared = None if fixed_b else _pertower_rows(network, None, 0)
        loop = oracle.SliceLoop(loss, weights)
        forward = None            # built when a row disagrees with the loop
        for B in batch_sizes:
            pertower_rows = _pertower_rows(network, B, B) if fixed_b else shared
            row = ZooRow(name, B, network.num_weights, counts, builds)
            sess.run(tf.compat.v1.global_variables_initializer())
            feed = make_feed(B, np.random.default_rng(B))
            got = sess.run(pertower_rows["gradients"], feed)
            want = loop.run(sess, feed, B)
            row.max_relative_diff = agreement.max_relative_diff(got, want)
            if row.max_relative_diff > RELATIVE_TOLERANCE:
                report(agreement.disagreement(sess, pertower_rows["gradients"], loop, feed,
                                              B, (got, want), weights))
                forward = forward or agreement.BatchForwardGradients(loss, weights)
                report(agreement.check_at_batch_forward(row, sess, forward, feed, (got, want)))
            del got, want
            fetches = {"batch gradient": batch_grads, "plain step": plain, **pertower_rows}
            runs = [(lambda f=f: sess.run(f, feed), repeats) for f in fetches.values()]
            runs.append((lambda: loop.run(sess, feed, B), loop_repeats))
            for fetch in fetches.values():
                sess.run(fetch, feed)                                   # warm-up
            for row_name, seconds in zip(list(fetches) + ["loop"], timing.round_robin(runs)):
                row.runs_ms[row_name] = [1e3 * s for s in seconds]
                row.ms[row_name] = statistics.median(row.runs_ms[row_name])
            report(f"  {name} B={B}: {plan_summary.counts_cell(counts)} rules/towers/"
                   f"passes; gradients {row.ms['gradients']:.1f} ms = "
                   f"{row.ratio('gradients', 'batch gradient'):.2f}x batch, "
                   f"{row.ratio('gradients', 'loop'):.2f}x loop; max rel diff "
                   f"{agreement.diff_cell(row)}")
            rows_out.append(row)
    return rows_out


def run_zoo_bench(networks, batch_sizes=DEFAULT_BATCH_SIZES, repeats=5, loop_repeats=3,
                  report=print, build_repeats=DEFAULT_BUILD_REPEATS):
    """Measures each zoo network at each B; returns a list of `ZooRow`.

    Args:
      networks: names from `benchmarks.zoo.ZOO`.
      batch_sizes: the B to measure each network at.
      repeats: timed passes of each row after a warm-up (the loop: loop_repeats).
      loop_repeats: timed passes of the one-example loop (B sess.run each).
      report: called with each line of progress.
      build_repeats: timed builds of tf.gradients and of pertower per network (medians),
        after a first pair (`measure_builds`).
    """
    rows = []
    for name in networks:
        report(f"{name}: building ...")
        start = time.perf_counter()
        try:
            rows += _bench_network(name, batch_sizes, repeats, loop_repeats, build_repeats,
                                   report)
        except Exception as error:  # pylint: disable=broad-except  # reported in the table
            text = str(error).strip().splitlines()
            rows += [ZooRow(name, B, error=f"{type(error).__name__}: "
                            f"{text[0] if text else ''}"[:200]) for B in batch_sizes]
        report(f"  done in {time.perf_counter() - start:.1f} s")
    return rows


def format_zoo_table(rows):
    """The rows as one plain-text table."""
    cell = report_lib.cell
    header = ("network", "B", "P", "rules/towers/passes", "tf.gradients s", "pertower s",
              "build x", "build x cpu", "first build s", "batch ms", "step ms", "grads ms",
              "x batch", "x loop", "norms ms", "dp ms", "dp x step", "loop ms", "max rel diff")
    table = []
    for r in rows:
        if r.error:
            table.append((r.network, str(r.batch_size), f"error: {r.error}"))
            continue
        table.append((
            r.network, str(r.batch_size), f"{r.parameters / 1e6:.2f}M",
            plan_summary.counts_cell(r.counts), cell(r.build("tf_gradients_s"), ".2f"),
            cell(r.build("pertower_s"), ".2f"), cell(r.build_ratio, ".2f"),
            cell(r.build_cpu_ratio, ".2f"),
            cell(None if r.builds is None else r.builds.first_s, ".2f"),
            cell(r.ms.get("batch gradient"), ".1f"), cell(r.ms.get("plain step"), ".1f"),
            cell(r.ms.get("gradients"), ".1f"),
            cell(r.ratio("gradients", "batch gradient"), ".2f"),
            cell(r.ratio("gradients", "loop"), ".2f"), cell(r.ms.get("norms"), ".1f"),
            cell(r.ms.get("dp step"), ".1f"), cell(r.ratio("dp step", "plain step"), ".2f"),
            cell(r.ms.get("loop"), ".1f"),
            agreement.diff_cell(r)))
    return timing.format_table(header, table) + "\n" + _BUILD_NOTE + "\n" + agreement.DIFF_NOTE


def to_json(rows):
    """The rows as JSON-ready dicts, with the build medians and ratios."""
    out = []
    for r in rows:
        entry = dataclasses.asdict(r)
        if r.builds is not None:
            entry["builds"].update({f"median_{k}": v for k, v in r.builds.medians.items()})
        out.append(dict(entry, build_ratio=r.build_ratio, build_cpu_ratio=r.build_cpu_ratio))
    return out

"""`pertower bench --models NAME,...` on the zoo (`pertower.tools.zoo`): per network and
B, what pertower costs against TensorFlow's own batch gradient, a plain SGD step and the
one-example loop, and what building it costs against `tf.gradients`.

Notation:
    B   examples in the batch       P   weights (parameters) of the network

Per network, one graph: the network (None batch dimension), then, timed, `tf.gradients`
of the summed loss ("tf.gradients s") and pertower's per-example gradients of the same
loss ("pertower s"; their ratio is "build x"); then the norms, a plain SGD step and a
DP-SGD step (`pertower.DPOptimizer`, C = 1, σ = 1). A network whose plan puts a weight on
towers or row passes needs a fixed B: its pertower rows are built again per B (the build
time shown is the first B's). Per B: one run of the per-example gradients checked against
the loop (max relative difference), then every row timed round-robin (medians).
"""

import dataclasses
import statistics
import time

import numpy as np
import tensorflow as tf

import pertower
from pertower import oracle
from pertower.tools import plan_summary
from pertower.tools import timing
from pertower.tools import zoo
from pertower.tools.bench import report as report_lib

__all__ = ["DEFAULT_BATCH_SIZES", "ROWS", "ZooRow", "run_zoo_bench", "format_zoo_table"]

DEFAULT_BATCH_SIZES = (8, 16, 32)
LEARNING_RATE = 1e-3      # small: the timed steps train the weights they measure
# agreement with the loop: max |got - loop| <= RELATIVE_TOLERANCE * max |loop|
RELATIVE_TOLERANCE = 1e-3
ROWS = ("batch gradient", "plain step", "gradients", "norms", "dp step", "loop")


@dataclasses.dataclass
class ZooRow:
    """One network at one B.

    Attributes:
      network, batch_size, parameters: the zoo name, B, P.
      counts: weights per method of the plan ({"rules": n, "towers": n, ...}).
      build_tf_gradients_s: seconds to build tf.gradients of sum(loss) w.r.t. the weights.
      build_pertower_s: seconds to build pertower.per_example_gradients of the same.
      ms: row name (ROWS) -> median milliseconds of one pass (the loop: B sess.run).
      runs_ms: row name -> every timed pass.
      max_relative_diff: max |per-example gradients - the loop's| / max |loop's|.
      error: why the network was not measured ("" when it was).
    """

    network: str
    batch_size: int
    parameters: int = 0
    counts: dict = None
    build_tf_gradients_s: float = None
    build_pertower_s: float = None
    ms: dict = dataclasses.field(default_factory=dict)
    runs_ms: dict = dataclasses.field(default_factory=dict)
    max_relative_diff: float = None
    error: str = ""

    @property
    def build_ratio(self):
        """pertower's build time / tf.gradients' build time."""
        if self.build_pertower_s is None or not self.build_tf_gradients_s:
            return None
        return self.build_pertower_s / self.build_tf_gradients_s

    @property
    def agrees(self):
        return (None if self.max_relative_diff is None
                else self.max_relative_diff <= RELATIVE_TOLERANCE)

    def ratio(self, row, base):
        """ms[row] / ms[base], or None."""
        if self.ms.get(row) is None or not self.ms.get(base):
            return None
        return self.ms[row] / self.ms[base]


def _timed(build):
    start = time.perf_counter()
    value = build()
    return value, time.perf_counter() - start


def _pertower_rows(network, batch_size, seed):
    """{row: fetch} of pertower's rows (gradients, norms, dp step), and the build
    seconds of the gradients."""
    loss, _, _, weights = network
    grads, seconds = _timed(lambda: pertower.per_example_gradients(
        loss, weights, batch_size=batch_size))
    dp = pertower.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer(LEARNING_RATE),
                              l2_norm_clip=1.0, noise_multiplier=1.0, seed=seed)
    rows = {"gradients": grads,
            "norms": pertower.per_example_norms(loss, weights, batch_size=batch_size),
            "dp step": dp.minimize(loss, var_list=weights, batch_size=batch_size)}
    return rows, seconds


def _max_relative_diff(got, want):
    scale = max(float(np.max(np.abs(w))) for w in want)
    worst = max(float(np.max(np.abs(g - w))) for g, w in zip(got, want))
    return worst / scale if scale > 0 else worst


def _bench_network(name, batch_sizes, repeats, loop_repeats, report):
    rows_out = []
    with tf.Graph().as_default() as graph, tf.compat.v1.Session(graph=graph) as sess:
        tf.compat.v1.set_random_seed(0)
        network = zoo.build(name)
        loss, _, make_feed, weights = network
        plan = pertower.explain(loss, weights)
        counts = plan_summary.method_counts(plan)
        fixed_b = bool(counts["towers"] + counts["passes"])
        batch_grads, tf_seconds = _timed(lambda: [
            tf.convert_to_tensor(g) for g in tf.gradients(tf.reduce_sum(loss), weights)
            if g is not None])
        plain = tf.compat.v1.train.GradientDescentOptimizer(LEARNING_RATE).minimize(
            tf.reduce_mean(loss), var_list=weights)
        shared, pertower_seconds = (None, None) if fixed_b else _pertower_rows(network,
                                                                                None, 0)
        loop = oracle.SliceLoop(loss, weights)
        for B in batch_sizes:
            pertower_rows = shared
            if fixed_b:
                pertower_rows, seconds = _pertower_rows(network, B, B)
                pertower_seconds = pertower_seconds or seconds
            row = ZooRow(name, B, network.num_weights, counts, tf_seconds, pertower_seconds)
            sess.run(tf.compat.v1.global_variables_initializer())
            feed = make_feed(B, np.random.default_rng(B))
            got = sess.run(pertower_rows["gradients"], feed)
            row.max_relative_diff = _max_relative_diff(got, loop.run(sess, feed, B))
            del got
            fetches = {"batch gradient": batch_grads, "plain step": plain, **pertower_rows}
            runs = [(lambda f=f: sess.run(f, feed), repeats) for f in fetches.values()]
            runs.append((lambda: loop.run(sess, feed, B), loop_repeats))
            for fetch in fetches.values():
                sess.run(fetch, feed)                                   # warm-up
            for row_name, seconds in zip(list(fetches) + ["loop"], timing.round_robin(runs)):
                row.runs_ms[row_name] = [1e3 * s for s in seconds]
                row.ms[row_name] = statistics.median(row.runs_ms[row_name])
            report(f"  {name} B={B}: {plan_summary.counts_cell(counts)} rules/towers/"
                   f"passes; build {pertower_seconds:.2f} s vs tf.gradients "
                   f"{tf_seconds:.2f} s; gradients {row.ms['gradients']:.1f} ms = "
                   f"{row.ratio('gradients', 'batch gradient'):.2f}x batch, "
                   f"{row.ratio('gradients', 'loop'):.2f}x loop; max rel diff "
                   f"{row.max_relative_diff:.1e}")
            rows_out.append(row)
    return rows_out


def run_zoo_bench(networks, batch_sizes=DEFAULT_BATCH_SIZES, repeats=5, loop_repeats=3,
                  report=print):
    """Measures each zoo network at each B; returns a list of `ZooRow`.

    Args:
      networks: names from `pertower.tools.zoo.ZOO`.
      batch_sizes: the B to measure each network at.
      repeats: timed passes of each row after a warm-up (the loop: loop_repeats).
      loop_repeats: timed passes of the one-example loop (B sess.run each).
      report: called with each line of progress.
    """
    rows = []
    for name in networks:
        report(f"{name}: building ...")
        start = time.perf_counter()
        try:
            rows += _bench_network(name, batch_sizes, repeats, loop_repeats, report)
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
              "build x", "batch ms", "step ms", "grads ms", "x batch", "x loop",
              "norms ms", "dp ms", "dp x step", "loop ms", "max rel diff")
    table = []
    for r in rows:
        if r.error:
            table.append((r.network, str(r.batch_size), f"error: {r.error}"))
            continue
        table.append((
            r.network, str(r.batch_size), f"{r.parameters / 1e6:.2f}M",
            plan_summary.counts_cell(r.counts), cell(r.build_tf_gradients_s, ".2f"),
            cell(r.build_pertower_s, ".2f"), cell(r.build_ratio, ".1f"),
            cell(r.ms.get("batch gradient"), ".1f"), cell(r.ms.get("plain step"), ".1f"),
            cell(r.ms.get("gradients"), ".1f"),
            cell(r.ratio("gradients", "batch gradient"), ".2f"),
            cell(r.ratio("gradients", "loop"), ".2f"), cell(r.ms.get("norms"), ".1f"),
            cell(r.ms.get("dp step"), ".1f"), cell(r.ratio("dp step", "plain step"), ".2f"),
            cell(r.ms.get("loop"), ".1f"),
            cell(r.max_relative_diff, ".1e") + ("" if r.agrees in (None, True)
                                                else " WRONG")))
    return timing.format_table(header, table)


def to_json(rows):
    """The rows as JSON-ready dicts (with the build ratio)."""
    return [dict(dataclasses.asdict(r), build_ratio=r.build_ratio) for r in rows]

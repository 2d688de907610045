"""`python -m benchmarks`: its options, and what it runs.

    python -m benchmarks [--onednn both|off|on|as-is] [--pertower PATH ...] [--rounds N]
                         [--full] [--dp] [--dp-fit] [--models M ...] [--batch-sizes B ...]
                         [--methods M ...] [--repeats R] [--loop-repeats R] [--json FILE|-]
                         [--plot FILE.png] [--env NAME=VALUE ...] [--peers]

By default the command measures nothing itself: `benchmarks.sides` runs it again with
`--onednn as-is` in one worker process per oneDNN setting (and per `--pertower`
checkout), in `--rounds` interleaved rounds, and prints every row side by side. With
`--onednn as-is` it measures in this process, on the setting TensorFlow finds
(`run`).

Importing this module imports neither TensorFlow nor numpy: `run` imports the measuring
modules of this package (`runner`, `machine`, `report`, `dp`) when it runs, after
`pertower.tools.environment` has set TF_CPP_MIN_LOG_LEVEL=2 and TF_USE_LEGACY_KERAS=1
where the user set nothing, so `--help` takes a fraction of a second and prints no
TensorFlow log lines.
"""

import argparse
import json
import os
import re
import sys

from pertower.tools import arguments
from pertower.tools import environment
from benchmarks import models as tool_models
from benchmarks import zoo
from benchmarks import peers as tool_peers
from benchmarks import records
from benchmarks import sides

__all__ = ["DESCRIPTION", "BENCH_MODELS", "PEER_MODELS", "add_arguments",
           "build_parser", "main", "run"]

DEFAULT_BENCH_REPEATS = 5
# The bench's models (benchmarks.models imports TensorFlow only when building).
BENCH_MODELS = tool_models.MODEL_NAMES
# With --peers (benchmarks.peers imports neither TensorFlow nor the peers here).
PEER_MODELS = tuple(dict.fromkeys(BENCH_MODELS + tool_peers.PEER_MODELS))
DESCRIPTION = ("Times, side by side and on both oneDNN settings (one worker process "
               "each), every pertower method "
               "(per_example_gradients and per_example_norms), the one-example "
               "sess.run loop, tf.vectorized_map with tf.gradients inside, one batch "
               "gradient and (MLP) outer products written by hand, on an MLP "
               "100-256-256-1 and the scenario-3 CNN. Prints a table (median ms, "
               "ratios, build s, peak memory, max |diff| against the loop) and, with "
               "--json FILE, writes the figures as JSON (no file otherwise). Quick by "
               "default (MLP at B=32,128, CNN at B=32, "
               f"{DEFAULT_BENCH_REPEATS} repeats); --full runs both models at "
               "B=32,128,512 with more repeats. Exits with 1 if an entry fails or "
               "disagrees with the loop.")


def _assignment(text):
    """argparse type: NAME=VALUE -> (NAME, VALUE)."""
    name, equals, value = text.partition("=")
    if not equals or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise argparse.ArgumentTypeError(
            f"expected NAME=VALUE (an environment variable and its value), got {text!r}")
    return name, value


def add_arguments(parser):
    """Adds the options to `parser`; None defaults are filled by --full or quick."""
    parser.add_argument("--onednn", default="both", choices=("both", "off", "on", "as-is"),
                        help="measure every row with oneDNN off and on, each in a worker "
                             "process of its own (TF_ENABLE_ONEDNN_OPTS=0/1), side by "
                             "side (both, the default), or one setting; as-is: in this "
                             "process, on the setting TensorFlow finds")
    parser.add_argument("--pertower", action="append", default=None, metavar="PATH",
                        help="the workers import pertower from this checkout (repeatable: "
                             "one column per checkout and setting; default the pertower "
                             "this Python imports); the models stay this checkout's")
    parser.add_argument("--rounds", type=arguments.positive_int, default=1, metavar="N",
                        help="run every worker N times, interleaved; cells are medians "
                             "over the rounds (default 1)")
    parser.add_argument("--full", action="store_true",
                        help="both models at B=32,128,512, more repeats (several minutes)")
    parser.add_argument("--dp", action="store_true",
                        help="also time a DP-SGD step (DPOptimizer, C=1, sigma=1) against a "
                             "plain SGD step on each model (on with --full)")
    parser.add_argument("--dp-workers", action="store_true",
                        help="with --dp or --dp-only: also a DPSyncReplicasOptimizer step on "
                             "two workers and a parameter server (processes on this "
                             "machine) against two plain SyncReplicasOptimizer workers")
    parser.add_argument("--dp-ftrl", action="store_true", help="with --dp or --dp-only: "
                        "also a DP-FTRL step (DPFTRLOptimizer, C=1, sigma=1) per model")
    parser.add_argument("--dp-only", action="store_true",
                        help="only the DP rows of --dp (mlp B=128, cnn B=32, cifar B=64 "
                             "unless --models / --batch-sizes say otherwise), with the "
                             "row of PyTorch's normal_ on the same P in the peers' Python. "
                             "Both draws are timed as their marginal cost: 10 draws in one "
                             "sess.run (10 normal_ calls in one timed block), divided by "
                             "10; the fixed cost of a sess.run is its own row")
    parser.add_argument("--dp-fit", action="store_true",
                        help="only an epoch of tf_keras' model.fit in graph mode with "
                             "pertower.keras.DPKerasSGDOptimizer (C=1, sigma=1, and sigma=0) "
                             "against the same epoch with plain SGD, and one "
                             "train_on_batch of each, on the cifar net (B=64, 8 batches "
                             "an epoch, unless --batch-sizes says otherwise)")
    parser.add_argument("--models", nargs="+", type=_model_names, action=_Flatten, default=None,
                        metavar="MODEL[,MODEL...]",
                        help=f"models to run, from {', '.join(BENCH_MODELS)} (with --peers: "
                             f"{', '.join(PEER_MODELS)}), or networks of the zoo: "
                             f"{', '.join(zoo.ZOO)}, or 'all' of them (per-example gradients, "
                             "norms and a DP "
                             "step against the batch gradient, a plain step and the loop, "
                             "build time against tf.gradients; B=8,16,32 by default)")
    parser.add_argument("--batch-sizes", nargs="+", type=arguments.positive_int, default=None,
                        metavar="B", help="batch sizes for every model selected")
    parser.add_argument("--methods", nargs="+", default=None, metavar="METHOD",
                        help="pertower methods to run (default: every method)")
    parser.add_argument("--repeats", type=arguments.positive_int, default=None, metavar="R",
                        help="timed sess.run per entry after a warm-up; the median is shown")
    parser.add_argument("--loop-repeats", type=arguments.positive_int, default=None, metavar="R",
                        help="timed passes of the one-example loop (B sess.run each)")
    parser.add_argument("--json", default=None, metavar="FILE",
                        help="also write the figures as JSON to FILE (default: none is "
                             "written); '-' writes JSON to stdout and the table to stderr")
    parser.add_argument("--plot", default=None, metavar="FILE.png",
                        help="also draw the figures with matplotlib into this PNG")
    parser.add_argument("--env", action="append", type=_assignment, default=None,
                        metavar="NAME=VALUE",
                        help="start the workers with this environment variable "
                             "(repeatable). Allocator settings are read at process start, "
                             "e.g. --env MALLOC_MMAP_THRESHOLD_=4294967296 "
                             "--env MALLOC_TRIM_THRESHOLD_=4294967296 --env MALLOC_ARENA_MAX=1 "
                             "(oneDNN: --onednn)")
    parser.add_argument("--peers", action="store_true",
                        help="also run the same models in PyTorch (torch.func vmap(grad), "
                             "Opacus hooks and ghost clipping) and JAX (jit(vmap(grad)), a "
                             "DP-SGD step), each in its own child process, with the "
                             "TensorFlow model's weights, checked against the loop; and "
                             "DP-SGD steps of plain TensorFlow and pertower.DPOptimizer. "
                             "Frameworks not installed show as n/a (pip install "
                             "-r benchmarks/requirements-peers.txt)")
    parser.add_argument("--curvature", action="store_true",
                        help="instead of the gradient table: pertower's diag_ggn and "
                             "kfac_factors (exact and one sample) on the mlp and cifar "
                             "models, side by side with BackPACK's DiagGGNExact, DiagGGNMC, "
                             "KFLR and KFAC in a child process, checked against each other")
    parser.add_argument("--peers-python", default=None, metavar="PYTHON",
                        help="the Python of the peers' children (default "
                             "$PERTOWER_PEERS_PYTHON, else this one): torch and BackPACK "
                             "in an environment of their own")
    parser.set_defaults(run=run)


def _model_names(text):
    """--models: 'a,b' -> ['a', 'b'], each a bench model or a zoo network."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    names = [n for name in names for n in (zoo.ZOO if name == "all" else [name])]
    unknown = [name for name in names if name not in PEER_MODELS + zoo.ZOO]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"{', '.join(unknown)}: unknown; choose from {', '.join(PEER_MODELS + zoo.ZOO)}")
    return names


class _Flatten(argparse.Action):
    """Stores the lists of names `_model_names` returns as one list."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, [name for names in values for name in names])


def build_parser(prog="python -m benchmarks"):
    """The options as a parser (`python -m benchmarks`)."""
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    add_arguments(parser)
    return parser


def main(argv=None):
    """`python -m benchmarks ...`; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    return run(args)


def run(args):
    """`python -m benchmarks` with parsed `args`: measures (in workers, side by side,
    unless --onednn as-is), prints the table, writes JSON (and a plot); returns the exit
    code."""
    if args.onednn != "as-is":
        return _run_sides(args)
    if args.env or args.pertower or args.rounds != 1:
        print("python -m benchmarks: --env, --pertower and --rounds start worker "
              "processes; drop --onednn as-is.", file=sys.stderr)
        return 2
    if args.models and any(name in zoo.ZOO for name in args.models):
        return _run_zoo(args)
    tf = environment.graph_mode_tensorflow()
    # the measuring modules import TensorFlow: only now, after the environment is set
    # pylint: disable=import-outside-toplevel
    from pertower._api import gradients
    from benchmarks import machine as machine_lib
    from benchmarks import report as report_lib, runner
    # pylint: enable=import-outside-toplevel

    if args.peers_python:   # the torch children's Python (benchmarks.peers)
        os.environ[tool_peers.PYTHON_VARIABLE] = args.peers_python
    if args.curvature:
        return _run_curvature(args)
    methods = args.methods or list(gradients.METHODS)
    unknown = [m for m in methods if m not in gradients.METHODS]
    if unknown:
        print(f"python -m benchmarks: --methods {' '.join(unknown)}: unknown; choose from "
              f"{', '.join(gradients.METHODS)}.", file=sys.stderr)
        return 2
    preset = runner.FULL if args.full else runner.QUICK
    models = args.models or preset["models"]
    peers_only = [m for m in models if m not in runner.MODELS]
    if peers_only and not args.peers:
        print(f"python -m benchmarks: --models {' '.join(peers_only)}: runs only with --peers.",
              file=sys.stderr)
        return 2
    if not isinstance(args.batch_sizes, list) and any(m not in preset["batch_sizes"]
                                                      for m in models):
        preset = dict(preset, batch_sizes={m: preset["batch_sizes"].get(m, (32,))
                                           for m in models})
    batch_sizes = args.batch_sizes or preset["batch_sizes"]
    repeats = args.repeats or preset["repeats"]
    loop_repeats = args.loop_repeats or preset["loop_repeats"]
    out = sys.stderr if args.json == "-" else sys.stdout

    def report(line):
        print(line, file=out, flush=True)

    machine = machine_lib.machine_info()
    settings = {"mode": "full" if args.full else "quick", "models": list(models),
                "batch_sizes": batch_sizes if isinstance(batch_sizes, dict)
                else {m: list(batch_sizes) for m in models},
                "methods": list(methods), "repeats": repeats, "loop_repeats": loop_repeats}
    peer_info = {}
    if args.peers:
        settings["peers"] = {"rounds": tool_peers.ROUNDS[settings["mode"]],
                             "frameworks": peer_info}
    report(f"python -m benchmarks ({settings['mode']}): TensorFlow {tf.__version__}, "
           f"{machine['cpu_count']} CPUs ({machine['cpu_model']}), load "
           f"{machine['load_average_1_5_15']}, {machine['date_utc']}")
    report(f"CPU: {environment.describe_cpu_facts(machine['cpu_speed'])}")
    report(f"median of {repeats} sess.run per entry ({loop_repeats} passes of the loop) "
           "after a warm-up, round-robin\n")
    if args.dp_fit:
        from benchmarks import dp_fit  # pylint: disable=import-outside-toplevel
        with environment.quiet_native_logs():
            rows = dp_fit.measured_rows(args.models, args.batch_sizes, repeats, report)
        _write_figures({"machine": machine, "dp_fit": rows}, args.json, report)
        return 0
    if args.dp_only:
        figures = {"machine": machine, "dp_steps": _run_dp_rows(args, repeats, report)}
        _write_figures(figures, args.json, report)
        return 0
    with environment.quiet_native_logs():   # sessions probe CUDA; traces log profiling
        entries = runner.run_bench(models=models, batch_sizes=batch_sizes, methods=methods,
                                   repeats=repeats, loop_repeats=loop_repeats, report=report,
                                   peers=args.peers, peer_info=peer_info,
                                   peer_rounds=tool_peers.ROUNDS[settings["mode"]])
    report("")
    report(report_lib.format_table(entries))
    if args.peers:
        report(f"\npeers: {tool_peers.describe(peer_info)}")
        report(report_lib.PEERS_FOOTNOTE)
    report("\nms: median per pass (loop: B sess.run); x loop / x batch / x outer: ms "
           "divided by the loop's / batch gradient's / hand outer products' ms.")
    report("max|diff|: against the loop's per-example gradients (norms: their norms; "
           "batch gradient: their sum).")
    report(report_lib.MEMORY_FOOTNOTE)
    figures = report_lib.to_json(entries, machine, settings)
    if args.dp or args.full:
        figures["dp_steps"] = _run_dp_rows(args, repeats, report)
    _write_figures(figures, args.json, report)
    if args.plot:
        try:
            report_lib.plot(entries, args.plot)
        except RuntimeError as error:
            print(f"python -m benchmarks: {error}", file=sys.stderr)
            return 1
        report(f"plot written to {args.plot}")
    failed = [f"{e.model} B={e.batch_size} {e.name}" for e in entries
              if e.status == "error" or e.agrees is False]
    if failed:
        report(f"\nFAILED: {'; '.join(failed)}: error, or result beyond the tolerance "
               f"({records.TOLERANCE:g} x max(1, |loop|)) from the loop's.")
        return 1
    return 0


def _run_dp_rows(args, repeats, report):
    """The DP rows (`dp.run_dp_bench`), printed; returns them for the JSON."""
    from benchmarks import dp  # pylint: disable=import-outside-toplevel

    report("")
    with environment.quiet_native_logs():
        dp_entries = dp.run_dp_bench(models=args.models, batch_sizes=args.batch_sizes,
                                     repeats=repeats, report=report,
                                     ftrl=args.dp_ftrl,
                                     noise_python=os.environ.get(
                                         tool_peers.PYTHON_VARIABLE) or sys.executable)
        if args.dp_workers:
            # pylint: disable-next=import-outside-toplevel
            from benchmarks import dp_workers
            names = [m for m in args.models or dp.DP_BATCH_SIZES if m in dp.DP_BATCH_SIZES]
            sizes = {m: (args.batch_sizes or dp.DP_BATCH_SIZES[m])[0] for m in names}
            dp_entries += dp_workers.run_worker_bench(names, sizes, report=report,
                                                      rounds=dp_workers.ROUNDS)
    report("")
    report(dp.format_dp_table(dp_entries))
    report("ms: median per training step (one sess.run of the training op), round-robin; "
           "x plain: divided by the plain SGD step's ms in the same run; faults: the "
           "process's median minor page faults per run (memory mapped again); cpu ms: the "
           "process's median CPU ms per run, all threads (\"dp − plain − noise, CPU\": "
           "its x plain is of the plain step's CPU ms).")
    return [{"model": e.model, "batch_size": e.batch_size, "step": e.name,
             "median_ms": e.median_ms, "x_plain": ratio, "runs_ms": e.runs_ms,
             "median_faults": e.median_faults, "median_cpu_ms": e.median_cpu_ms,
             "cpu_ms": e.cpu_ms}
            for e, ratio in zip(dp_entries, dp.plain_ratios(dp_entries))]


def _run_curvature(args):
    """`--curvature` (`peers_curvature.run_command`): its table and JSON; the exit code."""
    from benchmarks import peers_curvature  # pylint: disable=import-outside-toplevel
    out = sys.stderr if args.json == "-" else sys.stdout

    def report(line):
        print(line, file=out, flush=True)

    import pertower  # pylint: disable=import-outside-toplevel
    with environment.quiet_native_logs():
        figures, code = peers_curvature.run_command(args, report)
    figures["machine"] = {"pertower_folder": os.path.dirname(os.path.abspath(pertower.__file__))}
    _write_figures(figures, args.json, report)
    return code


def _run_zoo(args):
    """`bench --models` with zoo networks (`benchmarks.zoo_bench`): prints
    progress and the table, writes the rows as JSON; returns the exit code."""
    others = [name for name in args.models if name not in zoo.ZOO]
    if others:
        print(f"python -m benchmarks: --models {' '.join(others)}: run them apart from the zoo "
              "networks (a separate command).", file=sys.stderr)
        return 2
    tf = environment.graph_mode_tensorflow()
    tf.get_logger().setLevel("ERROR")     # the v1 idioms' deprecation lines
    # pylint: disable=import-outside-toplevel
    from benchmarks import machine as machine_lib, zoo_bench
    # pylint: enable=import-outside-toplevel
    out = sys.stderr if args.json == "-" else sys.stdout

    def report(line):
        print(line, file=out, flush=True)

    batch_sizes = args.batch_sizes or zoo_bench.DEFAULT_BATCH_SIZES
    repeats, loop_repeats = args.repeats or DEFAULT_BENCH_REPEATS, args.loop_repeats or 3
    machine = machine_lib.machine_info()
    report(f"python -m benchmarks (zoo): TensorFlow {tf.__version__}, {machine['cpu_count']} CPUs "
           f"({machine['cpu_model']}), load {machine['load_average_1_5_15']}, "
           f"{machine['date_utc']}")
    report(f"CPU: {environment.describe_cpu_facts(machine['cpu_speed'])}")
    report(f"median of {repeats} sess.run per row ({loop_repeats} passes of the loop) after "
           "a warm-up, round-robin\n")
    with environment.quiet_native_logs():
        rows = zoo_bench.run_zoo_bench(args.models, batch_sizes, repeats, loop_repeats,
                                       report)
    report("")
    report(zoo_bench.format_zoo_table(rows))
    report("\nrules/towers/passes: weights per method of pertower.explain. ms: median "
           "per pass (loop: B sess.run); x batch / x loop: per-example gradients' ms over "
           "the batch gradient's / the loop's; dp x step: the DP-SGD step (DPOptimizer, "
           "C=1, sigma=1) over the plain SGD step. max rel diff: per-example gradients "
           "against the loop, max |diff| / max |loop| (\"fwd x\": over 1e-3 against the "
           "loop, x against TensorFlow's gradient on the batch's own forward pass).")
    figures = {"machine": machine, "settings": {
        "mode": "zoo", "models": args.models, "batch_sizes": list(batch_sizes),
        "repeats": repeats, "loop_repeats": loop_repeats, "argv": args.argv},
        "zoo": zoo_bench.to_json(rows)}
    _write_figures(figures, args.json, report)
    failed = [f"{r.network} B={r.batch_size}" for r in rows if r.error or r.agrees is False]
    if failed:
        report(f"\nFAILED: {'; '.join(failed)}: error, or beyond the tolerance of the loop.")
        return 1
    return 0


def _write_figures(figures, path, report):
    """Writes the figures as JSON to `path` ("-": standard output, after the table;
    None: nowhere)."""
    if path is None:
        report("\nno figures written (pass --json FILE to keep them)")
        return
    if path == "-":
        json.dump(figures, sys.stdout, indent=1)
        print()
    else:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(figures, handle, indent=1)
        report(f"\nfigures written to {path}")


def _run_sides(args):
    """The workers of `benchmarks.sides`, their table, and the JSON; the exit code."""
    out = sys.stderr if args.json == "-" else sys.stdout

    def report(line):
        print(line, file=out, flush=True)

    try:
        code, figures = sides.run(args, report)
    except ValueError as error:
        print(f"python -m benchmarks: {error}", file=sys.stderr)
        return 2
    _write_figures(figures, args.json, report)
    return code

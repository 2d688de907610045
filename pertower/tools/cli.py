"""The `pertower` console command.

    pertower --version
    pertower demo [--batch-size B] [--repeats R]
    pertower bench [--full] [--models M ...] [--batch-sizes B ...] [--methods M ...]
                   [--repeats R] [--loop-repeats R] [--json FILE|-] [--plot FILE.png]
                   [--env NAME=VALUE ...] [--peers]

`demo` runs the three user scenarios on built-in models and compares each with the
one-example loop of `pertower.oracle`, with timings. `bench` times every way of
computing per-example gradients side by side (see `pertower.tools.bench`).

This module imports neither TensorFlow nor `pertower.tools.bench` / `demo`: a command
imports them when it runs, after setting TF_CPP_MIN_LOG_LEVEL=2 and
TF_USE_LEGACY_KERAS=1 where the user set nothing (`pertower.tools.environment`), so
parsing arguments and `--help` take a fraction of a second and print no TensorFlow
log lines.
"""

import argparse
import json
import os
import subprocess
import sys

from pertower._version import __version__
from pertower.tools import environment
from pertower.tools import models as tool_models
from pertower.tools import peers as tool_peers

__all__ = ["build_parser", "main"]

DEFAULT_BATCH_SIZE = 32
DEFAULT_REPEATS = 5
DEFAULT_BENCH_REPEATS = 5
DEFAULT_BENCH_JSON = "bench.json"
# The bench's models (pertower.tools.models imports TensorFlow only when building).
BENCH_MODELS = tool_models.MODEL_NAMES
# With --peers (pertower.tools.peers imports neither TensorFlow nor the peers here).
PEER_MODELS = tuple(dict.fromkeys(BENCH_MODELS + tool_peers.PEER_MODELS))
# Set in the child process `bench --env` starts, so it measures instead of starting another.
_CHILD_MARK = "PERTOWER_BENCH_CHILD"


def build_parser():
    """The argument parser: one subparser per command (`demo`, `bench`)."""
    parser = argparse.ArgumentParser(
        prog="pertower",
        description="Per-example gradients for TensorFlow graph mode, with weight-copy "
                    "towers.")
    parser.add_argument("--version", action="version", version=f"pertower {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    demo = commands.add_parser(
        "demo", help="run the three user scenarios against the one-example loop",
        description="Runs the three scenarios on built-in models (per-example loss "
                    "gradients of a Keras MLP, the gradients of two batches and their "
                    "cosine, per-example Jacobians of a small CNN): checks "
                    "pertower against the one-example loop of pertower.oracle and times "
                    "both. Exits with 1 if any scenario disagrees.")
    demo.add_argument("--batch-size", type=_positive_int, default=DEFAULT_BATCH_SIZE,
                      metavar="B", help=f"examples per scenario (default {DEFAULT_BATCH_SIZE})")
    demo.add_argument("--repeats", type=_positive_int, default=DEFAULT_REPEATS,
                      metavar="R", help="timed runs after a warm-up; the median is shown "
                                        f"(default {DEFAULT_REPEATS})")
    demo.set_defaults(run=_run_demo)
    _add_bench_parser(commands)
    return parser


def _add_bench_parser(commands):
    """The `bench` subcommand's options; None defaults are filled by --full or quick."""
    bench = commands.add_parser(
        "bench", help="time every per-example gradient method side by side",
        description="Times, in one process and side by side, every pertower method "
                    "(per_example_gradients and per_example_norms), the one-example "
                    "sess.run loop, tf.vectorized_map with tf.gradients inside, one batch "
                    "gradient and (MLP) outer products written by hand, on an MLP "
                    "100-256-256-1 and the scenario-3 CNN. Prints a table (median ms, "
                    "ratios, build s, peak memory, max |diff| against the loop) and writes "
                    "the figures as JSON. Quick by default (MLP at B=32,128, CNN at B=32, "
                    f"{DEFAULT_BENCH_REPEATS} repeats); --full runs both models at "
                    "B=32,128,512 with more repeats. Exits with 1 if an entry fails or "
                    "disagrees with the loop.")
    bench.add_argument("--full", action="store_true",
                       help="both models at B=32,128,512, more repeats (several minutes)")
    bench.add_argument("--dp", action="store_true",
                       help="also time a DP-SGD step (DPOptimizer, C=1, sigma=1) against a "
                            "plain SGD step on each model (on with --full)")
    bench.add_argument("--models", nargs="+", choices=PEER_MODELS, default=None,
                       metavar="MODEL", help=f"models to run, from {', '.join(BENCH_MODELS)} "
                                             f"(with --peers: {', '.join(PEER_MODELS)})")
    bench.add_argument("--batch-sizes", nargs="+", type=_positive_int, default=None,
                       metavar="B", help="batch sizes for every model selected")
    bench.add_argument("--methods", nargs="+", default=None, metavar="METHOD",
                       help="pertower methods to run (default: every method)")
    bench.add_argument("--repeats", type=_positive_int, default=None, metavar="R",
                       help="timed sess.run per entry after a warm-up; the median is shown")
    bench.add_argument("--loop-repeats", type=_positive_int, default=None, metavar="R",
                       help="timed passes of the one-example loop (B sess.run each)")
    bench.add_argument("--json", default=DEFAULT_BENCH_JSON, metavar="FILE",
                       help=f"where to write the figures (default {DEFAULT_BENCH_JSON}); "
                            "'-' writes JSON to stdout and the table to stderr")
    bench.add_argument("--plot", default=None, metavar="FILE.png",
                       help="also draw the figures with matplotlib into this PNG")
    bench.add_argument("--env", action="append", type=_assignment, default=None,
                       metavar="NAME=VALUE",
                       help="measure in a child process started with this environment "
                            "variable (repeatable). Allocator and oneDNN settings are read "
                            "at process start, e.g. --env MALLOC_MMAP_THRESHOLD_=4294967296 "
                            "--env MALLOC_TRIM_THRESHOLD_=4294967296, or "
                            "--env TF_ENABLE_ONEDNN_OPTS=0")
    bench.add_argument("--peers", action="store_true",
                       help="also run the same models in PyTorch (torch.func vmap(grad), "
                            "Opacus hooks and ghost clipping) and JAX (jit(vmap(grad)), a "
                            "DP-SGD step), each in its own child process, with the "
                            "TensorFlow model's weights, checked against the loop; and "
                            "DP-SGD steps of plain TensorFlow and pertower.DPOptimizer. "
                            "Frameworks not installed show as n/a (pip install "
                            "'pertower[peers]')")
    bench.set_defaults(run=_run_bench)


def main(argv=None):
    """Entry point of the `pertower` command; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    return args.run(args)


def _run_demo(args):
    """`pertower demo`: prints one block per scenario, then a table; 1 on disagreement."""
    tf = _graph_mode_tensorflow()
    from pertower.tools import demo  # pylint: disable=import-outside-toplevel

    print(f"pertower demo: TensorFlow {tf.__version__}, B={args.batch_size}, median of "
          f"{args.repeats} runs after a warm-up; loop = one sess.run per example "
          "(scenario 2: per batch)")
    print(f"CPU: {environment.describe_cpu_facts(environment.cpu_facts())}\n")
    with environment.quiet_native_logs():   # the first session probes CUDA
        results = demo.run_demo(batch_size=args.batch_size, repeats=args.repeats)
    print()
    print(demo.format_table(results))
    failed = [r.name for r in results if not r.agrees]
    if failed:
        print(f"\nFAILED: {', '.join(failed)} disagree(s) with the one-example loop.")
        return 1
    print("\nAll scenarios match the one-example loop.")
    return 0


def _run_bench(args):
    """`pertower bench`: measures, prints the table, writes JSON (and a plot)."""
    if args.env and os.environ.get(_CHILD_MARK) != "1":
        return _run_bench_in_child(args)
    tf = _graph_mode_tensorflow()
    from pertower.tools import bench  # pylint: disable=import-outside-toplevel
    from pertower._api import gradients  # pylint: disable=import-outside-toplevel

    methods = args.methods or list(gradients.METHODS)
    unknown = [m for m in methods if m not in gradients.METHODS]
    if unknown:
        print(f"pertower bench: --methods {' '.join(unknown)}: unknown; choose from "
              f"{', '.join(gradients.METHODS)}.", file=sys.stderr)
        return 2
    preset = bench.FULL if args.full else bench.QUICK
    models = args.models or preset["models"]
    peers_only = [m for m in models if m not in bench.MODELS]
    if peers_only and not args.peers:
        print(f"pertower bench: --models {' '.join(peers_only)}: runs only with --peers.",
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

    machine = bench.machine_info()
    settings = {"mode": "full" if args.full else "quick", "models": list(models),
                "batch_sizes": batch_sizes if isinstance(batch_sizes, dict)
                else {m: list(batch_sizes) for m in models},
                "methods": list(methods), "repeats": repeats, "loop_repeats": loop_repeats}
    peer_info = {}
    if args.peers:
        settings["peers"] = {"rounds": tool_peers.ROUNDS[settings["mode"]],
                             "frameworks": peer_info}
    report(f"pertower bench ({settings['mode']}): TensorFlow {tf.__version__}, "
           f"{machine['cpu_count']} CPUs ({machine['cpu_model']}), load "
           f"{machine['load_average_1_5_15']}, {machine['date_utc']}")
    report(f"CPU: {environment.describe_cpu_facts(machine['cpu_speed'])}")
    report(f"median of {repeats} sess.run per entry ({loop_repeats} passes of the loop) "
           "after a warm-up, round-robin\n")
    with environment.quiet_native_logs():   # sessions probe CUDA; traces log profiling
        entries = bench.run_bench(models=models, batch_sizes=batch_sizes, methods=methods,
                                  repeats=repeats, loop_repeats=loop_repeats, report=report,
                                  peers=args.peers, peer_info=peer_info,
                                  peer_rounds=tool_peers.ROUNDS[settings["mode"]])
    report("")
    report(bench.format_table(entries))
    if args.peers:
        report(f"\npeers: {tool_peers.describe(peer_info)}")
        report(bench.PEERS_FOOTNOTE)
    report("\nms: median per pass (loop: B sess.run); x loop / x batch / x outer: ms "
           "divided by the loop's / batch gradient's / hand outer products' ms.")
    report("max|diff|: against the loop's per-example gradients (norms: their norms; "
           "batch gradient: their sum).")
    report(bench.MEMORY_FOOTNOTE)
    figures = bench.to_json(entries, machine, settings)
    if args.dp or args.full:
        figures["dp_steps"] = _run_dp_rows(bench, args, repeats, report)
    if args.json == "-":
        json.dump(figures, sys.stdout, indent=1)
        print()
    else:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(figures, handle, indent=1)
        report(f"\nfigures written to {args.json}")
    if args.plot:
        try:
            bench.plot(entries, args.plot)
        except RuntimeError as error:
            print(f"pertower bench: {error}", file=sys.stderr)
            return 1
        report(f"plot written to {args.plot}")
    failed = [f"{e.model} B={e.batch_size} {e.name}" for e in entries
              if e.status == "error" or e.agrees is False]
    if failed:
        report(f"\nFAILED: {'; '.join(failed)}: error, or result beyond the tolerance "
               f"({bench.TOLERANCE:g} x max(1, |loop|)) from the loop's.")
        return 1
    return 0


def _run_dp_rows(bench, args, repeats, report):
    """The DP rows (`bench.run_dp_bench`), printed; returns them for the JSON."""
    report("")
    with environment.quiet_native_logs():
        dp_entries = bench.run_dp_bench(models=args.models, batch_sizes=args.batch_sizes,
                                        repeats=repeats, report=report)
    report("")
    report(bench.format_dp_table(dp_entries))
    report("ms: median per training step (one sess.run of the training op), round-robin; "
           "x plain: divided by the plain SGD step's ms in the same run.")
    return [{"model": e.model, "batch_size": e.batch_size, "step": e.name,
             "median_ms": e.median_ms, "runs_ms": e.runs_ms} for e in dp_entries]


def _run_bench_in_child(args):
    """`bench --env NAME=VALUE ...`: runs the same command without --env in a child
    Python started with those variables (allocators and oneDNN read them at process
    start); returns its exit code. Its output goes straight to ours."""
    child_argv, skip = [], False
    for token in args.argv:
        if skip:
            skip = False
        elif token == "--env":
            skip = True
        elif not token.startswith("--env="):
            child_argv.append(token)
    env = dict(os.environ)
    env.update(dict(args.env))
    env[_CHILD_MARK] = "1"
    settings = " ".join(f"{name}={value}" for name, value in args.env)
    print(f"pertower bench: measuring in a child process with {settings}", flush=True,
          file=sys.stderr if args.json == "-" else sys.stdout)
    command = [sys.executable, "-m", "pertower"] + child_argv
    return subprocess.run(command, env=env, check=False).returncode


def _graph_mode_tensorflow():
    """Sets the environment TensorFlow and Keras read, imports TensorFlow (its
    start-up lines, which TensorFlow 2.21 writes before absl logging is set up
    whatever TF_CPP_MIN_LOG_LEVEL says, are kept off the terminal), switches to graph
    mode; returns the `tensorflow` module."""
    environment.prepare_tensorflow()
    with environment.quiet_native_logs():
        import tensorflow as tf  # pylint: disable=import-outside-toplevel

    tf.compat.v1.disable_eager_execution()
    return tf


def _assignment(text):
    """argparse type: NAME=VALUE -> (NAME, VALUE)."""
    try:
        return environment.parse_assignment(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _positive_int(text):
    """argparse type: a positive integer."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


if __name__ == "__main__":
    sys.exit(main())

"""The `pertower` console command.

    pertower --version
    pertower demo [--batch-size B] [--repeats R]
    pertower explain MODEL.meta --ys NAME --batch NAME[,NAME...] [--xs trainable|NAME,...]
                     [--batch-size N] [--run FEEDS.npz [--checkpoint PREFIX]]

`demo` is `pertower.tools.demo`, `explain` `pertower.tools.explain_command`; the
benchmarks run from a checkout (`python -m benchmarks`). This module imports neither
TensorFlow nor the demo, so `--help` is quick: a command imports them when it runs,
after `environment.graph_mode_tensorflow` has set up the environment.
"""

import argparse
import sys

from pertower._version import __version__
from pertower.tools import arguments
from pertower.tools import environment
from pertower.tools import explain_command

__all__ = ["build_parser", "main"]

DEFAULT_BATCH_SIZE = 32
DEFAULT_REPEATS = 5


def build_parser():
    """The argument parser: one subparser per command (`demo`, `explain`)."""
    parser = argparse.ArgumentParser(
        prog="pertower",
        description="Per-example gradients for TensorFlow graph mode: per-op rules where "
                    "they are proven to apply, weight-copy towers elsewhere.")
    parser.add_argument("--version", action="version", version=f"pertower {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    demo = commands.add_parser(
        "demo", help="run the three user scenarios against the one-example loop",
        description="Runs the three scenarios on built-in models (per-example loss "
                    "gradients of a Keras MLP, the gradients of two batches and their "
                    "cosine, per-example Jacobians of a small CNN): checks "
                    "pertower against the one-example loop of pertower.oracle and times "
                    "both. Exits with 1 if any scenario disagrees.")
    demo.add_argument("--batch-size", type=arguments.positive_int, default=DEFAULT_BATCH_SIZE,
                      metavar="B", help=f"examples per scenario (default {DEFAULT_BATCH_SIZE})")
    demo.add_argument("--repeats", type=arguments.positive_int, default=DEFAULT_REPEATS,
                      metavar="R", help="timed runs after a warm-up; the median is shown "
                                        f"(default {DEFAULT_REPEATS})")
    demo.set_defaults(run=_run_demo)
    explain = commands.add_parser("explain", help=explain_command.HELP,
                                  description=explain_command.DESCRIPTION)
    explain_command.add_arguments(explain)
    return parser


def main(argv=None):
    """Entry point of the `pertower` command; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    return args.run(args)


def _run_demo(args):
    """`pertower demo`: prints one block per scenario, then a table; 1 on disagreement."""
    tf = environment.graph_mode_tensorflow()
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


if __name__ == "__main__":
    sys.exit(main())

"""The `pertower` console command.

    pertower demo [--batch-size B] [--repeats R]

`demo` runs the three scenarios of SCENARIOS.md on built-in models and compares each
with the one-example loop of `pertower.oracle`, with timings. TensorFlow is imported
only inside a command, after the environment it reads has been set up, so parsing
arguments (and `--help`) stays cheap for later subcommands.
"""

import argparse
import os
import sys

__all__ = ["build_parser", "main"]

DEFAULT_BATCH_SIZE = 32
DEFAULT_REPEATS = 5


def build_parser():
    """The argument parser: one subparser per command (only `demo` for now)."""
    parser = argparse.ArgumentParser(
        prog="pertower",
        description="Per-example gradients for TensorFlow graph mode, with weight-copy "
                    "towers.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    demo = commands.add_parser(
        "demo", help="run the three user scenarios against the one-example loop",
        description="Runs the three scenarios of SCENARIOS.md on built-in models: checks "
                    "pertower against the one-example loop of pertower.oracle and times "
                    "both. Exits with 1 if any scenario disagrees.")
    demo.add_argument("--batch-size", type=_positive_int, default=DEFAULT_BATCH_SIZE,
                      metavar="B", help=f"examples per scenario (default {DEFAULT_BATCH_SIZE})")
    demo.add_argument("--repeats", type=_positive_int, default=DEFAULT_REPEATS,
                      metavar="R", help="timed runs after a warm-up; the median is shown "
                                        f"(default {DEFAULT_REPEATS})")
    demo.set_defaults(run=_run_demo)
    return parser


def main(argv=None):
    """Entry point of the `pertower` command; returns the exit code."""
    args = build_parser().parse_args(argv)
    return args.run(args)


def _run_demo(args):
    """`pertower demo`: prints one block per scenario, then a table; 1 on disagreement."""
    tf = _graph_mode_tensorflow()
    from pertower import demo  # pylint: disable=import-outside-toplevel

    print(f"pertower demo: TensorFlow {tf.__version__}, B={args.batch_size}, median of "
          f"{args.repeats} runs after a warm-up; loop = one sess.run per example "
          "(scenario 2: per batch)\n")
    results = demo.run_demo(batch_size=args.batch_size, repeats=args.repeats)
    print()
    print(demo.format_table(results))
    failed = [r.name for r in results if not r.agrees]
    if failed:
        print(f"\nFAILED: {', '.join(failed)} disagree(s) with the one-example loop.")
        return 1
    print("\nAll scenarios match the one-example loop.")
    return 0


def _graph_mode_tensorflow():
    """Sets the environment TensorFlow and Keras read, imports TensorFlow, switches
    to graph mode; returns the `tensorflow` module.

    Note: `import pertower.cli` runs `pertower/__init__.py`, which already imports
    TensorFlow, so TF_CPP_MIN_LOG_LEVEL set here is too late for the C++ logging
    (set it in the shell to silence it). TF_USE_LEGACY_KERAS is still in time: it is
    read when `tf.keras` / `tf.compat.v1.layers` are first used.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    tf.compat.v1.disable_eager_execution()
    return tf


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

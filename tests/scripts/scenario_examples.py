"""Run in a fresh process, as a user runs them: the scenario example scripts, then
`python -m pertower demo`, one after the other in this one process.

    python tests/scripts/scenario_examples.py OUTPUTS.json

Run by tests/test_examples_and_demo.py in a fresh interpreter (`tests.common.run_python`)
with TF_USE_LEGACY_KERAS removed from the environment: each script and the demo must
set up its environment itself. Nothing here imports TensorFlow; before each one,
TF_USE_LEGACY_KERAS is removed again and the default graph replaced, and each check
asserts that its script set TF_USE_LEGACY_KERAS=1 and left graph mode on (the order
in each script, the variable before TensorFlow, is checked on its text by the tests).
Each check returns the script's output, written to OUTPUTS.json ({name: output}; the
tests assert its lines); exits 1 if one failed.
"""

import contextlib
import io
import json
import os
import runpy
import sys
import traceback

from tests import scripts

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# each script with its arguments: scenario3 at B = 2 (its one-example loop runs 4 B
# backward passes of a CNN whose two Jacobians hold B x 8.4M numbers)
EXAMPLES = {"scenario1_keras_mlp.py": [], "scenario2_two_batches_cosine.py": [],
            "scenario3_cnn_jacobian.py": ["--batch-size", "2"]}
# `pertower demo` at the smallest batch that gives scenario 2 two batches, one timed run:
# the same three scenarios as the examples, checked against the loop once more by the
# demo's own code.
DEMO_ARGV = ["pertower", "demo", "--batch-size", "2", "--repeats", "1"]


def _run_as_main(run):
    """Runs `run()` as a fresh command would; returns its stdout.

    Raises:
      AssertionError: it raised or exited non-zero (with its output and traceback), or
        it did not set TF_USE_LEGACY_KERAS=1 or left eager execution on.
    """
    os.environ.pop("TF_USE_LEGACY_KERAS", None)
    if "tensorflow" in sys.modules:
        sys.modules["tensorflow"].compat.v1.reset_default_graph()
    buffer = io.StringIO()
    code, problem = 0, ""
    with contextlib.redirect_stdout(buffer):
        try:
            run()
        except SystemExit as exit_:
            code = exit_.code or 0
        except Exception:  # pylint: disable=broad-except  # reported with the output
            code, problem = 1, traceback.format_exc()
    out = buffer.getvalue()
    if code != 0:
        raise AssertionError(f"exit code {code}\n--- stdout\n{out}\n{problem}")
    if os.environ.get("TF_USE_LEGACY_KERAS") != "1":
        raise AssertionError(f"TF_USE_LEGACY_KERAS was not set to 1\n--- stdout\n{out}")
    if sys.modules["tensorflow"].executing_eagerly():
        raise AssertionError(f"eager execution left on\n--- stdout\n{out}")
    return out


def _example_check(script, arguments):
    def check():
        path = os.path.join(ROOT, "examples", script)
        saved = list(sys.argv)
        sys.argv = [path, *arguments]
        try:
            return _run_as_main(lambda: runpy.run_path(path, run_name="__main__"))
        finally:
            sys.argv = saved
    check.__name__ = script
    return check


def demo():
    """`python -m pertower demo ...`: pertower/__main__.py run as the main module."""
    saved = list(sys.argv)
    sys.argv = list(DEMO_ARGV)
    try:
        return _run_as_main(
            lambda: runpy.run_module("pertower", run_name="__main__", alter_sys=True))
    finally:
        sys.argv = saved


CHECKS = [_example_check(script, arguments) for script, arguments in EXAMPLES.items()] + [demo]


def main(path):
    outputs = {}

    def recorded(check):
        def run():
            outputs[check.__name__] = check()
        run.__name__ = check.__name__
        return run

    code = scripts.run_each([recorded(check) for check in CHECKS])
    with open(path, "w", encoding="utf-8") as f:
        json.dump(outputs, f)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

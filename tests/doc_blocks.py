"""The ```python blocks of README.md and docs/*.md, and how one runs as pasted.

Read by tests/test_docs.py (the checks on the blocks' text) and by
tests/scripts/scenario_examples.py (the fresh process that runs them: see
tests/test_docs.py for the scheme). Imports no TensorFlow.

Convention: a block that is not meant to run (it needs hardware or servers the tests do
not have) is marked by the HTML comment `<!-- fragment: why -->` on the line just
before its opening fence; it is still compiled.
"""

import contextlib
import io
import os
import pathlib
import re
import sys
import tempfile
import traceback

__all__ = ["ROOT", "DOCUMENTS", "ALL_BLOCKS", "RUNNABLE", "FRESH_PROCESS_CHECK",
           "FRESH_PROCESS", "check_name", "run_block"]

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
FRAGMENT = re.compile(r"^\s*<!--\s*fragment\b.*-->\s*$")
OPENING = re.compile(r"^(\s*)```\s*python\s*$")


def _blocks(path):
    """(line of the first code line, code, is_fragment) per ```python block of `path`."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found, k = [], 0
    while k < len(lines):
        opening = OPENING.match(lines[k])
        if not opening:
            k += 1
            continue
        indent = len(opening.group(1))
        fragment = k > 0 and bool(FRAGMENT.match(lines[k - 1]))
        end = k + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        assert end < len(lines), f"{path.name}:{k + 1}: unclosed ```python block"
        code = "\n".join(line[indent:] for line in lines[k + 1:end]) + "\n"
        found.append((k + 2, code, fragment))
        k = end + 1
    return found


# (path relative to ROOT, line, code, is_fragment) of every block; (path, line, code) of
# the blocks that run
ALL_BLOCKS = [(path.relative_to(ROOT).as_posix(), line, code, fragment)
              for path in DOCUMENTS for line, code, fragment in _blocks(path)]
RUNNABLE = [(path, line, code) for path, line, code, fragment in ALL_BLOCKS if not fragment]


def check_name(path, line):
    """The name of the block's check in the process that runs it: "README.md:46"."""
    return f"{path}:{line}"


# Run first in the blocks' process (a fresh interpreter: no TensorFlow imported yet).
# TF_CPP_MIN_LOG_LEVEL is removed while pertower loads, so that setting it counts as a
# change; jax, which TensorFlow imports where it is installed, sets variables of its own
# (not pertower's doing), so it is kept out while pertower loads.
FRESH_PROCESS_CHECK = """\
import os, sys
os.environ["TF_USE_LEGACY_KERAS"] = "1"
log_level = os.environ.pop("TF_CPP_MIN_LOG_LEVEL", None)
sys.modules.setdefault("jax", None)
before = dict(os.environ)
import pertower
assert "tensorflow" not in sys.modules
assert set(pertower.__all__) <= set(dir(pertower))
gradients = pertower.per_example_gradients
from pertower._api.gradients import per_example_gradients
assert gradients is per_example_gradients
assert "tensorflow" in sys.modules
namespace = {}
exec("from pertower import *", namespace)
missing = set(pertower.__all__) - set(namespace)
assert not missing, missing
assert pertower.oracle.SliceLoop is not None
try:
    pertower.no_such_name
except AttributeError as error:
    assert "no_such_name" in str(error)
else:
    raise AssertionError("no AttributeError")
assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items())
if sys.modules.get("jax", 0) is None:
    del sys.modules["jax"]
if log_level is not None:
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = log_level
"""
FRESH_PROCESS = "tests/test_docs.py-FRESH_PROCESS_CHECK:1"


def run_block(path, line, code):
    """Runs one block as pasted: in a fresh namespace named "__main__", on a fresh
    default graph (once TensorFlow is imported), in an empty working directory of its
    own, compiled with `path` as its file name and padded so that a traceback shows the
    line in the document. Returns the block's stdout.

    Raises:
      AssertionError: the block raised or exited non-zero, with its traceback and output.
    """
    tf = sys.modules.get("tensorflow")
    if tf is not None:
        tf.compat.v1.reset_default_graph()
    os.environ.setdefault("MPLBACKEND", "Agg")
    compiled = compile("\n" * (line - 1) + code, path, "exec")
    buffer, problem, here = io.StringIO(), "", os.getcwd()
    with tempfile.TemporaryDirectory(prefix="pertower-doc-block-") as folder:
        os.chdir(folder)
        try:
            with contextlib.redirect_stdout(buffer):
                exec(compiled, {"__name__": "__main__"})  # pylint: disable=exec-used
        except BaseException:  # pylint: disable=broad-except  # SystemExit too: reported
            problem = traceback.format_exc()
        finally:
            os.chdir(here)
    if problem:
        raise AssertionError(f"the python block at {check_name(path, line)} failed:\n"
                             f"{problem}--- stdout\n{buffer.getvalue()}")
    return buffer.getvalue()

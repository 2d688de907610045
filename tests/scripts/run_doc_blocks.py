"""Runs Python blocks taken from the documentation, each in a fresh namespace, in this
one process (see tests/test_docs.py for the scheme and why it is sound).

Without arguments (run by tests/test_docs.py in a fresh interpreter): tests/test_docs.py's FRESH_PROCESS_CHECK, then
every runnable block of the documents (`test_docs.RUNNABLE`). With one argument: a
JSON file with a list of {"path", "line", "code"}. `line` is the line of the block's
first code line in `path`. Each block is compiled with `path` as its file name and
padded so that tracebacks show the line in the document; the blocks run in a
temporary working directory. Output: one line "BLOCK <path>:<line> OK" or
"BLOCK <path>:<line> FAILED" per block (then the traceback, indented), then
"doc blocks: N passed, M failed".
"""

import json
import os
import shutil
import sys
import tempfile
import traceback

os.environ.pop("TF_USE_LEGACY_KERAS", None)   # each block sets what it needs
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("MPLBACKEND", "Agg")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _fresh_graph():
    """A new default graph for the next block, once a block has imported TensorFlow."""
    tf = sys.modules.get("tensorflow")
    if tf is not None:
        tf.compat.v1.reset_default_graph()


def _documents_blocks():
    """FRESH_PROCESS_CHECK and the runnable blocks of tests/test_docs.py (which imports
    no TensorFlow)."""
    from tests import test_docs  # pylint: disable=import-outside-toplevel
    path, line = test_docs.FRESH_PROCESS.rsplit(":", 1)
    return [{"path": path, "line": int(line), "code": test_docs.FRESH_PROCESS_CHECK}] + [
        {"path": p, "line": n, "code": code} for p, n, code in test_docs.RUNNABLE]


def main():
    if len(sys.argv) > 1:
        with open(sys.argv[1], encoding="utf-8") as f:
            blocks = json.load(f)
    else:
        blocks = _documents_blocks()
    home, workdir = os.getcwd(), tempfile.mkdtemp(prefix="pertower-doc-blocks-")
    os.chdir(workdir)   # what a block writes goes there
    try:
        failed = sum(not _run(block) for block in blocks)
    finally:
        os.chdir(home)
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"doc blocks: {len(blocks) - failed} passed, {failed} failed")
    return 1 if failed else 0


def _run(block):
    """Runs one block, prints its BLOCK line; returns True if it ran without error."""
    where = f"{block['path']}:{block['line']}"
    _fresh_graph()
    code = "\n" * (block["line"] - 1) + block["code"]
    namespace = {"__name__": "__main__"}
    try:
        exec(compile(code, block["path"], "exec"), namespace)  # pylint: disable=exec-used
    except BaseException:  # pylint: disable=broad-except
        text = traceback.format_exc()
        print(f"BLOCK {where} FAILED")
        print("    " + text.rstrip().replace("\n", "\n    "))
        ok = False
    else:
        print(f"BLOCK {where} OK")
        ok = True
    sys.stdout.flush()
    del namespace
    return ok


if __name__ == "__main__":
    sys.exit(main())

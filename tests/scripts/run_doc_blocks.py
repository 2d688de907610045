"""Runs Python blocks taken from the documentation, each in a fresh namespace, in this
one process (see tests/test_docs.py for the scheme and why it is sound).

Input: a JSON file (argv[1]) with a list of {"path", "line", "code"}: `line` is the line
of the block's first code line in `path`. Each block is compiled with `path` as its file
name and padded so that tracebacks show the line in the document. Output: one line
"BLOCK <path>:<line> OK" or "BLOCK <path>:<line> FAILED" per block (the traceback on
stderr and after the FAILED line, indented), then "doc blocks: N passed, M failed".
"""

import json
import os
import sys
import traceback

os.environ.pop("TF_USE_LEGACY_KERAS", None)   # each block sets what it needs
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("MPLBACKEND", "Agg")


def _fresh_graph():
    """A new default graph for the next block, once a block has imported TensorFlow."""
    tf = sys.modules.get("tensorflow")
    if tf is not None:
        tf.compat.v1.reset_default_graph()


def main():
    with open(sys.argv[1], encoding="utf-8") as f:
        blocks = json.load(f)
    failed = 0
    for block in blocks:
        where = f"{block['path']}:{block['line']}"
        _fresh_graph()
        code = "\n" * (block["line"] - 1) + block["code"]
        namespace = {"__name__": "__main__"}
        try:
            exec(compile(code, block["path"], "exec"), namespace)  # pylint: disable=exec-used
        except BaseException:  # pylint: disable=broad-except
            failed += 1
            text = traceback.format_exc()
            print(f"BLOCK {where} FAILED")
            print("    " + text.rstrip().replace("\n", "\n    "))
        else:
            print(f"BLOCK {where} OK")
        sys.stdout.flush()
        del namespace
    print(f"doc blocks: {len(blocks) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

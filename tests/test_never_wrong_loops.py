"""Loops bounded by a reduction over the batch (issue 17, item 1), against the
one-example loop in both modes, and gradients written in Python downstream of a v1
loop (item 2, row passes: v1 loops only): the checks of tests/scripts/never_wrong_loop_checks.py
run here (TensorFlow 2 behaviour in graph mode: v2 While loops) and in a process of
their own under tf.compat.v1.disable_v2_behavior() (v1 loops), started once per module.
"""

import json
import os
import subprocess
import sys

import pytest

from tests.scripts import never_wrong_loop_checks

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRIPT = os.path.join(HERE, "scripts", "never_wrong_loop_checks.py")
NAMES = [check.__name__ for check in never_wrong_loop_checks.CHECKS]
LEGACY_NAMES = NAMES + [check.__name__ for check in never_wrong_loop_checks.LEGACY_ONLY_CHECKS]
_PREFIX = "pertower-check "


@pytest.mark.parametrize("check", never_wrong_loop_checks.CHECKS, ids=NAMES)
def test_v2_loops(check):
    assert check() in ("While", "StatelessWhile")


@pytest.fixture(scope="module")
def legacy_results():
    """name -> the record the legacy process printed for that check."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_USE_LEGACY_KERAS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    completed = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True,
                               env=env, cwd=ROOT, timeout=900, check=False)
    records = {}
    for line in completed.stdout.splitlines():
        if line.startswith(_PREFIX):
            record = json.loads(line[len(_PREFIX):])
            records[record["name"]] = record
    assert records, f"no checks reported:\n{completed.stdout}\n{completed.stderr[-3000:]}"
    return records


@pytest.mark.parametrize("name", LEGACY_NAMES)
def test_v1_loops_under_disable_v2_behavior(legacy_results, name):
    record = legacy_results.get(name)
    assert record is not None, f"{name} did not report"
    assert record["ok"], record["message"]
    assert record["output"] == "LoopCond", record

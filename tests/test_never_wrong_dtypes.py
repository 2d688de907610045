"""Non-float variables in DPOptimizer's `var_list` (issue 17, item 8): the checks of
tests/scripts/never_wrong_dtype_checks.py, each mode in a process of its own (a dtype
mismatch once aborted the process at `sess.run`)."""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRIPT = os.path.join(HERE, "scripts", "never_wrong_dtype_checks.py")
NAMES = ["check_dp_optimizer_skips_int64_and_string_variables",
         "check_dp_optimizer_refuses_a_var_list_without_float_variables"]
_PREFIX = "pertower-check "


@pytest.fixture(scope="module", params=["graph", "legacy"])
def results(request):
    """(mode, exit code, name -> record) of the script run in `mode`."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_USE_LEGACY_KERAS="1")
    completed = subprocess.run([sys.executable, SCRIPT, request.param], capture_output=True,
                               text=True, env=env, cwd=ROOT, timeout=900, check=False)
    records = {}
    for line in completed.stdout.splitlines():
        if line.startswith(_PREFIX):
            record = json.loads(line[len(_PREFIX):])
            records[record["name"]] = record
    return request.param, completed.returncode, records, completed.stderr[-3000:]


@pytest.mark.parametrize("name", NAMES)
def test_non_float_variables_in_dp_optimizer(results, name):
    mode, code, records, stderr = results
    assert code in (0, 1), f"{mode}: the process ended with {code} (aborted?)\n{stderr}"
    assert name in records, f"{mode}: {name} did not report\n{stderr}"
    assert records[name]["ok"], f"{mode}: {records[name]['message']}"

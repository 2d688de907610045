"""The per-op rules in both shape modes (issue 17, item 7): the checks of
tests/scripts/never_wrong_shape_checks.py, each mode in a process of its own (under
tf.compat.v1.disable_v2_behavior() static shapes are `Dimension` objects)."""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRIPT = os.path.join(HERE, "scripts", "never_wrong_shape_checks.py")
NAMES = ["check_conv2d_strided_valid_that_skips_the_last_rows",
         "check_conv2d_same_and_unstrided", "check_depthwise_conv2d_strided_valid",
         "check_dense_bias_and_batch_matmul", "check_embedding_lookup"]
_PREFIX = "pertower-check "


@pytest.fixture(scope="module", params=["graph", "legacy"])
def results(request):
    """(mode, exit code, name -> record, the end of stderr) of the script in `mode`."""
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
def test_rules_in_both_shape_modes(results, name):
    mode, code, records, stderr = results
    assert code in (0, 1), f"{mode}: the process ended with {code}\n{stderr}"
    assert name in records, f"{mode}: {name} did not report\n{stderr}"
    assert records[name]["ok"], f"{mode}: {records[name]['message']}"

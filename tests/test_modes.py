"""Process-wide modes that the main test process cannot switch to: each runs a script of
tests/scripts/ in a subprocess and checks what it reports."""

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _run_script(name):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_USE_LEGACY_KERAS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, os.path.join(HERE, "scripts", name)],
                          capture_output=True, text=True, timeout=600, env=env)


def test_legacy_graphs_under_disable_v2_behavior_match_oracle():
    result = _run_script("legacy_v1_checks.py")
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "legacy checks: 4 passed, 0 failed" in result.stdout, result.stdout


def test_eager_mode_is_refused_with_the_switch_to_use():
    result = _run_script("eager_refusal.py")
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "eager refusal checks: 2 passed" in result.stdout, result.stdout

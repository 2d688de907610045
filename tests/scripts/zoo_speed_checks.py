"""Run in a process of its own: the checks of tests/test_rules_zoo_speed.py in another mode.

    python tests/scripts/zoo_speed_checks.py legacy   # tf.compat.v1.disable_v2_behavior()
    python tests/scripts/zoo_speed_checks.py onednn   # TF_ENABLE_ONEDNN_OPTS=1

Started by tests/process_checks.py ("zoo_speed_legacy", "zoo_speed_onednn"); prints one
`pertower-check` line per check and a summary; exits 1 on failure.
"""

import os
import sys

MODE = sys.argv[1] if len(sys.argv) > 1 else "legacy"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
if MODE == "onednn":
    os.environ["TF_ENABLE_ONEDNN_OPTS"] = "1"

import tensorflow as tf  # noqa: E402

if MODE == "legacy":
    tf.compat.v1.disable_v2_behavior()

from pertower.rules import conv2d  # noqa: E402
from tests import process_checks  # noqa: E402
from tests import test_rules_zoo_speed as zoo_speed  # noqa: E402


def _require_mode():
    if MODE == "legacy":
        process_checks.require_legacy_mode()
    if MODE == "onednn" and not conv2d.onednn_enabled():
        raise AssertionError("expected TensorFlow's oneDNN kernels (TF_ENABLE_ONEDNN_OPTS=1)")


def _wrapped(name):
    def check():
        _require_mode()
        return getattr(zoo_speed, name)()
    check.__name__ = name
    return check


if __name__ == "__main__":
    sys.exit(process_checks.run_checks([_wrapped(n) for n in zoo_speed.CHECKS],
                                       f"zoo speed checks ({MODE})"))

"""Run in a process of its own: tests/test_vgg_paths.py's `check_forward_form` (the
input gradients as forward convolutions, and a dense layer of `MUL_MIN_COLUMNS`
outputs: the broadcast-Mul outer products) under tf.compat.v1.disable_v2_behavior()
(legacy shape mode, reference variables), against the one-example oracle.

Started once per test session by tests/process_checks.py ("vgg_paths_legacy"); prints
one `pertower-check` line per check and 'vgg paths legacy checks: N passed, M failed';
exits 1 on failure.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

tf.compat.v1.disable_v2_behavior()

from tests import process_checks  # noqa: E402
from tests import test_vgg_paths  # noqa: E402


def check_vgg_paths_legacy():
    process_checks.require_legacy_mode()
    test_vgg_paths.check_forward_form(batch=2)


if __name__ == "__main__":
    sys.exit(process_checks.run_checks([check_vgg_paths_legacy], "vgg paths legacy checks"))

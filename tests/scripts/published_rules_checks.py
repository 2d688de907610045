"""Run in a process of its own: the checks of tests/test_rules_published.py (the
FusedBatchNorm rule in inference mode, the broadcast elementwise rule, a Keras
BatchNormalization net and a tf_keras.applications network) under
tf.compat.v1.disable_v2_behavior() (legacy shape mode, reference variables), against
the one-example oracle.

Started once per test session by tests/process_checks.py ("published_legacy"); prints
one `pertower-check` line per check and 'published rules checks: N passed, M failed';
exits 1 on failure.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import tensorflow as tf  # noqa: E402

tf.compat.v1.disable_v2_behavior()

from tests import process_checks  # noqa: E402
from tests import test_rules_published as published  # noqa: E402


def _require_legacy_mode():
    if tf.compat.v1.resource_variables_enabled() or tf.executing_eagerly():
        raise AssertionError("expected disable_v2_behavior(): reference variables, graph mode")


def check_every_broadcast_op():
    _require_legacy_mode()
    published.check_every_broadcast_op()


def check_raw_fused_batch_norms():
    _require_legacy_mode()
    for op_type in ("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"):
        for data_format in ("NHWC", "NCHW"):
            published.check_raw_fused_batch_norm(op_type, data_format)


def check_keras_batch_norm_net():
    _require_legacy_mode()
    published.check_keras_batch_norm_net()


def check_application():
    _require_legacy_mode()
    return published.check_application()


def check_broadcast_dp_step():
    _require_legacy_mode()
    published.check_broadcast_dp_step()


if __name__ == "__main__":
    sys.exit(process_checks.run_checks(
        [check_every_broadcast_op, check_raw_fused_batch_norms, check_keras_batch_norm_net,
         check_application, check_broadcast_dp_step], "published rules checks"))

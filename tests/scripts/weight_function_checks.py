"""Run in a process of its own: the checks of tests/test_rules_weight_functions.py
(weights read through functions of the weights alone: casts, weight normalization,
tanh/abs, Transpose, ConcatV2 partitions, Keras' non-fused batch norm, a DP step) under
tf.compat.v1.disable_v2_behavior() (legacy shape mode, reference variables), against
the one-example oracle.

Started once per test session by tests/process_checks.py ("weight_functions_legacy");
prints one `pertower-check` line per check and 'weight function checks: N passed, M
failed'; exits 1 on failure.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import tensorflow as tf  # noqa: E402

tf.compat.v1.disable_v2_behavior()

from tests import process_checks  # noqa: E402
from tests import test_rules_weight_functions as weight_functions  # noqa: E402


def check_weight_functions():
    process_checks.require_legacy_mode()
    weight_functions.check_weight_functions()


def check_partitioned_variable():
    process_checks.require_legacy_mode()
    weight_functions.check_partitioned_variable()


def check_mixed_float16_dense():
    process_checks.require_legacy_mode()
    # Keras mixed precision under TF1 behaviour: the documented switch that lets layers
    # cast their inputs to their policy's compute dtype (variables stay reference ones)
    tf.compat.v1.keras.layers.enable_v2_dtype_behavior()
    weight_functions.check_mixed_float16_dense()


def check_non_fused_batch_norms():
    process_checks.require_legacy_mode()
    for rank in (2, 4):
        weight_functions.check_non_fused_batch_norm(rank)


def check_dp_step():
    process_checks.require_legacy_mode()
    weight_functions.check_dp_step()


def check_not_followed():
    process_checks.require_legacy_mode()
    weight_functions.check_not_followed()


if __name__ == "__main__":
    sys.exit(process_checks.run_checks(
        [check_weight_functions, check_partitioned_variable, check_mixed_float16_dense,
         check_non_fused_batch_norms, check_dp_step, check_not_followed],
        "weight function checks"))

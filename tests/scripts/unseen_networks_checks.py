"""Run in a process of its own: the checks of tests/test_unseen_networks.py (grouped
convolutions through their function calls, and of tests/test_rules_grouped.py (Conv1D
with groups, groups = channels), GroupNormalization, regularised losses, an
activity regularizer refused) under tf.compat.v1.disable_v2_behavior() (legacy shape
mode, reference variables), against the one-example loop.

Started by tests/process_checks.py ("unseen_legacy", in the legacy group); prints one
`pertower-check` line per check and 'unseen networks checks: N passed, M failed';
exits 1 on failure.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import tensorflow as tf  # noqa: E402

tf.compat.v1.disable_v2_behavior()

from tests import process_checks  # noqa: E402
from tests import test_rules_grouped as grouped  # noqa: E402
from tests import test_unseen_networks as unseen  # noqa: E402


def _require_legacy_mode():
    if tf.compat.v1.resource_variables_enabled() or tf.executing_eagerly():
        raise AssertionError("expected disable_v2_behavior(): reference variables, graph mode")


def check_grouped():
    _require_legacy_mode()
    case = unseen.Case("grouped")
    try:
        unseen.check_grouped_ops_in_plan(case)
        return case.check()
    finally:
        case.close()


def check_grouped_relaid():
    """Conv1D/Conv2D with groups through re-layouts in their calls, and groups =
    channels in the depthwise form (tests/test_rules_grouped.py)."""
    _require_legacy_mode()
    model = grouped.GroupedModel(full=False)
    try:
        model.check_plan()
        model.check_depthwise_form()
        return model.check_numbers()
    finally:
        model.close()


def check_other_bodies_refused():
    _require_legacy_mode()
    grouped.check_other_bodies_refused()


def check_sparse_matmul():
    _require_legacy_mode()
    grouped.check_sparse_matmul()


def check_groupnorm():
    _require_legacy_mode()
    return unseen.check_case("groupnorm")


def check_regularized():
    _require_legacy_mode()
    return unseen.check_case("regularized")


def check_activity_regularizer_refused():
    _require_legacy_mode()
    unseen.check_activity_regularizer_refused()


if __name__ == "__main__":
    sys.exit(process_checks.run_checks(
        [check_grouped, check_grouped_relaid, check_other_bodies_refused, check_sparse_matmul,
         check_groupnorm,
         check_regularized, check_activity_regularizer_refused], "unseen networks checks"))

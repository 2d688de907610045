"""Run in a process of its own: the checks of tests/test_legacy_idioms.py (legacy TF1
idioms: sampled losses sharing the batch's draw, tf.compat.v1 layers, losses, variable
scopes and partitioners, v1 cells) under tf.compat.v1.disable_v2_behavior() (reference
variables, `Dimension` shapes), against the one-example loop.

Started once per test session by tests/process_checks.py ("legacy_idioms", and
"legacy_idioms_heavy" for the long matrix); prints one `pertower-check` line per check
and 'legacy idiom checks: N passed, M failed'; exits 1 on failure.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import tensorflow as tf  # noqa: E402

tf.compat.v1.disable_v2_behavior()

from tests import process_checks  # noqa: E402
from tests import legacy_idiom_cases  # noqa: E402
from tests import test_legacy_idioms as idioms  # noqa: E402


def check_sampled_softmax_shares_the_batch_draw():
    process_checks.require_legacy_mode()
    idioms.check_sampled_losses_share_the_batch_draw(full=False)


def check_sampled_losses_share_the_batch_draw():
    process_checks.require_legacy_mode()
    idioms.check_sampled_losses_share_the_batch_draw()


def check_sampled_loss_microbatches_and_capacity():
    process_checks.require_legacy_mode()
    idioms.check_sampled_loss_microbatches_and_capacity()


def check_partitioned_lookups_on_the_rules():
    process_checks.require_legacy_mode()
    idioms.check_partitioned_lookups_on_the_rules()


def check_partitioned_lookup_with_another_use_is_not_proven():
    process_checks.require_legacy_mode()
    idioms.check_partitioned_lookup_with_another_use_is_not_proven()


def check_sparse_lookups_on_the_rules():
    process_checks.require_legacy_mode()
    idioms.check_sparse_lookups_on_the_rules()


def check_sparse_lookup_with_trailing_empty_examples():
    process_checks.require_legacy_mode()
    idioms.check_sparse_lookup_with_trailing_empty_examples()


def check_sparse_lookup_with_another_use_is_not_proven():
    process_checks.require_legacy_mode()
    idioms.check_sparse_lookup_with_another_use_is_not_proven()


def check_idiom_matrix():
    """Every case of tests/legacy_idiom_cases.py against the loop; every refusal."""
    process_checks.require_legacy_mode()
    for name in sorted(legacy_idiom_cases.CASES):
        legacy_idiom_cases.check_case(name)
    for name in sorted(legacy_idiom_cases.REFUSED):
        legacy_idiom_cases.check_refused(name)


if __name__ == "__main__":
    sys.exit(process_checks.run_checks(
        [check_sampled_softmax_shares_the_batch_draw, check_partitioned_lookups_on_the_rules,
         check_partitioned_lookup_with_another_use_is_not_proven,
         check_sparse_lookups_on_the_rules, check_sparse_lookup_with_trailing_empty_examples,
         check_sparse_lookup_with_another_use_is_not_proven,
         check_sampled_losses_share_the_batch_draw, check_sampled_loss_microbatches_and_capacity,
         check_idiom_matrix],
        "legacy idiom checks", heavy={"check_sampled_losses_share_the_batch_draw",
                                      "check_sampled_loss_microbatches_and_capacity",
                                      "check_idiom_matrix"}))

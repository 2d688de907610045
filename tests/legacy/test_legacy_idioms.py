"""The checks of tests/test_legacy_idioms.py (legacy TF1
idioms: sampled losses sharing the batch's draw, tf.compat.v1 layers, losses, variable
scopes and partitioners, v1 cells) under tf.compat.v1.disable_v2_behavior() (reference
variables, `Dimension` shapes), against the one-example loop.
"""

import pytest

from tests import legacy_idiom_cases
from tests import test_legacy_idioms as idioms


def test_sampled_softmax_shares_the_batch_draw():
    idioms.check_sampled_losses_share_the_batch_draw(full=False)


@pytest.mark.heavy
def test_sampled_losses_share_the_batch_draw():
    idioms.check_sampled_losses_share_the_batch_draw()


@pytest.mark.heavy
def test_sampled_loss_microbatches_and_capacity():
    idioms.check_sampled_loss_microbatches_and_capacity()


def test_partitioned_lookups_on_the_rules():
    idioms.check_partitioned_lookups_on_the_rules()


def test_partitioned_lookup_with_another_use_is_not_proven():
    idioms.check_partitioned_lookup_with_another_use_is_not_proven()


def test_sparse_lookups_on_the_rules():
    idioms.check_sparse_lookups_on_the_rules()


def test_sparse_lookup_with_trailing_empty_examples():
    idioms.check_sparse_lookup_with_trailing_empty_examples()


def test_sparse_lookup_with_another_use_is_not_proven():
    idioms.check_sparse_lookup_with_another_use_is_not_proven()


@pytest.mark.heavy
def test_idiom_matrix():
    """Every case of tests/legacy_idiom_cases.py against the loop; every refusal."""
    for name in sorted(legacy_idiom_cases.CASES):
        legacy_idiom_cases.check_case(name)
    for name in sorted(legacy_idiom_cases.REFUSED):
        legacy_idiom_cases.check_refused(name)

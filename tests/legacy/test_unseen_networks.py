"""The checks of tests/test_unseen_networks.py (grouped
convolutions through their function calls, and of tests/test_rules_grouped.py (Conv1D
with groups, groups = channels), GroupNormalization, regularised losses, an
activity regularizer refused) under tf.compat.v1.disable_v2_behavior() (legacy shape
mode, reference variables), against the one-example loop.
"""

from tests import test_rules_grouped as grouped
from tests import test_unseen_networks as unseen



def test_grouped():
    case = unseen.Case("grouped")
    try:
        unseen.check_grouped_ops_in_plan(case)
        print(case.check())
    finally:
        case.close()


def test_grouped_relaid():
    """Conv1D/Conv2D with groups through re-layouts in their calls, and groups =
    channels in the depthwise form (tests/test_rules_grouped.py)."""
    model = grouped.GroupedModel(full=False)
    try:
        model.check_plan()
        model.check_depthwise_form()
        print(model.check_numbers())
    finally:
        model.close()


def test_other_bodies_refused():
    grouped.check_other_bodies_refused()


def test_sparse_matmul():
    grouped.check_sparse_matmul()


def test_groupnorm():
    print(unseen.check_case("groupnorm"))


def test_regularized():
    print(unseen.check_case("regularized"))


def test_activity_regularizer_refused():
    unseen.check_activity_regularizer_refused()

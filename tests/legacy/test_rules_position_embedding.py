"""The checks of tests/test_rules_position_embedding.py (learned position tables,
`tf.gather(table, tf.range(T))` and `table[:T]`, on the rules through the gather or the
slice) under tf.compat.v1.disable_v2_behavior() (legacy shape mode, reference
variables), against the one-example oracle.
"""

import pytest

from tests import test_rules_position_embedding as position_embedding


@pytest.mark.parametrize("static_length", [False, True], ids=["dynamic T", "static T"])
@pytest.mark.parametrize("how", ["gather", "slice"])
def test_learned_position_table(static_length, how):
    position_embedding.check_transformer_block(static_length, how)


def test_tied_table():
    position_embedding.check_tied_table()


def test_rows_that_follow_the_batch():
    position_embedding.check_batch_dependent_rows_are_not_weight_side()

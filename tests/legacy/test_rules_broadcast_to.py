"""The checks of tests/test_rules_broadcast_to.py (a weight spread over the batch's shape
by BroadcastTo: TF-models' PositionEmbedding in a Transformer encoder block, a scale and
a bias by hand, in a loop body, the refused sum over the batch axis) under
tf.compat.v1.disable_v2_behavior() (legacy shape mode, reference variables), against the
one-example oracle.
"""

import pytest

from tests import test_rules_broadcast_to as broadcast_to


@pytest.mark.heavy   # (the default run checks the encoder in graph mode)
@pytest.mark.parametrize("static_length", [False, True], ids=["dynamic T", "static T"])
def test_position_embedding_encoder(static_length):
    broadcast_to.check_encoder(static_length)


def test_scale_and_bias_broadcast_by_hand():
    broadcast_to.check_scale_broadcast_by_hand()


def test_broadcast_in_a_loop_body():
    broadcast_to.check_broadcast_in_a_loop_body()


def test_sum_over_the_broadcast_batch_axis():
    broadcast_to.check_sum_over_the_broadcast_batch_is_refused()

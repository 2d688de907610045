"""The checks of tests/test_loop_weight_side.py (a gather of rows every example reads in
a loop body, on the rules through the gather) under tf.compat.v1.disable_v2_behavior()
(a TF1 frame, reference variables), against the one-example oracle.
"""

import pytest

from tests import test_loop_weight_side as loop_weight_side


@pytest.mark.parametrize("ids", [pytest.param("range", marks=pytest.mark.heavy), "clipped"])
def test_gather_in_a_loop_body(ids):
    loop_weight_side.check_gather_in_a_loop_body(ids)

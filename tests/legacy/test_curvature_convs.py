"""Under tf.compat.v1.disable_v2_behavior() (reference
variables, v1 control flow, Dimension shapes): the checks of tests/test_curvature_convs.py,
`pertower.diag_ggn` and `pertower.sum_grad_squared` on convolutions against the
one-example loop, with conv2d_squares' own choice of way and with "ghost" forced.
"""

import pytest

from tests.test_curvature_convs import ROUTES, check_case


def test_conv_squares_with_their_own_choice_of_way_match_the_loop():
    routes = check_case(None)
    assert routes == ROUTES, routes


@pytest.mark.heavy
def test_conv_squares_with_ghost_forced_match_the_loop():
    routes = check_case("ghost")
    assert routes == ROUTES, routes

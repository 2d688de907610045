"""Run in a process of its own under tf.compat.v1.disable_v2_behavior() (reference
variables, v1 control flow, Dimension shapes): the checks of tests/test_curvature_convs.py,
`pertower.diag_ggn` and `pertower.sum_grad_squared` on convolutions against the
one-example loop, with conv2d_squares' own choice of way and with "ghost" forced.

Prints 'curvature conv checks: N passed, 0 failed' (exit 0) or the failures (exit 1).
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

tf.compat.v1.disable_v2_behavior()

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
from tests.process_checks import run_checks  # noqa: E402
from tests.test_curvature_convs import ROUTES, check_case  # noqa: E402


def check_auto():
    routes = check_case(None)
    assert routes == ROUTES, routes


def check_ghost():
    routes = check_case("ghost")
    assert routes == ROUTES, routes


if __name__ == "__main__":
    # with the argument `heavy` (process "curvature_convs_legacy_heavy"): "ghost" forced
    # (conv2d_squares' own choice, check_auto, takes its routes in the default run)
    sys.exit(run_checks([check_auto, check_ghost], "curvature conv checks",
                        heavy={"check_ghost"}))

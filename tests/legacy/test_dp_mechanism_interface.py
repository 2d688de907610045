"""tests/test_dp_mechanism_interface.py's fit test under
tf.compat.v1.disable_v2_behavior() (reference variables, v1 control flow)."""

# pylint: disable-next=unused-import
from tests.test_dp_mechanism_interface import (  # noqa: F401  (collected here too)
    test_banded_noise_through_keras_fit_is_sgd_on_the_loops_clipped_mean)

"""tests/test_dp_mechanism_interface.py's fit tests under
tf.compat.v1.disable_v2_behavior() (reference variables, v1 control flow)."""

# pylint: disable-next=unused-import
from tests.test_dp_mechanism_interface import (  # noqa: F401  (collected here too)
    test_banded_noise_through_keras_fit_is_sgd_on_the_loops_clipped_mean,
    test_a_keras_model_saved_mid_run_resumes_the_banded_noise)

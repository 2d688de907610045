"""tests/test_dp_banded_mf.py's optimizer tests under tf.compat.v1.disable_v2_behavior()
(reference variables, the accumulation's tf.cond in v1 control flow)."""

# pylint: disable-next=unused-import
from tests.test_dp_banded_mf import (  # noqa: F401  (collected here too)
    test_the_recursion_releases_c_inverse_z,
    test_noise_free_banded_steps_equal_sgd_on_the_loop_s_clipped_sums,
    test_one_band_in_the_optimizer_adds_dp_sgd_s_noise,
    test_a_restored_checkpoint_continues_the_noise_stream,
    test_accumulated_runs_advance_the_noise_once_per_step)

"""tests/test_dp_noise_stream.py under tf.compat.v1.disable_v2_behavior() (reference
variables, the accumulation's tf.cond in v1 control flow)."""

# pylint: disable-next=unused-import
from tests.test_dp_noise_stream import (  # noqa: F401  (collected here too)
    test_a_restored_session_continues_the_noise_stream,
    test_the_counter_moves_once_per_noised_release,
    test_split_workers_draw_distinct_keys,
    test_the_marginal_is_n_0_sigma2_c2,
    test_adaptive_clipping_s_count_key_moves_the_counter_each_step)

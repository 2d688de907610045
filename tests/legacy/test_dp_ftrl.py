"""Under tf.compat.v1.disable_v2_behavior() (reference variables, v1 control flow: the
tree's while loops in Enter/Exit frames): the session optimizer's checks of
tests/test_dp_ftrl.py, `pertower.DPFTRLOptimizer` against the one-example loop and the
tree's stream, a restored session continuing bit for bit, and a Keras fit with the
efficient tree's fixed-shape buffer saved and loaded mid-tree continuing bit for bit.
"""

from tests.test_dp_ftrl import (
    test_a_keras_efficient_tree_with_restarts_saved_mid_tree_resumes_bit_for_bit,
    test_a_restart_starts_fresh_nodes_and_keeps_the_first_tree_s_stream,
    test_a_session_restored_from_a_checkpoint_continues_bit_for_bit,
    test_noiseless_steps_are_ftrl_on_the_loop_s_clipped_sums,
    test_the_optimizer_applies_the_tree_s_noise_once_per_step)

# collected here too
__all__ = ["test_a_keras_efficient_tree_with_restarts_saved_mid_tree_resumes_bit_for_bit",
           "test_a_restart_starts_fresh_nodes_and_keeps_the_first_tree_s_stream",
           "test_a_session_restored_from_a_checkpoint_continues_bit_for_bit",
           "test_noiseless_steps_are_ftrl_on_the_loop_s_clipped_sums",
           "test_the_optimizer_applies_the_tree_s_noise_once_per_step"]

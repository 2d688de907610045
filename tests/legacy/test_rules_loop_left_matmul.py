"""The checks of tests/test_rules_loop_left_matmul.py under
tf.compat.v1.disable_v2_behavior() (reference variables, control flow v1): the raw loops
are TF1 frames, the weight on the left of their MatMul on the rules through the frame's
copy (`pertower._loops.frames`)."""

from tests.test_rules_loop_left_matmul import (
    test_a_left_operand_in_a_raw_while_loop, test_a_left_operand_outside_a_loop,
    test_a_left_operand_of_a_batch_matmul_in_a_body_stays_on_the_towers)

__all__ = ["test_a_left_operand_in_a_raw_while_loop",
           "test_a_left_operand_of_a_batch_matmul_in_a_body_stays_on_the_towers",
           "test_a_left_operand_outside_a_loop"]

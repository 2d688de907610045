"""The checks of tests/test_rules_loop_convolution.py under
tf.compat.v1.disable_v2_behavior() (reference variables, control flow v1): ConvLSTM2D,
ConvLSTM1D and the raw loops build TF1 frames, whose convolutions are on the rules per
step through the frame's copy (`pertower._loops.frames`). The default run takes the raw
loop; the Keras layers run with -m heavy. (Not test_mixed_float16_conv_lstm2d: tf_keras
sets a global dtype policy only under V2 dtype behavior.)"""

import pytest

from tests import test_rules_loop_convolution as convolution
from tests.test_rules_loop_convolution import (
    test_a_state_convolved_in_a_raw_while_loop, test_conv_lstm1d, test_conv_lstm2d_strided_valid)

__all__ = ["test_a_state_convolved_in_a_raw_while_loop", "test_conv_lstm1d",
           "test_conv_lstm2d_kernels_and_bias_per_step", "test_conv_lstm2d_strided_valid"]


@pytest.mark.heavy
def test_conv_lstm2d_kernels_and_bias_per_step():
    convolution.test_conv_lstm2d_kernels_and_bias_per_step()

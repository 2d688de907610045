"""tests/test_rules_in_both_shape_modes.py's tests under tf.compat.v1.disable_v2_behavior(),
where static shapes are `Dimension` objects."""

# pylint: disable-next=unused-import
from tests.test_rules_in_both_shape_modes import (  # noqa: F401  (collected here too)
    test_conv2d_strided_valid_that_skips_the_last_rows, test_conv2d_same_and_unstrided,
    test_depthwise_conv2d_strided_valid, test_dense_bias_and_batch_matmul,
    test_embedding_lookup)

"""The checks of tests/test_rules_weight_functions.py
(weights read through functions of the weights alone: casts, weight normalization,
tanh/abs, Transpose, ConcatV2 partitions, Keras' non-fused batch norm, a DP step) under
tf.compat.v1.disable_v2_behavior() (legacy shape mode, reference variables), against
the one-example oracle.
"""

import tensorflow as tf

from tests import test_rules_weight_functions as weight_functions


def test_weight_functions():
    weight_functions.check_weight_functions()


def test_partitioned_variable():
    weight_functions.check_partitioned_variable()


def test_mixed_float16_dense():
    # Keras mixed precision under TF1 behaviour: the documented switch that lets layers
    # cast their inputs to their policy's compute dtype (variables stay reference ones)
    tf.compat.v1.keras.layers.enable_v2_dtype_behavior()
    weight_functions.check_mixed_float16_dense()


def test_non_fused_batch_norms():
    for rank in (2, 4):
        weight_functions.check_non_fused_batch_norm(rank)


def test_dp_step():
    weight_functions.check_dp_step()


def test_not_followed():
    weight_functions.check_not_followed()

"""The `fit` checks of tests/test_keras_fit.py under tf.compat.v1.disable_v2_behavior()
(reference variables, legacy shapes): one DP step of `model.fit` against the one-example
loop's clipped mean (a loss of reduction NONE, and Keras' default scalar mean with a
weight regularizer), and Keras' own placeholders on the rules.
"""

import pytest

from tests import test_keras_fit as keras_fit


@pytest.mark.parametrize("kind, num_microbatches, options", [
    ("dense", None, {}), ("conv", 2, {}),
    ("dense", None, dict(reduction="auto", kernel_l2=0.3))])
def test_one_fit_step_is_sgd_on_the_loops_clipped_mean(kind, num_microbatches, options):
    keras_fit.test_one_fit_step_is_sgd_on_the_loops_clipped_mean(kind, num_microbatches, 1,
                                                                 options)


def test_keras_targets_are_proven_on_the_rules():
    keras_fit.test_keras_targets_are_proven_on_the_rules()

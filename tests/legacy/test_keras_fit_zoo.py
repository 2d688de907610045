"""The published-network `fit` checks of tests/test_keras_fit_zoo.py under
tf.compat.v1.disable_v2_behavior() (reference variables, TF1 control flow): one DP fit
step against the one-example loop, and batch normalization in training mode refused."""

import pytest

from tests import test_keras_fit_zoo as zoo_fit


@pytest.mark.parametrize("name, reduction", [
    ("lstm", zoo_fit.NONE), pytest.param("mobilenet_v2", "auto", marks=pytest.mark.heavy),
    pytest.param("transformer", zoo_fit.NONE, marks=pytest.mark.heavy)])
def test_one_fit_step_on_a_published_network_is_the_loops_clipped_mean(name, reduction):
    zoo_fit.test_one_fit_step_on_a_published_network_is_the_loops_clipped_mean(name,
                                                                             reduction)


def test_batch_norm_in_training_mode_is_refused_naming_the_layer_and_the_fix():
    zoo_fit.test_batch_norm_in_training_mode_is_refused_naming_the_layer_and_the_fix()

"""The fit check of tests/test_keras_poisson.py under tf.compat.v1.disable_v2_behavior()
(reference variables, legacy shapes): a DP fit of several epochs on Poisson batches of
every size, 0 included, step by step against the one-example loop.
"""

from tests import test_keras_poisson as keras_poisson


def test_a_fit_of_several_epochs_takes_a_step_on_every_batch_size_0_included():
    keras_poisson.test_a_fit_of_several_epochs_takes_a_step_on_every_batch_size_0_included()

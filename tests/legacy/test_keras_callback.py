"""The ExampleScores check of tests/test_keras_callback.py under
tf.compat.v1.disable_v2_behavior() (reference variables, legacy shapes): the callback's
norms and self-influence on Poisson batches, empty ones included, against the
one-example loop.
"""

from tests import test_keras_callback as keras_callback


def test_scores_on_poisson_batches_an_empty_one_included():
    keras_callback.test_scores_on_poisson_batches_an_empty_one_included()

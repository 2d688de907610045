"""Keras 3 weights (`keras.Variable`, not TF variables) are accepted in `xs`.

The network test reads the "keras3" process of tests/process_checks.py
(tests/scripts/keras3_weights.py, run in the background once per session): Keras 3 needs
TF_USE_LEGACY_KERAS unset before TensorFlow is imported, and this process sets it to 1
(conftest.py). The error for a Keras 3 variable without a TF variable behind it is
checked here, with a stand-in object (Keras 3 is recognised by duck typing)."""

import numpy as np
import pytest
import tensorflow as tf

import pertower
from pertower import _checks

@pytest.mark.process_checks("keras3")
def test_keras3_dense_weights_match_the_one_example_loop(processes):
    done = processes.completed("keras3")
    assert done.returncode == 0, done.explain()
    if "keras 3 unavailable" in done.stdout:
        pytest.skip(done.stdout.strip())
    assert "keras 3 checks: 3 passed, 0 failed" in done.stdout, done.explain()


class _StandIn:
    """Looks like a Keras 3 variable to the duck typing: module "keras...", `.value`."""

    def __init__(self, value):
        self.value = value
        self.path = "dense/kernel"


_StandIn.__module__ = "keras.src.backend.stand_in"


def test_keras3_like_variable_is_replaced_by_its_tf_variable():
    with tf.Graph().as_default():
        w = tf.compat.v1.get_variable("w", initializer=[1.0, 2.0], use_resource=True)
        x = tf.compat.v1.placeholder(tf.float32, [2, 2])
        ys = tf.reduce_sum(x * w, axis=1)                           # [2]
        grads = pertower.per_example_gradients(ys, [_StandIn(w)])
        with tf.compat.v1.Session() as sess:
            sess.run(w.initializer)
            values = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
            got = sess.run(grads, {x: values})
    np.testing.assert_allclose(got[0], values)   # d (x_i . w) / d w = x_i, [2, 2]
    assert _checks.weight_list([1.0], "xs") == [1.0]   # others are left to the checks


def test_keras3_variable_without_a_tf_variable_is_refused_with_what_to_do():
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2, 2])
        ys = tf.reduce_sum(x, axis=1)
        with pytest.raises(TypeError, match=r"`xs\[0\]` is a Keras 3 variable \(dense/kernel\)"
                                            r".*import tf_keras as keras.*TF_USE_LEGACY_KERAS=1"):
            pertower.per_example_gradients(ys, [_StandIn(np.ones(2))])

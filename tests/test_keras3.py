"""Keras 3 weights (`keras.Variable`, not TF variables) in `xs`, with a stand-in object
(Keras 3 is recognised by duck typing): replaced by the TF variable behind it, or
refused with what to do. A real Keras 3 network needs TF_USE_LEGACY_KERAS unset when
TensorFlow is imported: tests/eager/test_keras3_weights.py."""

import numpy as np
import pytest
import tensorflow as tf

import pertower
from pertower import _checks

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

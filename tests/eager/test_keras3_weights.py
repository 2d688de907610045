"""Keras 3 weights (`keras.Variable`, not TF variables) in `xs`: a Keras 3 Dense network
on a placeholder, in a graph of its own, its weights passed to pertower as they are,
compared with the one-example loop on the TF variables that hold them (Keras 3 needs
TF_USE_LEGACY_KERAS unset when TensorFlow is imported: tests/eager/conftest.py)."""

import numpy as np
import pytest
import tensorflow as tf

import pertower
from pertower import oracle
from tests.common import assert_all_close


def _keras3():
    """The Keras 3 module; skips the test if it cannot be used."""
    try:
        import keras  # pylint: disable=import-outside-toplevel
    except ImportError as error:
        pytest.skip(f"keras 3 unavailable: `import keras` failed ({error})")
    if not keras.__version__.startswith("3."):
        pytest.skip(f"keras 3 unavailable: keras {keras.__version__} is not Keras 3")
    return keras


def test_keras3_dense_weights_match_the_one_example_loop():
    """The Keras 3 network's per-example gradients ("auto" and "towers") and norms."""
    keras = _keras3()
    B = 5
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        y = tf.compat.v1.placeholder(tf.float32, [None, 1], name="y")
        net = keras.Sequential([keras.layers.Dense(4, activation="tanh"),
                                keras.layers.Dense(1)])
        cost = (net(x) - y) ** 2                                        # [B, 1]
        weights = list(net.trainable_weights)
        assert not isinstance(weights[0], tf.Variable), type(weights[0])  # Keras 3 variables
        tf_variables = [w.value for w in weights]
        grads = pertower.per_example_gradients(cost, weights, batch_size=B)
        towers = pertower.per_example_gradients(cost, weights, batch_size=B, method="towers")
        norms = pertower.per_example_norms(cost, weights, batch_size=B)
        rng = np.random.RandomState(0)
        feed = {x: rng.randn(B, 3).astype(np.float32), y: rng.randn(B, 1).astype(np.float32)}
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            want = oracle.loop_per_example_gradients(sess, cost, tf_variables, feed)
            got_auto, got_towers, got_norms = sess.run([grads, towers, norms], feed)
    want_norms = np.sqrt(sum(np.sum(w.reshape(B, -1) ** 2, axis=1) for w in want))
    failed = []
    for what, got, expected in [("auto", got_auto, want), ("towers", got_towers, want),
                                ("norms", [got_norms], [want_norms])]:
        try:
            assert_all_close(got, expected, kind="tight", what=f"keras 3 {what}")
        except AssertionError as error:
            failed.append(str(error))
    assert not failed, "; ".join(failed)

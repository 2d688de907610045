"""Run in a process of its own: legacy graphs under tf.compat.v1.disable_v2_behavior()
(reference variables, v1 control flow), compared with the one-example oracle.

Prints one line per check and 'legacy checks: N passed, M failed'; exits 1 on failure.
"""

import math
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.compat.v1.disable_v2_behavior()

import pertower  # noqa: E402
from pertower import oracle  # noqa: E402
from tests import common  # noqa: E402


def _close(got, want, what, rtol=1e-5, atol=1e-6):
    common.assert_all_close(got, want, rtol, atol, what)


def check_layers_model():
    """tf.compat.v1.layers MLP with reference variables, dropout off, against the loop."""
    with tf.Graph().as_default() as graph:
        tf.compat.v1.set_random_seed(0)
        s = tf.compat.v1.placeholder(tf.float32, [None, 3], name="s")
        h = tf.compat.v1.layers.dense(s, 8, tf.nn.relu, name="h")
        h = tf.compat.v1.layers.dropout(h, 0.5, training=False)
        w = tf.compat.v1.get_variable("scale", [8], initializer=tf.ones_initializer())
        out = tf.compat.v1.layers.dense(h * w, 2, name="out")       # [B, 2]
        ys = tf.reduce_sum(tf.tanh(out), axis=1)                     # [B]
        xs = tf.compat.v1.trainable_variables()
        kinds = {type(v).__name__ for v in xs}
        assert kinds == {"RefVariable"}, f"expected reference variables, got {kinds}"
        grads = pertower.per_example_gradients(ys, xs, batch_size=6)
        micro = pertower.microbatch_gradients(ys, xs, num_microbatches=3, batch_size=6)
        jac = pertower.per_example_jacobians(out, xs, batch_size=6)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            before = sess.run(xs)
            feed = {s: np.random.RandomState(0).randn(6, 3).astype(np.float32)}
            _close(sess.run(grads, feed), oracle.loop_per_example_gradients(sess, ys, xs, feed),
                   "per-example gradients")
            _close(sess.run(micro, feed),
                   oracle.loop_microbatch_gradients(sess, ys, xs, feed, 3), "microbatches")
            _close(sess.run(jac, feed), oracle.loop_per_example_jacobians(sess, out, xs, feed),
                   "Jacobians")
            _close(sess.run(xs), before, "variables unchanged", rtol=0, atol=0)


def check_v1_cond():
    """A v1 tf.cond (Switch/Merge) between the batch and ys."""
    with tf.Graph().as_default() as graph:
        x = tf.compat.v1.placeholder(tf.float32, [None, 2], name="x")
        flag = tf.compat.v1.placeholder_with_default(True, [], name="flag")
        w = tf.compat.v1.get_variable("w", [2, 2], initializer=tf.constant_initializer(
            [[1.0, -2.0], [0.5, 3.0]]))
        h = tf.compat.v1.cond(flag, lambda: tf.matmul(x, w), lambda: tf.matmul(x, 2 * w))
        ys = tf.reduce_sum(h ** 2, axis=1)
        grads = pertower.per_example_gradients(ys, [w], batch=x, batch_size=3)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for value in (True, False):
                feed = {x: np.arange(6, dtype=np.float32).reshape(3, 2), flag: value}
                _close(sess.run(grads, feed),
                       oracle.loop_per_example_gradients(sess, ys, [w], feed, batch=[x]),
                       f"v1 cond, flag={value}")


def check_keras_model():
    """A tf_keras functional model built under disable_v2_behavior()."""
    import tf_keras as keras  # pylint: disable=import-outside-toplevel

    with tf.Graph().as_default() as graph:
        inputs = keras.Input(shape=(4,))
        hidden = keras.layers.Dense(5, activation="tanh")(inputs)
        model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
        ys = model.output[:, 0] ** 2                                  # [B]
        xs = model.trainable_weights
        grads = pertower.per_example_gradients(ys, xs, batch_size=4)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            feed = {inputs: np.random.RandomState(1).randn(4, 4).astype(np.float32)}
            _close(sess.run(grads, feed), oracle.loop_per_example_gradients(sess, ys, xs, feed),
                   "Keras model under v1 behaviour")


def check_hand_checkable_case():
    """The hand-checkable case of scenario 2 with reference variables: exact gradients and cosine."""
    g_value, cos_value = common.run_scenario_2_hand_checkable_case()
    np.testing.assert_array_equal(g_value, [[3, 6, 9], [3, 6, 10]])
    want = 135 / math.sqrt(126 * 145)
    assert abs(cos_value - want) < 1e-6, (cos_value, want)


def main():
    checks = [check_layers_model, check_v1_cond, check_keras_model, check_hand_checkable_case]
    failed = 0
    for check in checks:
        try:
            check()
            print(f"ok   {check.__name__}")
        except Exception as error:  # report every failure, then fail  # noqa: BLE001
            failed += 1
            print(f"FAIL {check.__name__}: {type(error).__name__}: {error}")
    print(f"legacy checks: {len(checks) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Run in a process of its own, with TF_USE_LEGACY_KERAS unset before TensorFlow is
imported (so that `import keras` is Keras 3): a Keras 3 Dense network on a placeholder
in graph mode, its `keras.Variable` weights passed to pertower as they are, compared
with the one-example loop on the TF variables that hold them.

Prints 'keras 3 checks: N passed, 0 failed' (exit 0), 'keras 3 unavailable: REASON'
(exit 0) or the failures (exit 1).
"""

import os
import sys

os.environ.pop("TF_USE_LEGACY_KERAS", None)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
import pertower  # noqa: E402
from pertower import oracle  # noqa: E402
from tests.common import assert_all_close  # noqa: E402


def _keras3():
    """The Keras 3 module, or None and the reason it cannot be used."""
    try:
        import keras  # pylint: disable=import-outside-toplevel
    except ImportError as error:
        return None, f"`import keras` failed ({error})"
    if not keras.__version__.startswith("3."):
        return None, f"keras {keras.__version__} is not Keras 3"
    return keras, None


def main():
    keras, reason = _keras3()
    if keras is None:
        print(f"keras 3 unavailable: {reason}")
        return 0
    # graph mode inside a graph of its own, not for the whole process: the process may
    # be shared with the "eager" checks (process_checks.GROUPS), which need eager on
    with tf.Graph().as_default():
        return _check(keras)


def _check(keras):
    """The Keras 3 network's per-example gradients, towers and norms against the loop
    (in the default graph, graph mode); returns the exit code."""
    B = 5
    x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
    y = tf.compat.v1.placeholder(tf.float32, [None, 1], name="y")
    net = keras.Sequential([keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])
    cost = (net(x) - y) ** 2                                        # [B, 1]
    weights = list(net.trainable_weights)
    assert not isinstance(weights[0], tf.Variable), type(weights[0])  # Keras 3 variables
    tf_variables = [w.value for w in weights]
    grads = pertower.per_example_gradients(cost, weights, batch_size=B)
    towers = pertower.per_example_gradients(cost, weights, batch_size=B, method="towers")
    norms = pertower.per_example_norms(cost, weights, batch_size=B)
    rng = np.random.RandomState(0)
    feed = {x: rng.randn(B, 3).astype(np.float32), y: rng.randn(B, 1).astype(np.float32)}
    checks, failed = 0, []
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        want = oracle.loop_per_example_gradients(sess, cost, tf_variables, feed)
        got_auto, got_towers, got_norms = sess.run([grads, towers, norms], feed)
        want_norms = np.sqrt(sum(np.sum(w.reshape(B, -1) ** 2, axis=1) for w in want))
        for what, got, expected in [("auto", got_auto, want), ("towers", got_towers, want),
                                    ("norms", [got_norms], [want_norms])]:
            checks += 1
            try:
                assert_all_close(got, expected, kind="tight", what=f"keras 3 {what}")
            except AssertionError as error:
                failed.append(str(error))
    for message in failed:
        print("FAILED:", message)
    print(f"keras 3 checks: {checks - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Run in a process of its own: recurrent layers under tf.compat.v1.disable_v2_behavior().
With v1 control flow (the default there) towers refuse the
while loop and name the switch; after tf.compat.v1.enable_control_flow_v2() the same
model matches the one-example oracle.

Prints one line per check and 'legacy control flow checks: N passed, M failed'; exits
1 on failure.
"""

import os
import re
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.compat.v1.disable_v2_behavior()

import tf_keras as keras  # noqa: E402

import pertower  # noqa: E402
from pertower import oracle  # noqa: E402


def _lstm():
    x = tf.compat.v1.placeholder(tf.float32, [None, 4, 2], name="x")
    ys = tf.reduce_sum(keras.layers.Dense(2)(keras.layers.LSTM(3)(x)), axis=1)   # [B]
    return x, ys, tf.compat.v1.trainable_variables()


def check_v1_while_loop_is_refused():
    """v1 control flow: the refusal names the loop op and the switch to use."""
    with tf.Graph().as_default():
        _, ys, xs = _lstm()
        try:
            pertower.per_example_gradients(ys, xs, batch_size=2)
        except NotImplementedError as error:
            pattern = (r"TF1 \(v1\) while loop around op '[\w/]+' \(\w+\).*Python-side loop "
                       r"context.*tf.compat.v1.enable_control_flow_v2\(\)")
            if not re.search(pattern, str(error)):
                raise AssertionError(f"unexpected message: {error}") from None
            return
        raise AssertionError("v1 while loop was not refused")


def check_lstm_with_control_flow_v2_matches_oracle():
    """enable_control_flow_v2() under disable_v2_behavior(): LSTM against the loop."""
    tf.compat.v1.enable_control_flow_v2()
    try:
        with tf.Graph().as_default() as graph:
            tf.compat.v1.set_random_seed(3)
            x, ys, xs = _lstm()
            loop = oracle.SliceLoop(ys, xs)   # before the session runs (while_v2 edits ops)
            grads = pertower.per_example_gradients(ys, xs, batch_size=3)
            with tf.compat.v1.Session(graph=graph) as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                feed = {x: np.random.RandomState(0).randn(3, 4, 2).astype(np.float32)}
                got, want = sess.run(grads, feed), loop.run(sess, feed, 3)
        for k, (g, w) in enumerate(zip(got, want)):
            if g.shape != w.shape or not np.allclose(g, w, rtol=1e-4, atol=1e-5):
                raise AssertionError(f"weight {k}: max error {np.max(np.abs(g - w)):.3g}")
    finally:
        tf.compat.v1.disable_control_flow_v2()


def main():
    checks = [check_v1_while_loop_is_refused, check_lstm_with_control_flow_v2_matches_oracle]
    failed = 0
    for check in checks:
        try:
            check()
            print(f"ok   {check.__name__}")
        except Exception as error:  # pylint: disable=broad-except
            failed += 1
            print(f"FAIL {check.__name__}: {type(error).__name__}: {error}")
    print(f"legacy control flow checks: {len(checks) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Run in a process of its own: with eager execution on, pertower refuses and says how
to switch to graph mode. Prints 'eager refusal checks: N passed'; exits 1 on failure."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

import pertower  # noqa: E402


def main():
    assert tf.executing_eagerly()
    w = tf.Variable([1.0, 2.0])
    x = tf.constant([[1.0, 2.0], [3.0, 4.0]])
    checks = [
        lambda: pertower.per_example_gradients(tf.reduce_sum(x * w, axis=1), [w], batch_size=2),
        lambda: pertower.microbatch_gradients(x[:, 0], [w], num_microbatches=2),
    ]
    passed = 0
    for check in checks:
        try:
            check()
        except RuntimeError as error:
            text = str(error)
            if "eager execution is on" in text and "disable_eager_execution()" in text:
                passed += 1
                continue
            print("wrong message:", text)
        else:
            print("no error raised")
    print(f"eager refusal checks: {passed} passed")
    return 0 if passed == len(checks) else 1


if __name__ == "__main__":
    sys.exit(main())

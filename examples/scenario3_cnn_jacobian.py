"""Scenario 3: d y / d theta of a small CNN, per example.

The model Conv2D(16, 5, "same", elu) -> Flatten -> Dense(128, relu) -> Dense(1) on
x [None, 32, 32, 1]: the derivative of each example's output with respect to every
weight, [B, 1, *w.shape], as tensors to `sess.run`, with no optimizer. Then the same
model with a 3-output head, whose per-example Jacobian is [B, 3, *w.shape]: one row per
output.

Run:  python examples/scenario3_cnn_jacobian.py [--batch-size B]    (B = 8 by default;
      the one-example loop runs 4 B backward passes: a small B makes a quick check)
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--batch-size", type=int, default=8, metavar="B",
                    help="examples in the batch (default 8)")
B = parser.parse_args().batch_size
if B < 1:
    parser.error(f"--batch-size must be a positive integer, got {B}")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras as keras  # noqa: E402

import pertower  # noqa: E402
from pertower import oracle  # noqa: E402

tf.compat.v1.disable_eager_execution()


def cnn(outputs):
    """The scenario's CNN with `outputs` units in the last layer."""
    return keras.Sequential([
        keras.layers.Conv2D(16, 5, padding="same", activation="elu",
                            input_shape=(32, 32, 1)),
        keras.layers.Flatten(),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(outputs),
    ])


x = tf.compat.v1.placeholder(tf.float32, [None, 32, 32, 1], name="x")
model = cnn(1)
model_3 = cnn(3)
y = model(x)                                                    # [B, 1]
y_3 = model_3(x)                                                # [B, 3]

jac = pertower.per_example_jacobians(y, model.trainable_weights, batch_size=B)
jac_3 = pertower.per_example_jacobians(y_3, model_3.trainable_weights, batch_size=B)
norms = pertower.global_norms(jac)                              # [B]: |dy/dtheta| per example

feed = {x: np.random.default_rng(0).normal(size=(B, 32, 32, 1)).astype(np.float32)}
with tf.compat.v1.Session() as sess:
    sess.run(tf.compat.v1.global_variables_initializer())
    jac_value, jac_3_value, norms_value = sess.run([jac, jac_3, norms], feed)
    # The slow way: one sess.run per example (of K gradients for K outputs).
    loop = oracle.loop_per_example_jacobians(sess, y, model.trainable_weights, feed)
    loop_3 = oracle.loop_per_example_jacobians(sess, y_3, model_3.trainable_weights, feed)

print(f"dy/dtheta per example, {B} examples:")
for w, j, j3 in zip(model.trainable_weights, jac_value, jac_3_value):
    print(f"  {w.name:<22} weight {str(tuple(w.shape)):<15} "
          f"1 output: {str(j.shape):<22} 3 outputs: {j3.shape}")
print("|dy/dtheta| for each example:", np.array2string(norms_value, precision=3))
print("d y_3[0, :] / d (last bias), one row per output:\n", jac_3_value[-1][0])

for got, want in zip(jac_value + jac_3_value, loop + loop_3):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * max(1.0, np.abs(want).max()))
print(f"OK: per-example Jacobians (1 and 3 outputs) match the one-example loop "
      f"({B} examples, {len(jac_value)} weights)")

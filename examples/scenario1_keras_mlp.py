"""Scenario 1: per-example loss gradients of a Keras network.

A Keras MLP `net` on placeholders x [None, n_in] and y [None, 1], an unreduced cost
(net(x) - y) ** 2 with one value per example, and for every example the list of
gradients of its cost with respect to every weight: [B, *w.shape] per weight.

Run:  python examples/scenario1_keras_mlp.py
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras as keras  # noqa: E402

import pertower  # noqa: E402
from pertower import oracle  # noqa: E402

tf.compat.v1.disable_eager_execution()

B, n_in = 8, 10

# The user's model, as it is: a Keras MLP applied to placeholders.
net = keras.Sequential([
    keras.layers.Dense(32, activation="tanh", input_shape=(n_in,)),
    keras.layers.Dense(16, activation="relu"),
    keras.layers.Dense(1),
])
x = tf.compat.v1.placeholder(tf.float32, [None, n_in], name="x")
y = tf.compat.v1.placeholder(tf.float32, [None, 1], name="y")
cost = (net(x) - y) ** 2                                        # [B, 1]

# One call: a list with one [B, *w.shape] tensor per weight, and each example's norm.
grads = pertower.per_example_gradients(cost, net.trainable_weights, batch_size=B)
norms = pertower.global_norms(grads)                            # [B]

rng = np.random.default_rng(0)
feed = {x: rng.normal(size=(B, n_in)).astype(np.float32),
        y: rng.normal(size=(B, 1)).astype(np.float32)}

with tf.compat.v1.Session() as sess:
    sess.run(tf.compat.v1.global_variables_initializer())
    per_example, per_example_norms = sess.run([grads, norms], feed)
    # The slow way, for comparison: one sess.run of tf.gradients per example.
    loop = oracle.loop_per_example_gradients(sess, cost, net.trainable_weights, feed)

for w, g in zip(net.trainable_weights, per_example):
    print(f"{w.name:<28} weight {str(tuple(w.shape)):<10} per-example gradient {g.shape}")
print("per-example gradient norms:", np.array2string(per_example_norms, precision=4))

for g, want in zip(per_example, loop):
    np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-5 * max(1.0, np.abs(want).max()))
np.testing.assert_allclose(
    per_example_norms, np.sqrt(sum((w.reshape(B, -1) ** 2).sum(axis=1) for w in loop)),
    rtol=1e-4, atol=1e-5)
print(f"OK: per-example gradients match the one-example loop ({B} examples, "
      f"{len(per_example)} weights)")

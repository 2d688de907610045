"""Scenario 2: the gradients of two batches, and their cosine.

An MLP `f` built with `tf.compat.v1.layers.dense` on s [None, 3], with a scalar output
per example. Two batches s1 and s2 of n examples each go through the network as one
concatenation [2n, 3]; `microbatch_gradients(..., num_microbatches=2)` makes one tower
per batch, so g1 and g2 (each summed over its batch) and their cosine come out of the
same `sess.run`.

Part 1 is a case small enough to check by hand (one tanh unit with a zero kernel:
g1 = [3, 6, 9], g2 = [3, 6, 10]); part 2 is a small MLP.

Run:  python examples/scenario2_two_batches_cosine.py
"""

import os
import sys
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # tf.compat.v1.layers needs Keras 2
if os.environ["TF_USE_LEGACY_KERAS"] not in ("1", "true", "True"):   # what TensorFlow reads
    sys.exit(f"scenario2_two_batches_cosine.py: tf.compat.v1.layers needs Keras 2, but "
             f"TF_USE_LEGACY_KERAS={os.environ['TF_USE_LEGACY_KERAS']!r}: set it to 1 or unset it.")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import pertower  # noqa: E402
from pertower import oracle  # noqa: E402

tf.compat.v1.disable_eager_execution()
warnings.filterwarnings("ignore", message=r".*tf\.layers\.dense.* is deprecated")
dense = tf.compat.v1.layers.dense


def two_batch_gradients(f_of_s, s, weights, n):
    """g1 and g2, the gradients of sum(f) over s[:n] and over s[n:]: two lists
    of [*w.shape], and their cosine (a scalar tensor)."""
    g = pertower.microbatch_gradients(f_of_s, weights, batch=s, num_microbatches=2,
                                      batch_size=2 * n)       # [2, *w.shape] per weight
    g1 = [w[0] for w in g]
    g2 = [w[1] for w in g]
    return g, g1, g2, pertower.cosine_similarity(g1, g2)


def hand_checkable_case():
    """One dense(s, 1, tanh) layer with a zero kernel: g1 = [3, 6, 9], g2 = [3, 6, 10]."""
    S1 = np.array([[1, 2, 3], [2, 4, 6]], np.float32)
    S2 = np.array([[1, 2, 3], [2, 4, 7]], np.float32)
    with tf.Graph().as_default():
        s1 = tf.compat.v1.placeholder(tf.float32, [None, 3], name="s1")
        s2 = tf.compat.v1.placeholder(tf.float32, [None, 3], name="s2")
        s = tf.concat([s1, s2], axis=0)                        # [2n, 3]
        f = dense(s, 1, activation=tf.tanh, name="f",
                  kernel_initializer=tf.compat.v1.zeros_initializer())  # [2n, 1]
        kernel = tf.compat.v1.trainable_variables("f/kernel")[0]
        _, g1, g2, cos = two_batch_gradients(f, s, [kernel], n=2)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            g1_value, g2_value, cos_value = sess.run([g1[0], g2[0], cos], {s1: S1, s2: S2})

    print("Hand-checkable case: dense(s, 1, tanh), zero kernel")
    print("  g1 (kernel) =", g1_value.ravel(), "  expected [3. 6. 9.]")
    print("  g2 (kernel) =", g2_value.ravel(), "  expected [3. 6. 10.]")
    expected_cos = 135 / np.sqrt(126 * 145)
    print(f"  cosine = {cos_value:.7f}   expected 135 / sqrt(126 * 145) = {expected_cos:.7f}")
    np.testing.assert_allclose(g1_value.ravel(), [3, 6, 9], rtol=1e-6)
    np.testing.assert_allclose(g2_value.ravel(), [3, 6, 10], rtol=1e-6)
    np.testing.assert_allclose(cos_value, expected_cos, rtol=1e-6)


def mlp_case(n=8):
    """An MLP 3 -> 32 -> 16 -> 1 on two batches of n examples, against the loop."""
    rng = np.random.default_rng(0)
    S1 = rng.normal(size=(n, 3)).astype(np.float32)
    S2 = rng.normal(size=(n, 3)).astype(np.float32)
    with tf.Graph().as_default():
        s1 = tf.compat.v1.placeholder(tf.float32, [None, 3], name="s1")
        s2 = tf.compat.v1.placeholder(tf.float32, [None, 3], name="s2")
        s = tf.concat([s1, s2], axis=0)                        # [2n, 3]
        with tf.compat.v1.variable_scope("f"):
            h = dense(s, 32, activation=tf.tanh)
            h = dense(h, 16, activation=tf.nn.relu)
            f = dense(h, 1)                                    # [2n, 1]
        weights = tf.compat.v1.trainable_variables("f")
        g, g1, g2, cos = two_batch_gradients(f, s, weights, n)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            g_value, cos_value = sess.run([g, cos], {s1: S1, s2: S2})
            # The slow way: one sess.run of tf.gradients per batch (s itself is fed).
            loop = oracle.loop_microbatch_gradients(
                sess, f, weights, {s: np.concatenate([S1, S2])}, num_microbatches=2)

    print(f"MLP 3 -> 32 -> 16 -> 1, two batches of {n}:")
    for w, value in zip(weights, g_value):
        print(f"  {w.name:<26} {str(tuple(w.shape)):<9} -> g1, g2 stacked {value.shape}")
    flat1 = np.concatenate([w[0].ravel() for w in loop])
    flat2 = np.concatenate([w[1].ravel() for w in loop])
    loop_cos = flat1 @ flat2 / (np.linalg.norm(flat1) * np.linalg.norm(flat2))
    print(f"  cosine(g1, g2) = {cos_value:.6f}   (loop: {loop_cos:.6f})")
    for got, want in zip(g_value, loop):
        np.testing.assert_allclose(got, want, rtol=1e-4,
                                   atol=1e-5 * max(1.0, np.abs(want).max()))
    np.testing.assert_allclose(cos_value, loop_cos, rtol=1e-4, atol=1e-6)


hand_checkable_case()
mlp_case()
print("OK: g1, g2 and their cosine match the one-batch-at-a-time loop")

"""The memory guard: pertower's estimate next to the peak TensorFlow traces, and a refusal.

Run: python examples/memory_guard.py   (about 20 s on 2 cores)

For three models it prints the estimate (`pertower.estimate_memory`, made before any
op is built) and the peak of one traced `sess.run` of the per-example gradients
(`benchmarks.traced_memory.traced_peak_bytes`, from this checkout); then a call above a
small `memory_limit` and the words of its refusal.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras as keras  # noqa: E402

import pertower  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
from benchmarks import traced_memory as run_memory  # noqa: E402

tf.compat.v1.disable_eager_execution()
L = keras.layers

MODELS = [
    ("MLP 100-256-256-1", [100], 32,
     lambda: [L.Dense(256, activation="relu"), L.Dense(256, activation="relu"), L.Dense(1)]),
    ("scenario-3 CNN", [32, 32, 1], 8,
     lambda: [L.Conv2D(16, 5, padding="same", activation="elu"), L.Flatten(),
              L.Dense(128, activation="relu"), L.Dense(1)]),
    ("CNN conv-pool-conv-dense", [28, 28, 1], 32,
     lambda: [L.Conv2D(32, 3, activation="relu"), L.MaxPooling2D(),
              L.Conv2D(64, 3, activation="relu"), L.Flatten(), L.Dense(10)]),
]


def estimate_and_trace(layers, shape, B):
    """(MemoryEstimate, traced peak bytes) of per-example gradients of sum(model(x))."""
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None] + shape)
        model = keras.Sequential(layers())
        ys = tf.reduce_sum(model(x), axis=1)                      # [B]
        estimate = pertower.estimate_memory(ys, model.trainable_weights, batch_size=B)
        grads = pertower.per_example_gradients(ys, model.trainable_weights, batch_size=B)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            feed = {x: np.random.RandomState(0).rand(B, *shape).astype(np.float32)}
            peak = run_memory.traced_peak_bytes(sess, grads, feed).peak_bytes
    return estimate, peak


def main():
    print(f"{'model':26s} {'B':>3s} {'result MB':>10s} {'activations MB':>15s} "
          f"{'estimate MB':>12s} {'traced peak MB':>15s}")
    for name, shape, B, layers in MODELS:
        estimate, peak = estimate_and_trace(layers, shape, B)
        print(f"{name:26s} {B:3d} {estimate.result_bytes / 1e6:10.1f} "
              f"{estimate.activation_bytes / 1e6:15.2f} {estimate.total_bytes / 1e6:12.1f} "
              f"{peak / 1e6:15.1f}")
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 100])
        net = keras.Sequential(MODELS[0][3]())
        try:
            pertower.per_example_gradients(tf.reduce_sum(net(x), axis=1),
                                           net.trainable_weights, batch_size=4096,
                                           memory_limit=1e9)
        except ValueError as refusal:
            print("\nRefused:", refusal)


if __name__ == "__main__":
    main()

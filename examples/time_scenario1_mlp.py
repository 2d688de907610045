"""Times per_example_gradients against the one-example loop on the scenario-1 MLP.

The MLP is 100-256-256-1 with cost = (net(x) - y) ** 2, for B = 32 and 128 by default.
For each B it prints the seconds to build the towers and their gradients, and the
median `sess.run` milliseconds of pertower, of the loop of one-example `sess.run`
calls (`pertower.oracle.SliceLoop`), and of one batch gradient (the floor).
`python -m benchmarks` (from a checkout) times every method on both oneDNN settings;
times on a shared machine are noisy.

Run:  python examples/time_scenario1_mlp.py [B ...]
"""

import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras as keras  # noqa: E402

import pertower  # noqa: E402
from pertower import oracle  # noqa: E402

tf.compat.v1.disable_eager_execution()


def median_ms(run, repeats):
    """Median wall milliseconds of `repeats` calls of `run()`, after one warm-up call."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def time_batch_size(B):
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        x = tf.compat.v1.placeholder(tf.float32, [None, 100])
        y = tf.compat.v1.placeholder(tf.float32, [None, 1])
        net = keras.Sequential([keras.layers.Dense(256, activation="relu"),
                                keras.layers.Dense(256, activation="relu"),
                                keras.layers.Dense(1)])
        cost = (net(x) - y) ** 2                                       # [B, 1]
        start = time.perf_counter()
        towers = pertower.build_towers(cost, net.trainable_weights, batch_size=B)
        towers_seconds = time.perf_counter() - start
        start = time.perf_counter()
        grads = towers.gradients()                                    # [B, *w.shape] each
        gradients_seconds = time.perf_counter() - start
        loop = oracle.SliceLoop(cost, net.trainable_weights)
        sess.run(tf.compat.v1.global_variables_initializer())
        rng = np.random.default_rng(0)
        feed = {x: rng.normal(size=(B, 100)).astype(np.float32),
                y: rng.normal(size=(B, 1)).astype(np.float32)}
        pertower_ms = median_ms(lambda: sess.run(grads, feed), 21)
        loop_ms = median_ms(lambda: loop.run(sess, feed, B), 7)
        batch_ms = median_ms(lambda: sess.run(loop.gradients, feed), 21)
    print(f"B={B:4d}  build: towers {towers_seconds:.2f} s + gradients "
          f"{gradients_seconds:.2f} s  |  per_example_gradients {pertower_ms:.1f} ms, "
          f"loop {loop_ms:.1f} ms ({loop_ms / pertower_ms:.1f}x faster), "
          f"batch gradient {batch_ms:.2f} ms")


if __name__ == "__main__":
    for size in [int(a) for a in sys.argv[1:]] or [32, 128]:
        time_batch_size(size)

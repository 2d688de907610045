"""Per-example gradients of a text model: Embedding -> LSTM (a while loop) -> Dense.

The LSTM reads its weights inside the body of a TF2 `While` op, and the embedding is
read by gathering rows. pertower gives every tower its own weight copies inside the
loop body, and returns the embedding's gradients sparse on request (only the rows each
example looked up). Everything is checked against the one-example loop, and the build
and run times are printed.

Run:  python examples/recurrent_and_embedding.py [--batch-size 16] [--devices 2]
"""

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras as keras  # noqa: E402

import pertower  # noqa: E402
from pertower import oracle  # noqa: E402

tf.compat.v1.disable_eager_execution()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--devices", type=int, default=1,
                        help="virtual CPU devices to place the towers on round-robin")
    args = parser.parse_args()
    B, vocabulary, steps = args.batch_size, 50, 6

    ids = tf.compat.v1.placeholder(tf.int32, [None, steps], name="ids")
    labels = tf.compat.v1.placeholder(tf.int32, [None], name="labels")
    embedding = keras.layers.Embedding(vocabulary, 8)
    lstm = keras.layers.LSTM(16)
    head = keras.layers.Dense(3)
    logits = head(lstm(embedding(ids)))                                   # [B, 3]
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)  # [B]
    weights = embedding.trainable_weights + lstm.trainable_weights + head.trainable_weights

    loop = oracle.SliceLoop(loss, weights)   # the slow reference, built before any run
    devices = [f"/device:CPU:{d}" for d in range(args.devices)] if args.devices > 1 else None
    start = time.perf_counter()
    grads = pertower.per_example_gradients(loss, weights, batch_size=B, sparse=True,
                                           devices=devices)
    build_seconds = time.perf_counter() - start
    table = grads[0]                            # PerExampleIndexedSlices for the embedding
    dense_table = table.to_dense()              # [B, vocabulary, 8]

    rng = np.random.default_rng(0)
    feed = {ids: rng.integers(0, vocabulary, size=(B, steps)), labels: rng.integers(0, 3, B)}
    config = tf.compat.v1.ConfigProto(device_count={"CPU": max(1, args.devices)})
    with tf.compat.v1.Session(config=config) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        start = time.perf_counter()
        sess.run([table, grads[1:]], feed)    # the first run optimizes the new graph
        first_seconds = time.perf_counter() - start
        start = time.perf_counter()
        rows, dense_rest = sess.run([table, grads[1:]], feed)
        run_seconds = time.perf_counter() - start
        full_table = sess.run(dense_table, feed)
        loop.run(sess, feed, B)                                           # warm-up
        start = time.perf_counter()
        want = loop.run(sess, feed, B)
        loop_seconds = time.perf_counter() - start

    print(f"embedding rows: values {rows.values.shape}, indices {rows.indices.shape}, "
          f"example_ids {rows.example_ids.shape}, dense shape {tuple(rows.dense_shape)}")
    for w, g in zip(weights[1:], dense_rest):
        print(f"{w.name:<36} per-example gradient {g.shape}")
    errors = [np.max(np.abs(g - w)) for g, w in zip([full_table] + dense_rest, want)]
    print(f"largest difference from the one-example loop: {max(errors):.2e}")
    print(f"build {build_seconds:.2f} s; first sess.run {first_seconds:.2f} s; then "
          f"{1000 * run_seconds:.1f} ms; loop of {B} sess.run calls {1000 * loop_seconds:.1f} ms")
    for g, w in zip([full_table] + dense_rest, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
    print("OK")


if __name__ == "__main__":
    main()

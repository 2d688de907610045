"""A TF1 script as written before TensorFlow 2: DP-SGD on an LSTM with v1 while loops.

Everything here is TF1 style under `tf.compat.v1.disable_v2_behavior()`: reference
variables from `tf.compat.v1.get_variable`, an embedding looked up with
`tf.nn.embedding_lookup`, and `tf.compat.v1.nn.dynamic_rnn` with `sequence_length`
(a TF1 while loop: Enter/Exit/NextIteration/LoopCond ops). pertower works on such a
graph as it is: the weights read inside the loop get their per-op rules per step (from a
copy of the loop), like the others (`pertower.explain` prints which).

The script prints the plan, checks pertower's per-example gradients and norms against
the one-example loop (`pertower.oracle`), then trains on synthetic sequences (the
label says whether the sequence's tokens sum above the median) with
`pertower.DPOptimizer` (per-example clipping and Gaussian noise), a tqdm bar showing
the loss.

Run:  python examples/legacy_lstm.py [--batch-size 8] [--steps 80]
"""

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
if os.environ["TF_USE_LEGACY_KERAS"] not in ("1", "true", "True"):   # what TensorFlow reads
    sys.exit(f"legacy_lstm.py: tf.compat.v1.nn.rnn_cell needs Keras 2, but "
             f"TF_USE_LEGACY_KERAS={os.environ['TF_USE_LEGACY_KERAS']!r}: set it to 1 or unset it.")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tqdm import tqdm  # noqa: E402

tf.compat.v1.disable_v2_behavior()

import pertower  # noqa: E402
from pertower import oracle  # noqa: E402

VOCABULARY, STEPS, EMBEDDING, UNITS = 20, 8, 6, 8


def synthetic_batch(rng, batch_size):
    """Token ids [B, STEPS] (0 pads after each sequence's length), lengths [B], and
    labels [B]: 1 when the sequence's tokens sum above the expected sum."""
    lengths = rng.integers(2, STEPS + 1, size=batch_size)
    ids = rng.integers(1, VOCABULARY, size=(batch_size, STEPS))
    ids[np.arange(STEPS)[None, :] >= lengths[:, None]] = 0
    labels = (ids.sum(axis=1) > lengths * VOCABULARY / 2).astype(np.int32)
    return ids.astype(np.int32), lengths.astype(np.int32), labels


def build_model():
    """The placeholders and the per-example loss [B] of an embedding -> LSTM -> logits."""
    ids = tf.compat.v1.placeholder(tf.int32, [None, STEPS], name="ids")
    lengths = tf.compat.v1.placeholder(tf.int32, [None], name="lengths")
    labels = tf.compat.v1.placeholder(tf.int32, [None], name="labels")
    table = tf.compat.v1.get_variable("embedding", [VOCABULARY, EMBEDDING])
    embedded = tf.nn.embedding_lookup(table, ids)                        # [B, STEPS, E]
    cell = tf.compat.v1.nn.rnn_cell.LSTMCell(UNITS)
    _, state = tf.compat.v1.nn.dynamic_rnn(cell, embedded, sequence_length=lengths,
                                           dtype=tf.float32)
    w = tf.compat.v1.get_variable("out_w", [UNITS, 2])
    b = tf.compat.v1.get_variable("out_b", [2], initializer=tf.zeros_initializer())
    logits = tf.matmul(state.h, w) + b                                   # [B, 2]
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels,
                                                          logits=logits)  # [B]
    return ids, lengths, labels, loss


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=80, help="training steps")
    args = parser.parse_args()
    B = args.batch_size
    rng = np.random.default_rng(0)
    tf.compat.v1.set_random_seed(0)

    ids, lengths, labels, loss = build_model()
    weights = tf.compat.v1.trainable_variables()
    print(pertower.explain(loss, weights, batch_size=B))

    loop = oracle.SliceLoop(loss, weights)        # the slow reference, built first
    start = time.perf_counter()
    grads = pertower.per_example_gradients(loss, weights, batch_size=B)   # [B, *w.shape]
    norms = pertower.per_example_norms(loss, weights, batch_size=B)       # [B]
    build_seconds = time.perf_counter() - start
    dp = pertower.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer(1.0),
                              l2_norm_clip=1.0, noise_multiplier=0.3, seed=0)
    train_op = dp.minimize(loss, var_list=weights, batch_size=B)
    mean_loss = tf.reduce_mean(loss)

    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        batch_ids, batch_lengths, batch_labels = synthetic_batch(rng, B)
        feed = {ids: batch_ids, lengths: batch_lengths, labels: batch_labels}
        got_grads, got_norms = sess.run([grads, norms], feed)   # (the first run sets up)
        start = time.perf_counter()
        sess.run([grads, norms], feed)
        run_seconds = time.perf_counter() - start
        want_grads = loop.run(sess, feed, B)
        want_norms = np.sqrt(sum(np.sum(g.reshape(B, -1) ** 2, axis=1) for g in want_grads))
        print("per-example gradient norms:", np.array2string(got_norms, precision=3))
        print(f"lengths:                    {batch_lengths}")
        worst = max(float(np.max(np.abs(g - w))) for g, w in zip(got_grads, want_grads))
        if worst > 1e-4 or not np.allclose(got_norms, want_norms, rtol=1e-4, atol=1e-5):
            print(f"MISMATCH: largest difference from the one-example loop {worst:.3g}")
            return 1
        print(f"OK: per-example gradients and norms match the one-example loop "
              f"({B} examples, {len(weights)} weights; largest difference {worst:.2g})")
        print(f"build {build_seconds:.2f} s, one run (gradients and norms) "
              f"{run_seconds * 1000:.1f} ms")

        losses = []
        with tqdm(range(args.steps), desc="DP-SGD", unit="step") as bar:
            for _ in bar:
                batch_ids, batch_lengths, batch_labels = synthetic_batch(rng, B)
                feed = {ids: batch_ids, lengths: batch_lengths, labels: batch_labels}
                _, value = sess.run([train_op, mean_loss], feed)
                losses.append(value)
                bar.set_postfix(loss=f"{value:.3f}")
        first, last = np.mean(losses[:5]), np.mean(losses[-5:])
        print(f"trained {args.steps} DP-SGD steps: mean loss {first:.3f} (first 5) -> "
              f"{last:.3f} (last 5)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

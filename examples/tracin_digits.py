"""TracIn on handwritten digits: which training images helped or hurt a test prediction.

Trains a small Keras 2 CNN with SGD on scikit-learn's bundled digits (no download),
saving a checkpoint after every epoch. For a few test digits it then scores every
training image with TracInCP (Pruthi et al. 2020, arXiv 2002.08484):

    TracIn(train, test) = sum over checkpoints c of  lr * <grad loss(train), grad loss(test)>

using `pertower.per_example_gradients` on chunks of 100 training images,
`pertower.tracin` and `pertower.tracin_over_checkpoints`. Proponents (largest positive
scores) pushed the test image's loss down, opponents (most negative) pushed it up. The
script checks the scores against the one-example loop, prints the labels of each test
digit's proponents and opponents, and saves a PNG grid: per row the test image, its
top proponents, then its top opponents.

Run:  python examples/tracin_digits.py [--output tracin_digits.png]    (about 30 s)
      python examples/tracin_digits.py --quick      (fewer checkpoints and images)
      --top N: N proponents and N opponents per test digit (default 4)
"""

import argparse
import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import pertower  # noqa: E402
from pertower import oracle  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import digits_common  # noqa: E402  pylint: disable=wrong-import-position

tf.compat.v1.disable_eager_execution()

TEST_DIGITS = (1, 3, 7, 8)
TOP = 4                # proponents and opponents shown per test digit (default of --top)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="tracin_digits.png", help="PNG path")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--learning-rate", type=float, default=0.1)
    parser.add_argument("--batch-size", type=int, default=50)
    parser.add_argument("--chunk", type=int, default=100,
                        help="training images per per-example-gradient run (divides 1500)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--top", type=int, default=TOP, metavar="N",
                        help=f"proponents and opponents shown per test digit (default {TOP})")
    parser.add_argument("--quick", action="store_true",
                        help="2 short checkpoints, 100 training images in chunks of 50 "
                             "(a smoke test)")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    top = args.top
    if top < 1:
        raise SystemExit(f"--top must be a positive integer, got {top}")
    x_train, y_train, x_test, y_test = digits_common.load_digits(args.seed)
    # the first test image of each chosen digit
    test_index = np.array([np.flatnonzero(y_test == d)[0] for d in TEST_DIGITS])
    chunk = 50 if args.quick else args.chunk
    if len(y_train) % chunk:
        raise SystemExit(f"--chunk {chunk} must divide the {len(y_train)} training images")
    n_scored = 2 * chunk if args.quick else len(y_train)

    with tf.Graph().as_default() as graph:
        digits_common.seed_graph(args.seed)
        x = tf.compat.v1.placeholder(tf.float32, [None, 8, 8, 1], name="train_images")
        y = tf.compat.v1.placeholder(tf.int32, [None], name="train_labels")
        x_t = tf.compat.v1.placeholder(tf.float32, [None, 8, 8, 1], name="test_images")
        y_t = tf.compat.v1.placeholder(tf.int32, [None], name="test_labels")
        model = digits_common.build_cnn()
        weights = model.trainable_weights
        logits, test_logits = model(x), model(x_t)
        loss = digits_common.per_example_loss(logits, y)                    # [B]
        test_loss = digits_common.per_example_loss(test_logits, y_t)        # [T]
        train_op = tf.compat.v1.train.GradientDescentOptimizer(args.learning_rate).minimize(
            tf.reduce_mean(loss), var_list=weights)
        # per-example gradients of a chunk of training images and of the test images
        train_grads = pertower.per_example_gradients(loss, weights, batch_size=chunk)
        test_grads = pertower.per_example_gradients(test_loss, weights,
                                                    batch_size=len(TEST_DIGITS))
        scores = pertower.tracin(train_grads, test_grads)                   # [chunk, T]
        saver = tf.compat.v1.train.Saver(weights, max_to_keep=None)
        sess = tf.compat.v1.Session(graph=graph)
        sess.run(tf.compat.v1.global_variables_initializer())

        # train, saving a checkpoint per epoch (two per quick epoch of 30 steps)
        rng = np.random.RandomState(args.seed)
        checkpoints, directory = [], tempfile.TemporaryDirectory()
        steps_per_checkpoint = 15 if args.quick else len(y_train) // args.batch_size
        epochs = 1 if args.quick else args.epochs
        step = 0
        for _ in range(epochs):
            for index in digits_common.batches(len(y_train), args.batch_size, rng):
                sess.run(train_op, {x: x_train[index], y: y_train[index]})
                step += 1
                if step % steps_per_checkpoint == 0:
                    checkpoints.append(saver.save(sess, os.path.join(directory.name, "ckpt"),
                                                  global_step=step))
        acc = digits_common.accuracy(sess, logits, x, x_test, y_test)
        print(f"trained {step} SGD steps (lr {args.learning_rate}), test accuracy "
              f"{acc:.3f}; {len(checkpoints)} checkpoints")

        # TracIn over all checkpoints, one feed per chunk of training images
        test_feed = {x_t: x_test[test_index], y_t: y_test[test_index]}
        feeds = [{x: x_train[s:s + chunk], y: y_train[s:s + chunk], **test_feed}
                 for s in range(0, n_scored, chunk)]
        rates = [args.learning_rate] * len(checkpoints)
        influence = np.concatenate(pertower.tracin_over_checkpoints(
            sess, scores, checkpoints, rates, saver, feeds))                 # [N, T]

        # check: at the last checkpoint, the scores of 6 training images equal the dot
        # products of the one-example loop's gradients
        saver.restore(sess, checkpoints[-1])
        loop_train = oracle.loop_per_example_gradients(
            sess, loss, weights, {x: x_train[:6], y: y_train[:6]})
        loop_test = oracle.loop_per_example_gradients(sess, test_loss, weights, test_feed)
        want = sum(np.tensordot(a, b, axes=[list(range(1, a.ndim))] * 2)
                   for a, b in zip(loop_train, loop_test))                   # [6, T]
        got = sess.run(scores, feeds[0])[:6]
        if not np.allclose(got, want, rtol=1e-4, atol=1e-6):
            print(f"FAILED: TracIn scores differ from the one-example loop by "
                  f"{np.max(np.abs(got - want)):.3g}")
            return 1
        print(f"OK: TracIn scores match the one-example loop (6 training x "
              f"{len(TEST_DIGITS)} test images)")
        sess.close()
        directory.cleanup()

    same_label = 0
    fig, axes = plt.subplots(len(TEST_DIGITS), 1 + 2 * top,
                             figsize=(1.3 * (1 + 2 * top), 1.5 * len(TEST_DIGITS)))
    for row, t in enumerate(test_index):
        order = np.argsort(influence[:, row])
        proponents, opponents = order[::-1][:top], order[:top]
        same_label += int(np.sum(y_train[proponents] == y_test[t]))
        print(f"test digit {y_test[t]}: proponents are {y_train[proponents].tolist()}, "
              f"opponents are {y_train[opponents].tolist()}")
        panels = [(x_test[t], f"test: {y_test[t]}", "black")]
        panels += [(x_train[i], f"{y_train[i]}  {influence[i, row]:+.2f}", "green")
                   for i in proponents]
        panels += [(x_train[i], f"{y_train[i]}  {influence[i, row]:+.2f}", "red")
                   for i in opponents]
        for col, (image, title, color) in enumerate(panels):
            axis = axes[row, col]
            axis.imshow(image[..., 0], cmap="gray_r", vmin=0, vmax=1)
            axis.set_title(title, fontsize=8, color=color)
            axis.set_xticks([])
            axis.set_yticks([])
    fig.suptitle(f"TracIn on digits: test image, {top} proponents (green), {top} "
                 f"opponents (red); label and score", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.output, dpi=100)
    plt.close(fig)
    print(f"proponents sharing the test digit's label: {same_label}/{top * len(TEST_DIGITS)}")
    print(f"scored {n_scored} training images; saved {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

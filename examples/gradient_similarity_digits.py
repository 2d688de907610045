"""Gradient similarity between digit classes: a class-by-class heatmap of gradient cosines.

Trains a small Keras 2 CNN with SGD on scikit-learn's bundled digits (no download),
then takes balanced batches of training images (10 per class by default), computes every
image's loss gradient with `pertower.per_example_gradients`, the cosine between every
two images' gradients with `pertower.similarity_matrix`, and averages it over class
pairs with `pertower.class_similarity` (an image is not compared with itself). Entry
(c, d) is the mean cosine between the gradients of a digit c and a digit d: large on
the diagonal when a class's examples push the weights the same way, negative between
classes whose gradients pull against each other. The script checks the cosines
against the one-example loop and saves the heatmap as a PNG.

Run:  python examples/gradient_similarity_digits.py [--output similarity.png]  (~15 s)
      python examples/gradient_similarity_digits.py --quick
"""

import argparse
import os
import sys

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



def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="gradient_similarity_digits.png", help="PNG path")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batches", type=int, default=4,
                        help="balanced batches of 100 images averaged")
    parser.add_argument("--learning-rate", type=float, default=0.1)
    parser.add_argument("--per-class", type=int, default=10,
                        help="images of each class per batch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="30 training steps, one batch of 3 images per class "
                             "(a smoke test)")
    return parser.parse_args(argv)


def balanced_batches(labels, count, per_class, rng):
    """`count` index arrays, `per_class` images of each class each, no image used twice."""
    shuffled = [rng.permutation(np.flatnonzero(labels == c))
                for c in range(digits_common.NUM_CLASSES)]
    return [np.concatenate([idx[k * per_class:(k + 1) * per_class] for idx in shuffled])
            for k in range(count)]


def main(argv=None):
    args = parse_args(argv)
    x_train, y_train, x_test, y_test = digits_common.load_digits(args.seed)
    num_batches = 1 if args.quick else args.batches
    per_class = 3 if args.quick else args.per_class
    B = per_class * digits_common.NUM_CLASSES                                # 100

    with tf.Graph().as_default() as graph:
        digits_common.seed_graph(args.seed)
        x = tf.compat.v1.placeholder(tf.float32, [None, 8, 8, 1], name="images")
        y = tf.compat.v1.placeholder(tf.int32, [None], name="labels")
        model = digits_common.build_cnn()
        weights = model.trainable_weights
        logits = model(x)
        loss = digits_common.per_example_loss(logits, y)                    # [B]
        train_op = tf.compat.v1.train.GradientDescentOptimizer(args.learning_rate).minimize(
            tf.reduce_mean(loss), var_list=weights)
        grads = pertower.per_example_gradients(loss, weights, batch_size=B)  # [B, *w.shape]
        cosines = pertower.similarity_matrix(grads, metric="cosine")       # [B, B]
        by_class = pertower.class_similarity(cosines, y, digits_common.NUM_CLASSES)  # [10, 10]
        sess = tf.compat.v1.Session(graph=graph)
        sess.run(tf.compat.v1.global_variables_initializer())

        rng = np.random.RandomState(args.seed)
        steps = 0
        for _ in range(1 if args.quick else args.epochs):
            for index in digits_common.batches(len(y_train), 50, rng):
                if args.quick and steps == 30:
                    break
                sess.run(train_op, {x: x_train[index], y: y_train[index]})
                steps += 1
        acc = digits_common.accuracy(sess, logits, x, x_test, y_test)
        print(f"trained {steps} SGD steps, test accuracy {acc:.3f}")

        # every batch holds per_class images of each class, so every class block has the
        # same number of pairs in every batch and the mean of the means is the mean
        batch_indices = balanced_batches(y_train, num_batches, per_class, rng)
        matrices, first_cosines = [], None
        for index in batch_indices:
            feed = {x: x_train[index], y: y_train[index]}
            matrix, cos = sess.run([by_class, cosines], feed)
            matrices.append(matrix)
            first_cosines = cos if first_cosines is None else first_cosines
        heat = np.mean(matrices, axis=0)                                      # [10, 10]

        # check: the cosines of 6 images (two per class of 0, 1, 2) against the loop
        picks = np.concatenate([np.arange(c * per_class, c * per_class + 2) for c in range(3)])
        index = batch_indices[0][picks]
        loop = oracle.loop_per_example_gradients(sess, loss, weights,
                                                 {x: x_train[index], y: y_train[index]})
        flat = np.concatenate([g.reshape(len(picks), -1) for g in loop], axis=1)  # [6, P]
        unit = flat / np.linalg.norm(flat, axis=1, keepdims=True)
        got = first_cosines[np.ix_(picks, picks)]
        if not np.allclose(got, unit @ unit.T, rtol=1e-4, atol=1e-5):
            print(f"FAILED: cosines differ from the one-example loop by "
                  f"{np.max(np.abs(got - unit @ unit.T)):.3g}")
            return 1
        print("OK: gradient cosines match the one-example loop (6 images)")
        sess.close()

    off_diagonal = heat[~np.eye(len(heat), dtype=bool)]
    print(f"mean cosine within a class {np.mean(np.diag(heat)):.3f}, between classes "
          f"{np.mean(off_diagonal):.3f} ({num_batches * B} images)")
    masked = np.where(np.eye(len(heat), dtype=bool), -np.inf, heat)
    c, d = np.unravel_index(np.argmax(masked), heat.shape)
    print(f"most similar pair of different digits: {c} and {d} ({heat[c, d]:.3f})")

    fig, axis = plt.subplots(figsize=(6.4, 5.4))
    limit = np.max(np.abs(heat))
    image = axis.imshow(heat, cmap="RdBu_r", vmin=-limit, vmax=limit)
    for (row, col), value in np.ndenumerate(heat):
        axis.text(col, row, f"{value:.2f}", ha="center", va="center", fontsize=7)
    axis.set_xticks(range(10))
    axis.set_yticks(range(10))
    axis.set_xlabel("digit")
    axis.set_ylabel("digit")
    axis.set_title(f"Mean gradient cosine between digit classes\n(CNN after {steps} SGD "
                   f"steps, {num_batches * B} training images)", fontsize=10)
    fig.colorbar(image, ax=axis, shrink=0.85)
    fig.tight_layout()
    fig.savefig(args.output, dpi=100)
    plt.close(fig)
    print(f"saved {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

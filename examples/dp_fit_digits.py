"""DP-SGD with tf_keras' `model.fit` on handwritten digits, mislabelled examples found.

Flips the labels of --flip of scikit-learn's bundled digits (1,500 training and 297 test
images, no download) to another class on purpose, then trains a small Keras 2 CNN with
`model.fit` and `pertower.keras.DPKerasSGDOptimizer` (every example's gradient clipped to
--l2-norm-clip, Gaussian noise of --noise-multiplier times the clip) on the Poisson
batches of `pertower.keras.PoissonSequence` (each example joins each step with
probability q = batch / 1500, the sampling the accounting assumes; the noised sum is
divided by the expected batch size). The callback `pertower.keras.ExampleScores` keeps
each example's TracIn self-influence (sum over the steps that trained on it of
learning rate x squared gradient norm, fetched in each step's own run). Prints the test
accuracy, the privacy spent, (ε, δ) from `pertower.compute_epsilon`, and how many of
the --flip largest self-influences are flipped labels (the precision of the top list).

Run:  python examples/dp_fit_digits.py               (about 20 s on 2 cores)
      python examples/dp_fit_digits.py --quick       (a few steps: a smoke test)
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras as keras  # noqa: E402

import pertower  # noqa: E402
import pertower.keras  # noqa: E402  pylint: disable=unused-import

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import digits_common  # noqa: E402  pylint: disable=wrong-import-position

tf.compat.v1.disable_eager_execution()


def parse_args(argv=None):
    parser = digits_common.dp_parser(__doc__.splitlines()[0], epochs=20,
                                     quick_help="one epoch of 5 steps (a smoke test)")
    parser.add_argument("--noise-multiplier", type=float, default=1.1)
    parser.add_argument("--flip", type=int, default=75,
                        help="training labels flipped on purpose (and the top list's size)")
    return parser.parse_args(argv)


def flip_labels(labels, count, rng):
    """(labels with `count` of them moved to another class at random, their indices)."""
    flipped = rng.choice(len(labels), count, replace=False)
    labels = labels.copy()
    labels[flipped] = (labels[flipped] + rng.randint(1, digits_common.NUM_CLASSES, count)) \
        % digits_common.NUM_CLASSES
    return labels, flipped


def main(argv=None):
    args = parse_args(argv)
    x_train, y_clean, x_test, y_test = digits_common.load_digits(args.seed)
    y_train, flipped = flip_labels(y_clean, args.flip, np.random.RandomState(args.seed))
    n_train = len(y_train)
    q = args.batch_size / n_train
    print(f"digits: {n_train} training images ({args.flip} labels flipped) and "
          f"{len(y_test)} test images, q = {q:.4f} (expected batch {args.batch_size})")
    with tf.Graph().as_default():
        digits_common.seed_graph(args.seed)
        model = digits_common.build_cnn()
        train = pertower.keras.PoissonSequence(
            x_train, y_train, q, steps_per_epoch=5 if args.quick else None, seed=args.seed)
        epochs = 1 if args.quick else args.epochs
        model.compile(
            optimizer=pertower.keras.DPKerasSGDOptimizer(
                l2_norm_clip=args.l2_norm_clip, noise_multiplier=args.noise_multiplier,
                learning_rate=args.learning_rate, seed=args.seed,
                expected_batch_size=train.expected_batch_size),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"])
        scores = pertower.keras.ExampleScores(x_train)
        model.fit(train, epochs=epochs, verbose=0 if args.quick else 2, callbacks=[scores])
        accuracy = model.evaluate(x_test, y_test, verbose=0)[1]
    steps = epochs * len(train)
    eps = pertower.compute_epsilon(steps, args.noise_multiplier, q, args.delta)
    print(f"DP fit  test accuracy {accuracy:.3f}   epsilon = {eps:.2f} at delta = "
          f"{args.delta:g} ({steps} steps, q = {q:.4f}, noise multiplier "
          f"{args.noise_multiplier}, clip {args.l2_norm_clip})")
    top = scores.top(args.flip)
    found = len(np.intersect1d(top, flipped))
    print(f"flipped labels among the {args.flip} largest self-influences: {found}/{args.flip} "
          f"(precision {found / args.flip:.2f}; at random {args.flip / n_train:.2f}); "
          f"{np.count_nonzero(scores.times_seen)} examples trained on")
    return 0


if __name__ == "__main__":
    sys.exit(main())

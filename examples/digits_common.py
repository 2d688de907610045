"""Shared by the digits examples: scikit-learn's bundled handwritten digits and a small
Keras 2 CNN built on placeholders (graph mode).

The data ship with scikit-learn (1,797 grey 8x8 images of the digits 0-9, values
0..16); nothing is downloaded. Import this module after setting up TensorFlow's
environment (the example scripts do it first).
"""

import argparse

import numpy as np
import tensorflow as tf
import tf_keras as keras

NUM_CLASSES = 10
TRAIN_SIZE = 1500  # the other 297 images are the test set


def dp_parser(description, epochs=15, quick_help="train 5 steps of each run (a smoke test)"):
    """The arguments the DP digits examples share: epochs, batch size, learning rate,
    clip, δ, seed and --quick; an example adds its own (noise multiplier or ε, ...)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--epochs", type=int, default=epochs)
    parser.add_argument("--batch-size", type=int, default=50,
                        help="the (expected) batch size")
    parser.add_argument("--learning-rate", type=float, default=0.5)
    parser.add_argument("--l2-norm-clip", type=float, default=1.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    return parser


def load_digits(seed=0):
    """(x_train [1500, 8, 8, 1], y_train [1500], x_test [297, 8, 8, 1], y_test [297]):
    images scaled to [0, 1], a fixed random split."""
    # scikit-learn is an optional extra: imported only here
    from sklearn.datasets import load_digits as sklearn_digits  # pylint: disable=C0415

    digits = sklearn_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]  # [1797, 8, 8] -> [.., 1]
    labels = digits.target.astype(np.int32)
    order = np.random.RandomState(seed).permutation(len(labels))
    train, test = order[:TRAIN_SIZE], order[TRAIN_SIZE:]
    return images[train], labels[train], images[test], labels[test]


def seed_graph(seed):
    """Makes the current graph's random ops (Keras initializers, dropout, the DP noise)
    repeatable: Keras 2 initializers ignore the graph-level seed alone, so this also
    seeds Python and NumPy via `keras.utils.set_random_seed`. Call inside the graph."""
    keras.utils.set_random_seed(seed)


def build_cnn():
    """Conv2D(8, 3, relu) -> MaxPool(2) -> Flatten -> Dense(32, relu) -> Dense(10)."""
    return keras.Sequential([
        keras.layers.Conv2D(8, 3, padding="same", activation="relu", input_shape=(8, 8, 1)),
        keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(NUM_CLASSES),
    ])


def per_example_loss(logits, labels):
    """Softmax cross-entropy of each example, [B]."""
    return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)


def batches(num_examples, batch_size, rng):
    """Yields index arrays of `batch_size` for one shuffled epoch (the last partial batch
    dropped, so every step has exactly `batch_size` examples)."""
    order = rng.permutation(num_examples)
    for start in range(0, num_examples - batch_size + 1, batch_size):
        yield order[start:start + batch_size]


def accuracy(sess, logits, x, x_test, y_test):
    """Test accuracy of `logits` (computed on placeholder `x`)."""
    predictions = np.argmax(sess.run(logits, {x: x_test}), axis=1)
    return float(np.mean(predictions == y_test))

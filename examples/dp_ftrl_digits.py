"""DP-SGD, banded matrix-factorization noise and DP-FTRL on handwritten digits, same ε.

Trains the same small CNN (same initial weights) on scikit-learn's bundled digits (1,500
training and 297 test images, no download), each run at the same (ε, δ), its noise
multiplier σ from `pertower.compute_noise_multiplier` for its own accounting:

- DP-SGD on Poisson batches (`pertower.poisson_batches`, each example in each batch with
  probability q = batch / 1500): the sampling its accounting assumes.
- Banded MF noise (`pertower.BandedMFNoise`, --bands b, default the steps of an epoch)
  in a fixed order: the same batches in the same order every epoch, no shuffling or
  sampling; an example joins once per epoch, an epoch's steps apart
  (mechanism="banded_mf").
- DP-FTRL with tree aggregation (`pertower.DPFTRLOptimizer`, a new tree each epoch) in
  the same fixed order (mechanism="tree").

Prints σ and the test accuracy of each.

Run:  python examples/dp_ftrl_digits.py               (about 30 s on 2 cores)
      python examples/dp_ftrl_digits.py --quick       (a few steps: a smoke test)
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import pertower  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import digits_common  # noqa: E402  pylint: disable=wrong-import-position

tf.compat.v1.disable_eager_execution()


def parse_args(argv=None):
    parser = digits_common.dp_parser(
        __doc__.splitlines()[0], quick_help="train 5 steps of each run, one epoch (a smoke test)")
    parser.add_argument("--epsilon", type=float, default=3.0)
    parser.add_argument("--bands", type=int, default=None,
                        help="banded MF's bands; default the steps of an epoch, the most "
                             "its accounting allows over several epochs")
    return parser.parse_args(argv)


def _dp_sgd(args, sigma):
    sgd = tf.compat.v1.train.GradientDescentOptimizer(args.learning_rate)
    return pertower.DPOptimizer(sgd, args.l2_norm_clip, sigma, seed=args.seed,
                                expected_batch_size=args.batch_size)


def _banded_mf(args, sigma):
    sgd = tf.compat.v1.train.GradientDescentOptimizer(args.learning_rate)
    return pertower.DPOptimizer(sgd, args.l2_norm_clip, sigma,
                                mechanism=pertower.BandedMFNoise(args.bands, seed=args.seed))


def _dp_ftrl(args, sigma, steps_per_epoch):
    return pertower.DPFTRLOptimizer(args.l2_norm_clip, sigma, args.learning_rate,
                                    restart_period=steps_per_epoch, seed=args.seed)


def runs(args, steps, steps_per_epoch, q):
    """(name, σ, optimizer builder, sampled) per run, σ reaching args.epsilon."""
    epochs = -(-steps // steps_per_epoch)      # an example's participations, fixed order
    sigma = {mechanism: pertower.compute_noise_multiplier(
        args.epsilon, steps, 1.0 if mechanism else q, args.delta,
        **(dict(mechanism=mechanism, epochs=epochs) if mechanism else {}),
        **(dict(bands=args.bands) if mechanism == "banded_mf" else {}))
        for mechanism in (None, "banded_mf", "tree")}
    return [("DP-SGD", sigma[None], lambda: _dp_sgd(args, sigma[None]), True),
            ("banded MF", sigma["banded_mf"],
             lambda: _banded_mf(args, sigma["banded_mf"]), False),
            ("DP-FTRL", sigma["tree"],
             lambda: _dp_ftrl(args, sigma["tree"], steps_per_epoch), False)]


def train(args, data, make_optimizer, sampled, steps):
    """Trains one CNN for `steps` steps; returns its test accuracy."""
    x_train, y_train, x_test, y_test = data
    with tf.Graph().as_default() as graph:
        digits_common.seed_graph(args.seed)        # the same initial weights every run
        x = tf.compat.v1.placeholder(tf.float32, [None, 8, 8, 1], name="images")
        y = tf.compat.v1.placeholder(tf.int32, [None], name="labels")
        model = digits_common.build_cnn()
        logits = model(x)                                                  # [B, 10]
        loss = digits_common.per_example_loss(logits, y)                   # [B]
        train_op = make_optimizer().minimize(loss, var_list=model.trainable_weights)
        sess = tf.compat.v1.Session(graph=graph)
        sess.run(tf.compat.v1.global_variables_initializer())
    if sampled:    # Poisson batches, as DP-SGD's accounting assumes
        batches = pertower.poisson_batches((x_train, y_train), args.batch_size / len(y_train),
                                           steps=steps, seed=args.seed)
    else:          # one fixed order of batches, repeated every epoch
        order = list(digits_common.batches(len(y_train), args.batch_size,
                                           np.random.RandomState(args.seed)))
        batches = ((x_train[order[t % len(order)]], y_train[order[t % len(order)]])
                   for t in range(steps))
    for images, labels in batches:
        sess.run(train_op, {x: images, y: labels})
    acc = digits_common.accuracy(sess, logits, x, x_test, y_test)
    sess.close()
    return acc


def main(argv=None):
    args = parse_args(argv)
    data = digits_common.load_digits(args.seed)
    n_train = len(data[1])
    steps_per_epoch = n_train // args.batch_size
    steps = 5 if args.quick else args.epochs * steps_per_epoch
    args.bands = args.bands or steps_per_epoch
    q = args.batch_size / n_train
    print(f"digits: {n_train} training and {len(data[3])} test images, batch "
          f"{args.batch_size}, {steps} steps ({steps_per_epoch} per epoch), each run at "
          f"epsilon = {args.epsilon:g}, delta = {args.delta:g}")
    for name, sigma, make_optimizer, sampled in runs(args, steps, steps_per_epoch, q):
        acc = train(args, data, make_optimizer, sampled, steps)
        order = f"Poisson batches, q = {q:.4f}" if sampled else "fixed order"
        if name == "banded MF":
            order += f", bands = {args.bands}"
        print(f"{name:<10} test accuracy {acc:.3f}   noise multiplier {sigma:.3f} "
              f"({order})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

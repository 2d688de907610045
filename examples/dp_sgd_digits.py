"""DP-SGD on handwritten digits: a Keras 2 CNN in a Session, with and without privacy.

Trains the same small CNN (same initial weights) twice on scikit-learn's
bundled digits (1,500 training and 297 test images, no download): once with plain
SGD on shuffled batches, once with `pertower.DPOptimizer` (every example's gradient
clipped to --l2-norm-clip, Gaussian noise of --noise-multiplier times the clip) on
Poisson-sampled batches from `pertower.poisson_batches` (each example joins each batch
with probability q = batch / 1500, the sampling the accounting assumes; the sum is
divided by the expected batch size). Prints the test accuracy of both, the privacy
spent by the DP run, (ε, δ) from `pertower.compute_epsilon` (RDP and PLD accountants),
and the median time of a training step of each.

Run:  python examples/dp_sgd_digits.py               (about 20 s on 2 cores)
      python examples/dp_sgd_digits.py --quick       (a few steps: a smoke test)
"""

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tqdm import tqdm  # noqa: E402

import pertower  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import digits_common  # noqa: E402  pylint: disable=wrong-import-position

tf.compat.v1.disable_eager_execution()


def parse_args(argv=None):
    parser = digits_common.dp_parser(__doc__.splitlines()[0])
    parser.add_argument("--noise-multiplier", type=float, default=1.1)
    return parser.parse_args(argv)


def train(args, data, private):
    """Trains one CNN; returns (test accuracy, steps, median step seconds)."""
    x_train, y_train, x_test, y_test = data
    with tf.Graph().as_default() as graph:
        digits_common.seed_graph(args.seed)        # the same initial weights both runs
        x = tf.compat.v1.placeholder(tf.float32, [None, 8, 8, 1], name="images")
        y = tf.compat.v1.placeholder(tf.int32, [None], name="labels")
        model = digits_common.build_cnn()
        logits = model(x)                                                  # [B, 10]
        loss = digits_common.per_example_loss(logits, y)                   # [B]
        sgd = tf.compat.v1.train.GradientDescentOptimizer(args.learning_rate)
        if private:
            dp = pertower.DPOptimizer(sgd, l2_norm_clip=args.l2_norm_clip,
                                      noise_multiplier=args.noise_multiplier, seed=args.seed,
                                      expected_batch_size=args.batch_size)
            # Poisson batches vary in size: every weight of this CNN has a rule, so no
            # batch_size is needed
            train_op = dp.minimize(loss, var_list=model.trainable_weights)
        else:
            train_op = sgd.minimize(tf.reduce_mean(loss), var_list=model.trainable_weights)
        sess = tf.compat.v1.Session(graph=graph)
        sess.run(tf.compat.v1.global_variables_initializer())

    rng = np.random.RandomState(args.seed)             # the shuffled batches of SGD
    steps_per_epoch = len(y_train) // args.batch_size
    total = 5 if args.quick else args.epochs * steps_per_epoch
    q = args.batch_size / len(y_train)
    step_seconds = []
    name = "DP-SGD" if private else "SGD   "
    with tqdm(total=total, desc=name, unit="step", file=sys.stdout, mininterval=1.0,
              disable=args.quick) as bar:
        step = 0
        while step < total:
            # DP: Poisson batches (the accounting's sampling); SGD: shuffled ones
            batches = (pertower.poisson_batches((x_train, y_train), q, steps=total - step,
                                                seed=args.seed) if private else
                       ((x_train[i], y_train[i]) for i in digits_common.batches(
                           len(y_train), args.batch_size, rng)))
            for images, labels in batches:
                if step == total:
                    break
                start = time.perf_counter()
                sess.run(train_op, {x: images, y: labels})
                step_seconds.append(time.perf_counter() - start)
                step += 1
                bar.update(1)
                if private and (step % steps_per_epoch == 0 or step == total):
                    eps = pertower.compute_epsilon(step, args.noise_multiplier, q, args.delta)
                    bar.set_postfix_str(f"eps={eps:.2f} delta={args.delta:g}")
    acc = digits_common.accuracy(sess, logits, x, x_test, y_test)
    sess.close()
    # the first steps include one-off set-up; the median is robust to it
    return acc, total, float(np.median(step_seconds))


def main(argv=None):
    args = parse_args(argv)
    data = digits_common.load_digits(args.seed)
    n_train = len(data[1])
    q = args.batch_size / n_train
    print(f"digits: {n_train} training and {len(data[3])} test images, batch "
          f"{args.batch_size}, q = {q:.4f}")
    plain_acc, steps, plain_time = train(args, data, private=False)
    dp_acc, _, dp_time = train(args, data, private=True)
    eps = pertower.compute_epsilon(steps, args.noise_multiplier, q, args.delta)
    pld = pertower.compute_epsilon(steps, args.noise_multiplier, q, args.delta,
                                   accountant="pld")
    print(f"SGD     test accuracy {plain_acc:.3f}   epsilon = inf (no privacy)")
    print(f"DP-SGD  test accuracy {dp_acc:.3f}   epsilon = {eps:.2f} at delta = "
          f"{args.delta:g} ({steps} steps, q = {q:.4f}, noise multiplier "
          f"{args.noise_multiplier}, clip {args.l2_norm_clip}; PLD accountant: "
          f"{pld:.2f})")
    print(f"median step time: SGD {plain_time * 1e3:.1f} ms, DP-SGD {dp_time * 1e3:.1f} ms "
          f"({dp_time / plain_time:.1f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A last-layer Laplace approximation on the digits: diagonal and Kronecker-factored.

Trains a small MLP (64 -> 32 relu -> 10) on scikit-learn's bundled digits (no
download) in a tf.compat.v1.Session, then puts a Gaussian posterior on the last
layer's kernel W [32, 10] around the trained weights (MacKay 1992; Ritter, Botev, Barber
2018, "A scalable Laplace approximation for neural networks"):

    precision = GGN of the summed training loss + tau I
    diagonal:   GGN ≈ diag, from `pertower.diag_ggn`
    Kronecker:  GGN ≈ kron(A, G), from `pertower.kfac_factors` (KFLR), inverted
                exactly through the eigenvectors of A and G

and predicts by averaging the softmax over logits drawn from the Gaussian that the
posterior induces on them. The plot compares the confidence (largest predicted
probability) of the trained network and of both Laplace posteriors on the test digits
and on images the network never saw (uniform noise): the posteriors should lower the
confidence on the noise more than on the digits. The script first checks that the
Kronecker factors at one image (at the initial weights) equal the exact GGN block of
the loop of tf.gradients.

Run:  python examples/digits_laplace.py [--output digits_laplace.png]  (~10 s)
      python examples/digits_laplace.py --quick
"""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # tf.compat.v1.layers needs Keras 2
if os.environ["TF_USE_LEGACY_KERAS"] not in ("1", "true", "True"):   # what TensorFlow reads
    sys.exit(f"digits_laplace.py: tf.compat.v1.layers needs Keras 2, but "
             f"TF_USE_LEGACY_KERAS={os.environ['TF_USE_LEGACY_KERAS']!r}: set it to 1 or unset it.")

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import pertower  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import digits_common  # noqa: E402  pylint: disable=wrong-import-position

tf.compat.v1.disable_eager_execution()

K = digits_common.NUM_CLASSES


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="digits_laplace.png", help="PNG path")
    parser.add_argument("--steps", type=int, default=300, help="Adam steps of 100 images")
    parser.add_argument("--prior-precision", type=float, default=1.0, help="tau")
    parser.add_argument("--samples", type=int, default=200, help="logit draws per image")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="30 training steps (a smoke test)")
    return parser.parse_args(argv)


def softmax(z):
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def check_one_image(sess, logits, kernel, factors, feed):
    """kron(A, G) at one image against J^T H J, J from one tf.gradients per class."""
    jac = tf.stack([tf.reshape(tf.gradients(logits[0, c], kernel)[0], [-1]) for c in range(K)])
    (A, G), J, f = sess.run((factors, jac, logits), feed)
    p = softmax(f[0].astype(np.float64))
    J = J.astype(np.float64)
    exact = J.T @ (np.diag(p) - np.outer(p, p)) @ J                   # [320, 320]
    error = np.abs(np.kron(A, G) - exact).max() / np.abs(exact).max()
    if error > 1e-4:
        raise SystemExit(f"FAILED: kron(A, G) differs from the GGN block by {error:.2e}")
    print(f"OK: KFLR at one image equals the exact GGN block of the loop "
          f"({K} classes, {J.shape[1]} weights; relative error {error:.1e})")


def logit_covariances(phi, posterior):
    """[N, K, K] covariance of the logits phi W for W ~ N(W_map, posterior), phi [N, 32].

    f = (phi^T ⊗ I) vec_rowmajor(W): diagonal posterior -> diag_j sum_i phi_i^2 var_ij;
    Kronecker (Qa ⊗ Qg) D (Qa ⊗ Qg)^T -> Qg diag_j(sum_i (phi Qa)_i^2 D_ij) Qg^T.
    """
    if posterior[0] == "diag":
        var = posterior[1]                                                  # [32, K]
        return np.stack([np.diag(d) for d in (phi ** 2) @ var])
    _, Qa, Qg, D = posterior                                                # D [32, K]
    weights = ((phi @ Qa) ** 2) @ D                                         # [N, K]
    return np.einsum("aj,nj,bj->nab", Qg, weights, Qg)


def predict(f, covariances, samples, rng):
    """[N, K]: the softmax averaged over logits drawn from N(f_n, covariances_n)."""
    chol = np.linalg.cholesky(covariances + 1e-9 * np.eye(K))              # [N, K, K]
    eps = rng.standard_normal((samples, *f.shape))                          # [S, N, K]
    draws = f[None] + np.einsum("nab,snb->sna", chol, eps)
    return softmax(draws).mean(axis=0)


def main(argv=None):
    args = parse_args(argv)
    x_train, y_train, x_test, y_test = digits_common.load_digits(args.seed)
    x_train, x_test = x_train.reshape(-1, 64), x_test.reshape(-1, 64)
    rng = np.random.RandomState(args.seed)
    noise = rng.uniform(0, 1, size=(300, 64)).astype(np.float32)
    steps = 30 if args.quick else args.steps

    with tf.Graph().as_default():
        digits_common.seed_graph(args.seed)
        x = tf.compat.v1.placeholder(tf.float32, [None, 64], name="images")
        y = tf.compat.v1.placeholder(tf.int32, [None], name="labels")
        hidden = tf.compat.v1.layers.Dense(32, activation=tf.nn.relu)
        head = tf.compat.v1.layers.Dense(K)
        features = hidden(x)                                                # [B, 32]
        logits = head(features)                                             # [B, 10]
        loss = tf.reduce_mean(digits_common.per_example_loss(logits, y))
        train_op = tf.compat.v1.train.AdamOptimizer(0.01).minimize(loss)
        diag = pertower.diag_ggn(logits, [head.kernel])[0]                  # [32, 10]
        factors = pertower.kfac_factors(logits, [head.kernel])[0]           # A [32, 32], G [10, 10]
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            check_one_image(sess, logits, head.kernel, factors, {x: x_train[:1]})
            for _ in range(steps):
                batch = rng.choice(len(y_train), 100, replace=False)
                sess.run(train_op, {x: x_train[batch], y: y_train[batch]})
            train_feed = {x: x_train}
            diag_value, (A, G) = sess.run((diag, factors), train_feed)
            (f_test, phi_test), (f_noise, phi_noise) = (
                sess.run((logits, features), {x: images}) for images in (x_test, noise))

    tau = args.prior_precision
    la, Qa = np.linalg.eigh(A)
    lg, Qg = np.linalg.eigh(G)
    posteriors = {"diagonal (diag_ggn)": ("diag", 1.0 / (diag_value + tau)),
                  "Kronecker (kfac_factors)": ("kron", Qa, Qg,
                                               1.0 / (np.outer(la, lg) + tau))}
    draws = np.random.RandomState(args.seed + 1)
    results = {"trained network (MAP)": (softmax(f_test), softmax(f_noise))}
    for label, posterior in posteriors.items():
        results[f"Laplace, {label}"] = tuple(
            predict(f, logit_covariances(phi, posterior), args.samples, draws)
            for f, phi in ((f_test, phi_test), (f_noise, phi_noise)))

    print(f"{len(y_train)} training images, {steps} steps, prior precision {tau}")
    for label, (test_p, noise_p) in results.items():
        nll = -np.mean(np.log(test_p[np.arange(len(y_test)), y_test] + 1e-12))
        accuracy = np.mean(test_p.argmax(axis=1) == y_test)
        print(f"{label:38s} test accuracy {accuracy:.3f}  test NLL {nll:.3f}  "
              f"mean confidence: digits {test_p.max(axis=1).mean():.3f}, "
              f"noise {noise_p.max(axis=1).mean():.3f}")

    figure, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    bins = np.linspace(0.1, 1.0, 19)
    for axis, which, title in ((axes[0], 0, "test digits"), (axes[1], 1, "uniform noise")):
        for label, probabilities in results.items():
            axis.hist(probabilities[which].max(axis=1), bins=bins, histtype="step",
                      linewidth=1.6, label=label)
        axis.set_title(f"confidence on {title}")
        axis.set_xlabel("largest predicted probability")
    axes[0].set_ylabel("images")
    axes[1].legend(loc="upper left", fontsize=8)
    figure.tight_layout()
    figure.savefig(args.output, dpi=110)
    plt.close(figure)
    print(f"saved {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

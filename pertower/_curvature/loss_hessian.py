"""A symmetric factor S of the loss Hessian with respect to the network output.

Notation:
    B   examples in the batch       K   outputs per example (logits_n is [K])
    M   columns of the factor       p   the model's prediction (softmax or sigmoid)
    H_n the Hessian of l(logits_n) with respect to logits_n, [K, K]

    sum_m S[m, n] S[m, n]^T = H_n                      (exact, M = K, K - 1 for softmax)
    E[sum_m S[m, n] S[m, n]^T] = H_n                   (Monte-Carlo, M = mc_samples)

The generalized Gauss-Newton matrix of sum_n l(f(x_n, w)) is sum_n J_n^T H_n J_n with
J_n = d logits_n / d w, so with the columns S[m, n] backpropagated through the network
(J_n^T S[m, n]) its diagonal is sum_{n, m} (J_n^T S[m, n])^2 (Martens 2014, "New insights
and perspectives on the natural gradient method", arXiv 1412.1193, section 9; Dangel et
al. 2020, "BackPACK: packing more into backprop", arXiv 1912.10985, appendix A). For the
losses here H_n does not depend on the labels, and the Monte-Carlo columns use labels
sampled from the model, so that the GGN equals the (true) Fisher.
"""

import tensorflow as tf

from pertower import _checks
from pertower import _context

__all__ = ["LOSSES", "hessian_factor", "exact_columns", "check_loss", "check_mc_samples"]

# loss name -> what l(logits_n) is (for messages and docstrings)
LOSSES = {
    "softmax_cross_entropy": "-log softmax(f)_y",
    "sigmoid_cross_entropy": "sum_k of the binary cross-entropy of sigmoid(f_k)",
    "mse": "sum_k (f_k - y_k)^2",
}


def check_loss(loss):
    """`loss` when it names a supported loss; else a ValueError naming the argument."""
    if not isinstance(loss, str) or loss not in LOSSES:
        raise _context.error(ValueError, f"`loss` must be one of {sorted(LOSSES)}, but "
                                         f"received {loss!r}.")
    return loss


def check_mc_samples(mc_samples):
    """`mc_samples` when it is None (exact) or a positive int; else a ValueError."""
    if mc_samples is None:
        return None
    if isinstance(mc_samples, bool) or not isinstance(mc_samples, int) or mc_samples < 1:
        raise _context.error(ValueError, "`mc_samples` must be None (the exact Hessian "
                                         "factor) or a positive int (the number of sampled "
                                         f"columns), but received {mc_samples!r}.")
    return mc_samples


def _check_logits(logits):
    logits = tf.convert_to_tensor(logits)
    if logits.shape.rank != 2:
        raise _context.error(ValueError, "`logits` must be a [B, K] tensor (one row of K "
                                         f"outputs per example), but received shape "
                                         f"{logits.shape}; reshape it to [B, K] first.")
    if not logits.dtype.is_floating:
        raise _context.error(TypeError, "`logits` must be a floating-point tensor, but "
                                        f"received dtype {logits.dtype.name}.")
    return logits


def exact_columns(loss, K):
    """M of the exact factor for K static outputs: K - 1 for the softmax (its Hessian
    has rank K - 1; K when K is 1 or not static), else K."""
    if loss == "softmax_cross_entropy" and isinstance(K, int) and K > 1:
        return K - 1
    return K


def _softmax_factor(p, K):
    """[K-1, B, K]: S with S^T S = diag(p) - p p^T per example.

    diag(p) - p p^T = D (I - q q^T) D with q = sqrt(p), D = diag(q), |q| = 1. The
    Householder reflection R = I - 2 v v^T / |v|^2, v = q + e_k (k = argmax p, so
    |v|^2 >= 2: no cancellation), has R e_k = -q, so its other K - 1 columns r_j =
    e_j - q_j v / (1 + q_k) span q's complement: the columns are s_j = q ⊙ r_j."""
    q = tf.sqrt(p)                                                      # [B, K]
    k = tf.argmax(p, axis=1, output_type=tf.int32)                      # [B]
    e_k = tf.one_hot(k, K, dtype=p.dtype)                               # [B, K]
    v = q + e_k                                                         # [B, K]
    scale = 1 / (1 + tf.reduce_sum(q * e_k, axis=1))                    # [B]
    m = tf.range(K - 1)[:, None]                                        # [K-1, 1]
    j = m + tf.cast(m >= k[None], tf.int32)                             # [K-1, B]: j != k
    e_j = tf.one_hot(j, K, dtype=p.dtype)                               # [K-1, B, K]
    q_j = tf.reduce_sum(e_j * q[None], axis=2)                          # [K-1, B]
    return q[None] * (e_j - (scale[None] * q_j)[:, :, None] * v[None])  # [K-1, B, K]


def _draw(stateful, stateless, dims, seeds, dtype):
    """A draw of shape `dims`: stateless with the key `seeds`, else stateful."""
    shape = tf.stack(dims)
    if seeds is None:
        return stateful(shape, dtype=dtype)
    return stateless(shape, seed=seeds, dtype=dtype)


def hessian_factor(logits, loss, mc_samples=None, seed=None):
    """S, [M, B, K], with sum_m S[m, n] S[m, n]^T equal (exact) or equal in expectation
    (Monte-Carlo) to the Hessian of l(logits_n) with respect to logits_n.

    Exact (`mc_samples=None`, M = `exact_columns(loss, K)`):
      "softmax_cross_entropy": H = diag(p) - p p^T, `_softmax_factor` (K = 1: the
        column sqrt(p) (e - p) = 0);
      "sigmoid_cross_entropy": H = diag(p (1 - p)), S = diag(sqrt(p (1 - p)));
      "mse" (l = sum_k (f_k - y_k)^2): H = 2 I, S = sqrt(2) I.
    Monte-Carlo (`mc_samples=M`), labels y~ drawn from the model, one per column:
      "softmax_cross_entropy": (p - onehot(y~)) / sqrt(M), y~ ~ Categorical(p);
      "sigmoid_cross_entropy": (p - y~) / sqrt(M), y~_k ~ Bernoulli(p_k);
      "mse": sqrt(2) eps / sqrt(M), eps ~ N(0, I).
    For the summed loss (a mean would scale every column by 1/sqrt(N)). `seed`: an int
    for reproducible sampling, or None. Returns S under `tf.stop_gradient`.
    """
    loss = check_loss(loss)
    mc_samples = check_mc_samples(mc_samples)
    seed = _checks.optional_seed(seed)
    logits = tf.stop_gradient(_check_logits(logits))
    dtype = logits.dtype
    B, K = tf.shape(logits)[0], tf.shape(logits)[1]
    if mc_samples is None:
        eye = tf.eye(K, dtype=dtype)[:, None, :]                        # [K, 1, K]
        static_K = tf.compat.dimension_value(logits.shape[1])
        if loss == "softmax_cross_entropy" and exact_columns(loss, static_K) > 1:
            S = _softmax_factor(tf.nn.softmax(logits), static_K)        # [K-1, B, K]
        elif loss == "softmax_cross_entropy":
            p = tf.nn.softmax(logits)                                   # [B, K]
            S = tf.transpose(tf.sqrt(p))[:, :, None] * (eye - p[None])  # [K, B, K]
        elif loss == "sigmoid_cross_entropy":
            p = tf.sigmoid(logits)                                      # [B, K]
            S = tf.transpose(tf.sqrt(p * (1 - p)))[:, :, None] * eye    # [K, B, K]
        else:
            S = tf.tile(tf.sqrt(tf.constant(2.0, dtype)) * eye, [1, B, 1])   # [K, B, K]
        S.set_shape([exact_columns(loss, static_K), None, static_K])
        return tf.stop_gradient(S)
    M = mc_samples
    scale = tf.math.rsqrt(tf.constant(float(M), dtype))
    seeds = None if seed is None else tf.constant([seed, 0], tf.int64)
    if loss == "softmax_cross_entropy":
        p = tf.nn.softmax(logits)                                       # [B, K]
        log_p = tf.cast(tf.nn.log_softmax(logits), tf.float32)
        y = (tf.random.categorical(log_p, M) if seeds is None           # [B, M]
             else tf.random.stateless_categorical(log_p, M, seed=seeds))
        onehot = tf.one_hot(tf.transpose(y), K, dtype=dtype)            # [M, B, K]
        S = (p[None] - onehot) * scale
    elif loss == "sigmoid_cross_entropy":
        p = tf.sigmoid(logits)                                          # [B, K]
        u = _draw(tf.random.uniform, tf.random.stateless_uniform, [M, B, K], seeds, dtype)
        y = tf.cast(u < p[None], dtype)                                 # [M, B, K]
        S = (p[None] - y) * scale
    else:
        eps = _draw(tf.random.normal, tf.random.stateless_normal, [M, B, K], seeds, dtype)
        S = tf.sqrt(tf.constant(2.0, dtype)) * eps * scale              # [M, B, K]
    return tf.stop_gradient(S)

"""Moments of the per-example gradients (notation: `pertower._analytics`): the empirical
Fisher diagonal, the variance, the gradient noise scale."""

import dataclasses

import tensorflow as tf

from pertower import _context
from pertower import _graph_walk as graph_walk
from pertower import _reductions as reductions

__all__ = ["fisher_diagonal", "gradient_variance", "NoiseScale", "gradient_noise_scale"]


@_context.public("fisher_diagonal")
def fisher_diagonal(per_example_gradients):
    """The diagonal of the empirical Fisher information: (1/B) sum_i g_i ⊙ g_i.

    F_diag = E_i[(∇ log p(y_i | x_i, w))^2] estimated on the batch with the observed
    labels (the "empirical Fisher"; Kunstner, Hennig and Balles 2019, arXiv 1905.12558,
    on where it differs from the true Fisher). `per_example_gradients`: of the negative
    log-likelihood, [B, *x.shape] per weight -> [*x.shape] per weight.

    Example:
      fisher = pertower.fisher_diagonal(pertower.per_example_gradients(nll, w, batch_size=64))
    """
    tensors = reductions.checked_tensors(
        per_example_gradients, "per_example_gradients", per_example=True)
    with tf.name_scope("fisher_diagonal"):
        return [tf.reduce_mean(tf.square(g), axis=0) for g in tensors]  # [B, ...] -> [...]


def _two_or_more_examples(per_example_gradients):
    """The checked tensors, [B, *x.shape] each, B >= 2 when static."""
    tensors = reductions.checked_tensors(
        per_example_gradients, "per_example_gradients", per_example=True)
    B = graph_walk.static_batch_size(tensors[0])
    if B is not None and B < 2:
        raise _context.error(ValueError, f"the unbiased estimates need at least 2 "
                             f"examples, but the per-example gradients have B = {B}.")
    return tensors


@_context.public("gradient_variance")
def gradient_variance(per_example_gradients):
    """The variance of each gradient entry across examples, unbiased: [*x.shape] per weight.

        Var[g]_p = 1/(B-1) sum_i (g_ip - ḡ_p)^2

    Its sum over all entries p is tr(Σ), the estimate `gradient_noise_scale` uses.
    `per_example_gradients`: [B, *x.shape] per weight, B >= 2 -> [*x.shape] per weight.

    Example:
      variance = pertower.gradient_variance(per_example)
    """
    tensors = _two_or_more_examples(per_example_gradients)
    with tf.name_scope("gradient_variance"):
        B = tf.cast(tf.shape(tensors[0])[0], tensors[0].dtype)
        return [tf.reduce_sum(tf.square(g - tf.reduce_mean(g, axis=0)), axis=0) / (B - 1)
                for g in tensors]  # [B, ...] -> [...]


@dataclasses.dataclass(frozen=True)
class NoiseScale:
    """Scalars (`gradient_noise_scale` gives their formulas): the unbiased estimates
    `trace_covariance` tr(Σ) and `squared_norm` |G|^2 (negative when the noise
    dominates), and their ratio `simple_noise_scale`, which is biased: McCandlish et
    al. average numerator and denominator over many batches before dividing."""

    trace_covariance: tf.Tensor
    squared_norm: tf.Tensor
    simple_noise_scale: tf.Tensor


@_context.public("gradient_noise_scale")
def gradient_noise_scale(per_example_gradients):
    """The simple gradient noise scale B_simple = tr(Σ) / |G|^2 of one batch.

    McCandlish, Kaplan, Amodei et al. 2018, "An Empirical Model of Large-Batch Training"
    (arXiv 1812.06162), eq. 2.8; B_simple estimates the batch size above which larger
    batches stop paying off. From B per-example gradients the unbiased estimates are

        tr(Σ)  ≈ S = 1/(B-1) sum_i |g_i - ḡ|^2
        |G|^2  ≈ |ḡ|^2 - S / B        (E|ḡ|^2 = |G|^2 + tr(Σ)/B)

    which equal their Appendix A.1 two-batch estimators with B_small = 1, B_big = B.
    `per_example_gradients`: [B, *x.shape] per weight, B >= 2 -> a `NoiseScale`.

    Example:
      scale = pertower.gradient_noise_scale(per_example)
      S, G2, b_simple = sess.run([scale.trace_covariance, scale.squared_norm,
                                  scale.simple_noise_scale], feed)
    """
    tensors = _two_or_more_examples(per_example_gradients)
    with tf.name_scope("gradient_noise_scale"):
        B = tf.cast(tf.shape(tensors[0])[0], tensors[0].dtype)
        means = [tf.reduce_mean(g, axis=0) for g in tensors]          # [*x.shape] each
        deviations = reductions.global_norms(
            [g - m for g, m in zip(tensors, means)])                    # [B]
        trace = tf.reduce_sum(tf.square(deviations)) / (B - 1)
        mean_squared = tf.add_n([tf.reduce_sum(tf.square(m)) for m in means])  # |ḡ|^2
        squared_norm = mean_squared - trace / B
        return NoiseScale(trace_covariance=trace, squared_norm=squared_norm,
                          simple_noise_scale=trace / squared_norm)

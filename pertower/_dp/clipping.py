"""DP-SGD's clipping: flat, per layer, or adaptive; and the clipped sums they give.

Notation:
    B   examples in the batch          G   groups: B (per example) or M (microbatches)
    K   weights (entries of var_list)  C   the clip norm (C_k per weight, per layer)
    n_g ||g_g||_2 over all weights     n_gk the norm over weight k alone
    σ   noise_multiplier               σ_b the stddev of the noise on the clipped count

Flat clipping (Abadi et al. 2016, arXiv 1607.00133): f_g = C / max(n_g, C) scales every
weight's gradient of group g; the sum's sensitivity is C.

Per-layer clipping (McMahan et al. 2018, arXiv 1710.06963; Opacus' per_layer):
f_gk = C_k / max(n_gk, C_k) per weight. The noise on weight k has stddev σ sqrt(K) C_k:
divided by it, one example moves the sum by at most sqrt(sum_k C_k^2 / (σ^2 K C_k^2))
= 1/σ, a Gaussian mechanism of multiplier σ. A number C is split, C_k = C / sqrt(K).

Adaptive clipping (Andrew et al. 2021, arXiv 1905.03871; TensorFlow Privacy's
`QuantileAdaptiveClipSumQuery`): C follows the target quantile γ of the norms. After
each noised step, with b_g = 1[n_g <= C] and m the expected batch size,

    b̃ = (sum_g (b_g - 1/2) + N(0, σ_b^2)) / m + 1/2,     C <- C exp(-η (b̃ - γ))

(centring b_g gives the count sensitivity 1/2). By the paper's Theorem 1 both releases
together are one Gaussian mechanism of multiplier σ when the gradient's own is

    σ_Δ = (σ^-2 - (2 σ_b)^-2)^(-1/2)        (needs 2 σ_b > σ),

so `compute_epsilon` is given σ (or σ_Δ with clipped_count_stddev=σ_b: the same ε).
"""

import dataclasses
import math
import numbers
import warnings

import tensorflow as tf

from pertower import _checks
from pertower import _context
from pertower import _dispatch
from pertower import _graph_walk as graph_walk
from pertower import _plan
from pertower import _reductions as reductions

__all__ = ["AdaptiveClipping", "ClippingOptions", "clipping_options", "clip_factors",
           "per_layer_clips", "gradient_noise_multiplier",
           "clipped_sum_per_example", "clipped_sum_microbatches", "adaptive_clip_update",
           "clip_variable"]


@dataclasses.dataclass(frozen=True)
class AdaptiveClipping:
    """The options of adaptive clipping (Andrew et al. 2021, arXiv 1905.03871): the clip
    norm starts at `DPOptimizer`'s `l2_norm_clip` and moves after each noised step towards
    the `target_quantile` of the norms (the module docstring).

    Args:
      target_quantile: γ in [0, 1], the fraction of examples to leave unclipped (the
        paper's default 0.5, the median).
      learning_rate: η > 0 of the geometric update (the paper's 0.2).
      count_stddev: σ_b >= 0, the stddev of the Gaussian noise on the count of
        unclipped examples; None for expected_batch_size / 20 (the paper's choice).
        With noise_multiplier σ > 0 it must exceed σ / 2.

    Example:
      dp = pertower.DPOptimizer(sgd, l2_norm_clip=1.0, noise_multiplier=1.1,
                                expected_batch_size=64,
                                adaptive_clipping=pertower.AdaptiveClipping(0.5))
      dp.l2_norm_clip_variable   # after minimize: the non-trainable clip norm
    """

    target_quantile: float = 0.5
    learning_rate: float = 0.2
    count_stddev: float = None

    def __post_init__(self):
        with _context.public_call("AdaptiveClipping"):
            object.__setattr__(self, "target_quantile", _checks.real_number(
                self.target_quantile, "target_quantile", 0.0, 1.0))
            object.__setattr__(self, "learning_rate", _checks.real_number(
                self.learning_rate, "learning_rate", 0.0, math.inf, low_open=True,
                high_open=True, wanted="a positive number"))
            if self.count_stddev is not None:
                object.__setattr__(self, "count_stddev", _checks.real_number(
                    self.count_stddev, "count_stddev", 0.0, math.inf, high_open=True,
                    wanted="a non-negative number"))

    def resolved_count_stddev(self, expected_batch_size):
        """σ_b: `count_stddev`, or expected_batch_size / 20 when it is None."""
        return (expected_batch_size / 20.0 if self.count_stddev is None
                else self.count_stddev)


@dataclasses.dataclass(frozen=True)
class ClippingOptions:
    """A DPOptimizer's checked clipping options."""
    kind: str                          # "flat" or "per_layer"
    l2_norm_clip: object               # C, or per layer a float or a list of K floats
    expected_batch_size: float         # the divisor of the noised sum, or None (the count)
    adaptive: AdaptiveClipping         # or None
    count_stddev: float                # σ_b, or None without adaptive clipping
    gradient_noise_multiplier: float   # σ_Δ


def _positive(value, argument):
    return _checks.real_number(value, argument, 0.0, math.inf, low_open=True,
                               high_open=True, wanted="a positive number")


def clipping_options(kind, l2_norm_clip, noise_multiplier, num_microbatches,
                     expected_batch_size, adaptive):
    """The `ClippingOptions` of DPOptimizer's arguments; raises naming the argument."""
    if kind not in ("flat", "per_layer"):
        raise _context.error(ValueError, "`clipping` must be one of ('flat', "
                             f"'per_layer'), but received {kind!r}.")
    if kind == "per_layer" and isinstance(l2_norm_clip, (list, tuple)):
        if not l2_norm_clip:
            raise _context.error(ValueError, "`l2_norm_clip` is an empty list.")
        l2_norm_clip = [_positive(c, f"l2_norm_clip[{j}]") for j, c in enumerate(l2_norm_clip)]
    else:
        l2_norm_clip = _positive(l2_norm_clip, "l2_norm_clip")
    if expected_batch_size is not None:
        expected_batch_size = _positive(expected_batch_size, "expected_batch_size")
        if num_microbatches is not None:
            raise _context.error(
                ValueError, "`expected_batch_size` is for Poisson batches, whose size "
                "varies, with one microbatch per example; leave num_microbatches None.")
    if adaptive is not None and not isinstance(adaptive, AdaptiveClipping):
        raise _context.error(TypeError, "`adaptive_clipping` must be None or a "
                             "pertower.AdaptiveClipping, but received "
                             f"{type(adaptive).__name__}.")
    if adaptive is not None and (kind != "flat" or expected_batch_size is None):
        raise _context.error(
            ValueError, "`adaptive_clipping` needs clipping='flat' and "
            "`expected_batch_size` (the count of unclipped examples is divided by it); "
            "pass both.")
    count_stddev = None if adaptive is None else adaptive.resolved_count_stddev(
        expected_batch_size)
    return ClippingOptions(kind, l2_norm_clip, expected_batch_size, adaptive, count_stddev,
                           gradient_noise_multiplier(noise_multiplier, count_stddev))


def gradient_noise_multiplier(noise_multiplier, count_stddev):
    """σ_Δ = (σ^-2 - (2 σ_b)^-2)^(-1/2), the gradient's share of σ (Theorem 1 of
    arXiv 1905.03871); σ when there is no count (count_stddev None), 0 when σ = 0."""
    if count_stddev is None or noise_multiplier == 0:
        return noise_multiplier
    if 2.0 * count_stddev <= noise_multiplier:
        raise _context.error(
            ValueError, f"adaptive clipping's count noise (count_stddev {count_stddev:g}) "
            f"must exceed noise_multiplier / 2 ({noise_multiplier / 2:g}): the gradient's "
            "noise multiplier (σ^-2 - (2 σ_b)^-2)^(-1/2) is otherwise not finite. Raise "
            "count_stddev or lower noise_multiplier.")
    return (noise_multiplier ** -2 - (2.0 * count_stddev) ** -2) ** -0.5


def per_layer_clips(l2_norm_clip, K):
    """[K] floats C_k: a number C split equally (C / sqrt(K) each), or the K given."""
    if isinstance(l2_norm_clip, numbers.Real):
        return [float(l2_norm_clip) / math.sqrt(K)] * K
    if len(l2_norm_clip) != K:
        raise _context.error(
            ValueError, f"`l2_norm_clip` has {len(l2_norm_clip)} clip norms, but "
            f"var_list has {K} floating-point variables; with clipping='per_layer' give "
            "one clip norm per variable, in var_list's order, or one number to split "
            "equally.")
    return list(l2_norm_clip)


def clip_factors(clip):
    """norms [G] (or per layer [G, K]) -> f = C / max(n, C) (tf.clip_by_global_norm);
    C a float or a scalar tensor (per layer the K floats C_k)."""
    def factors(norms):
        C = (tf.cast(clip, norms.dtype) if isinstance(clip, tf.Tensor)
             else tf.constant(clip, norms.dtype))                         # [] or [K]
        return C / tf.maximum(norms, C)                                   # [G] or [G, K]
    return factors


def clipped_sum_per_example(request, factors_of, per_weight, gate_graph):
    """(sum_i clip(g_i) per weight, B, norms [B] or [B, K]) from one forward and one
    backward pass (`_dispatch.Built.clipped_sum`)."""
    request = request.per_example()
    with warnings.catch_warnings():   # compute_gradients warned about unreached ones
        warnings.simplefilter("ignore", _checks.UnconnectedWeightsWarning)
        plan = _dispatch.make_plan(dataclasses.replace(
            request, options=dataclasses.replace(request.options,
                                                 forms_gradients=False)))
    # towers replay the model with their own draws; row passes (past a TF1 loop)
    # differentiate the model itself, with the draws of the loss
    noisy = graph_walk.random_ops(request.ys_upstream)
    if noisy and plan.fallback and plan.loop_op is None:
        names = ", ".join(_plan.weight_name(request.xs[k]) for k in plan.fallback)
        warnings.warn(_context.prefixed(
            f"the loss depends on the random op {noisy[0].name!r} ({noisy[0].type}), "
            f"e.g. dropout in training mode, and no rule covers {names}: their "
            "per-example gradients come from towers that replay the model and draw "
            "their own random numbers. Each example's clipped gradient still has norm "
            "<= l2_norm_clip."), stacklevel=3)
    built = _dispatch.build(plan)
    norms, _, grads = built.clipped_sum(factors_of, name="clipped_sum",
                                        per_weight=per_weight)
    if gate_graph:
        grads = list(tf.tuple(grads))
    return grads, tf.shape(request.ys)[0], norms


def clipped_sum_microbatches(request, factors_of, per_weight):
    """(sum_m clip(g_m) per weight with g_m the gradient of microbatch m's mean loss,
    M, norms [M] or [M, K])."""
    M, per_example_loss = request.num_groups, request.ys
    with tf.name_scope("microbatch_gradients"):
        built = _dispatch.build(_dispatch.make_plan(request))
        # [M, *x.shape] each
        sums = built.validated(built.gradients(unconnected_gradients="zero",
                                               name="gradients"))
    # gradient of the microbatch mean = gradient of its sum / (B/M); B/M counted on the
    # outer loss (not replayed by the towers)
    per_microbatch = tf.shape(per_example_loss)[0] // M
    means = [g / tf.cast(per_microbatch, g.dtype) for g in sums]
    if per_weight:   # [M, *x.shape] each -> [M, K]
        norms = tf.stack([reductions.global_norms([g]) for g in means], axis=1)
        factors = factors_of(norms)                                        # [M, K]
        # [M] x [M, *x.shape] -> [*x.shape]
        clipped = [tf.tensordot(factors[:, k], g, axes=1) for k, g in enumerate(means)]
    else:
        norms = reductions.global_norms(means)                             # [M]
        factors = factors_of(norms)                                        # [M]
        clipped = [tf.tensordot(factors, g, axes=1) for g in means]
    return clipped, M, norms


def adaptive_clip_update(clip, unclipped, expected_groups, options, count_stddev, key):
    """C exp(-η (b̃ - γ)) (the module docstring); `unclipped` the count of norms <= C,
    `key` [2] int64 for the count noise."""
    dtype = clip.dtype
    m = tf.cast(expected_groups, dtype)
    noise = tf.cast(count_stddev, dtype) * tf.random.stateless_normal([], key, dtype=dtype)
    fraction = (tf.cast(unclipped, dtype) - m / 2.0 + noise) / m + 0.5     # b̃
    return clip * tf.exp(-options.learning_rate * (fraction - options.target_quantile))


def clip_variable(initial, dtype):
    """The non-trainable scalar variable holding adaptive clipping's C."""
    with tf.init_scope(), tf.compat.v1.variable_scope(None, default_name="dp_adaptive_clip"):
        return tf.compat.v1.get_variable("l2_norm_clip", trainable=False, use_resource=True,
                                         initializer=tf.constant(initial, dtype))

"""Privacy accounting for DP-SGD with Google's `dp-accounting` package.

Notation:
    T   steps (optimizer updates)      q   sampling probability, B / N for N examples
    σ   noise_multiplier               δ   the target delta

Each DP-SGD step is a Gaussian mechanism of multiplier σ on a Poisson-subsampled batch.
The Rényi DP accountant (Mironov 2017, arXiv 1702.07476; the subsampled Gaussian of
Mironov, Talwar and Zhang 2019, arXiv 1908.10530) composes T such steps and converts to
(ε, δ)-DP, as TensorFlow Privacy's `compute_dp_sgd_privacy` does; the privacy loss
distribution accountant (Koskela, Jälkö and Honkela 2020, arXiv 1906.03049; Doroshenko
et al. 2022, arXiv 2207.04380) gives a tighter ε. Neighbouring datasets differ by adding
or removing one example; fixed-size shuffled batches are only approximated.
Per-layer clipping is a Gaussian of multiplier σ; adaptive clipping's gradient (σ_Δ)
and count (2 σ_b) releases compose into one of σ = (σ_Δ^-2 + (2 σ_b)^-2)^(-1/2) (Andrew
et al. 2021, arXiv 1905.03871, Theorem 1); gradient accumulation is one step of the
logical batch.
"""

import math

from pertower import _checks
from pertower import _context

__all__ = ["compute_epsilon"]

_ACCOUNTANTS = ("rdp", "pld")


@_context.public("compute_epsilon")
def compute_epsilon(steps, noise_multiplier, sampling_probability, delta, accountant="rdp",
                    clipped_count_stddev=None):
    """The ε of (ε, δ)-DP after `steps` DP-SGD steps on Poisson-sampled batches.

    Composes `steps` times `PoissonSampledDpEvent(q, GaussianDpEvent(σ))` by
    `dp_accounting.rdp.RdpAccountant` (default orders) or `pld.PLDAccountant`.

    Args:
      steps: T >= 0, the number of noisy updates (epochs * N / B; with gradient
        accumulation the number of noised steps, not of sess.run calls).
      noise_multiplier: σ > 0, as given to `pertower.DPOptimizer` (σ = 0 gives no
        privacy; ε would be infinite); with `clipped_count_stddev`, the gradient's own
        multiplier σ_Δ (`DPOptimizer.gradient_noise_multiplier`).
      sampling_probability: q in (0, 1], the expected (logical) batch size over the
        number of training examples.
      delta: δ in (0, 1), usually below 1 / N.
      accountant: "rdp" (default) or "pld".
      clipped_count_stddev: None, or σ_b > 0 of adaptive clipping's count noise
        (`DPOptimizer.clipping_options.count_stddev`), composed with σ_Δ (the module
        docstring). Leave it None when passing the optimizer's total `noise_multiplier`.

    Returns:
      ε as a float (0.0 for 0 steps).

    Example:
      eps = pertower.compute_epsilon(steps=60 * 60000 // 256, noise_multiplier=1.1,
                                     sampling_probability=256 / 60000, delta=1e-5)
      tighter = pertower.compute_epsilon(60 * 60000 // 256, 1.1, 256 / 60000, 1e-5,
                                         accountant="pld")
    """
    steps = _checks.positive_int(steps, "steps", low=0)
    noise_multiplier = _checks.real_number(noise_multiplier, "noise_multiplier", 0,
                                           math.inf, True, True)
    sampling_probability = _checks.real_number(sampling_probability,
                                               "sampling_probability", 0, 1, True, False)
    delta = _checks.real_number(delta, "delta", 0, 1, True, True)
    if accountant not in _ACCOUNTANTS:
        raise _context.error(ValueError, f"`accountant` must be one of {_ACCOUNTANTS}, but "
                             f"received {accountant!r}.")
    if clipped_count_stddev is not None:
        count_stddev = _checks.real_number(clipped_count_stddev, "clipped_count_stddev",
                                           0, math.inf, True, True)
        # Theorem 1 of arXiv 1905.03871: Gaussians compose as σ^-2 = σ_Δ^-2 + (2 σ_b)^-2
        noise_multiplier = (noise_multiplier ** -2 + (2.0 * count_stddev) ** -2) ** -0.5
    if steps == 0:
        return 0.0
    try:
        import dp_accounting  # pylint: disable=import-outside-toplevel
    except ImportError:
        raise ImportError(_context.prefix() + " needs Google's dp-accounting package: "
                          "pip install dp-accounting") from None
    event = dp_accounting.PoissonSampledDpEvent(
        sampling_probability, dp_accounting.GaussianDpEvent(noise_multiplier))
    relation = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    if accountant == "pld":
        from dp_accounting import pld  # pylint: disable=import-outside-toplevel
        counter = pld.PLDAccountant(neighboring_relation=relation)
    else:
        counter = dp_accounting.rdp.RdpAccountant(neighboring_relation=relation)
    counter.compose(event, int(steps))
    return float(counter.get_epsilon(delta))

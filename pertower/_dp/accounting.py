"""Privacy accounting for DP-SGD with Google's `dp-accounting` package.

Notation:
    T   steps (optimizer updates)      q   sampling probability, B / N for N examples
    σ   noise_multiplier               δ   the target delta

Each DP-SGD step releases a Gaussian mechanism of noise multiplier σ on a batch in
which every example takes part with probability q (Poisson subsampling). The Rényi
DP accountant (Mironov 2017, "Rényi Differential Privacy", arXiv 1702.07476; the
subsampled Gaussian of Mironov, Talwar and Zhang 2019, arXiv 1908.10530) composes T
such steps and converts the result to (ε, δ)-DP, the same events TensorFlow
Privacy's `compute_dp_sgd_privacy` composes (with dp_accounting's default RDP orders
here); or the privacy loss distribution (PLD) accountant (Koskela, Jälkö and Honkela
2020, arXiv 1906.03049; Doroshenko et al. 2022, "Connect the Dots", arXiv 2207.04380),
which composes the same events with a tighter ε. Neighbouring datasets differ by adding
or removing one example (the relation DP-SGD's subsampling analysis uses). Batches drawn
by shuffling into fixed sizes rather than by Poisson sampling are not covered: the
figure is then an approximation, as there.

The modes of `DPOptimizer` map onto the same events: per-layer clipping is a Gaussian
mechanism of multiplier σ (its noise is scaled to each layer's clip); adaptive clipping
releases the gradient with multiplier σ_Δ and the clipped count with multiplier 2 σ_b,
which compose into one Gaussian of σ = (σ_Δ^-2 + (2 σ_b)^-2)^(-1/2) (Andrew et al. 2021,
arXiv 1905.03871, Theorem 1); gradient accumulation makes one step of the logical batch
(q = the logical batch over N, T = the noised steps).
"""

import math

from pertower import _checks
from pertower import _context

__all__ = ["compute_epsilon"]


def _number(value, argument, low, high, low_open, high_open):
    """`value` as a float in the given interval; raises with the argument's name."""
    return _checks.real_number(value, argument, low, high, low_open,
                               high_open)


_ACCOUNTANTS = ("rdp", "pld")


@_context.public("compute_epsilon")
def compute_epsilon(steps, noise_multiplier, sampling_probability, delta, accountant="rdp",
                    clipped_count_stddev=None):
    """The ε of (ε, δ)-DP after `steps` DP-SGD steps on Poisson-sampled batches.

    Composes `steps` times `PoissonSampledDpEvent(sampling_probability,
    GaussianDpEvent(σ))` with add-or-remove-one neighbours, by
    `dp_accounting.rdp.RdpAccountant` (default orders) or
    `dp_accounting.pld.PLDAccountant` (tighter; value discretization 1e-4). The figure
    assumes each example joins each batch independently with probability q (Poisson
    sampling, `pertower.poisson_batches`); fixed-size shuffled batches are not covered.

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
        (`DPOptimizer.clipping_options.count_stddev`): the count's release (multiplier
        2 σ_b, its sensitivity being 1/2) is composed with the gradient's, giving the
        Gaussian of multiplier (σ_Δ^-2 + (2 σ_b)^-2)^(-1/2). Leave it None when passing
        the optimizer's total `noise_multiplier`, which already includes it.

    Returns:
      ε as a float (0.0 for 0 steps).

    Example:
      eps = pertower.compute_epsilon(steps=60 * 60000 // 256, noise_multiplier=1.1,
                                     sampling_probability=256 / 60000, delta=1e-5)
      tighter = pertower.compute_epsilon(60 * 60000 // 256, 1.1, 256 / 60000, 1e-5,
                                         accountant="pld")
    """
    steps = _checks.positive_int(steps, "steps", low=0)
    noise_multiplier = _number(noise_multiplier, "noise_multiplier", 0, math.inf, True, True)
    sampling_probability = _number(sampling_probability, "sampling_probability", 0, 1,
                                   True, False)
    delta = _number(delta, "delta", 0, 1, True, True)
    if accountant not in _ACCOUNTANTS:
        raise _context.error(ValueError, f"`accountant` must be one of {_ACCOUNTANTS}, but "
                             f"received {accountant!r}.")
    if clipped_count_stddev is not None:
        count_stddev = _number(clipped_count_stddev, "clipped_count_stddev", 0, math.inf,
                               True, True)
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

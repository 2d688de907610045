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
here). Batches drawn by shuffling rather than Poisson sampling make the figure an
approximation, as there.
"""

import math
import numbers

from pertower import _checks
from pertower import _context

__all__ = ["compute_epsilon"]


def _number(value, argument, low, high, low_open, high_open):
    """`value` as a float in the given interval; raises with the argument's name."""
    return _checks.real_number(value, argument, low, high, low_open,
                               high_open)


@_context.public("compute_epsilon")
def compute_epsilon(steps, noise_multiplier, sampling_probability, delta):
    """The ε of (ε, δ)-DP after `steps` DP-SGD steps, by the RDP accountant.

    Uses `dp_accounting.rdp.RdpAccountant` (its default orders, add-or-remove-one
    neighbours) on `steps` compositions of
    `PoissonSampledDpEvent(sampling_probability, GaussianDpEvent(noise_multiplier))`.

    Args:
      steps: T >= 0, the number of noisy updates (epochs * N / B).
      noise_multiplier: σ > 0, as given to `pertower.DPOptimizer` (σ = 0 gives no
        privacy; ε would be infinite).
      sampling_probability: q in (0, 1], the batch size over the number of training
        examples.
      delta: δ in (0, 1), usually below 1 / N.

    Returns:
      ε as a float (0.0 for 0 steps).

    Example:
      eps = pertower.compute_epsilon(steps=60 * 60000 // 256, noise_multiplier=1.1,
                                     sampling_probability=256 / 60000, delta=1e-5)
    """
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 0:
        raise _context.error(ValueError, f"`steps` must be a non-negative integer, "
                             f"but received {steps!r}.")
    noise_multiplier = _number(noise_multiplier, "noise_multiplier", 0, math.inf, True, True)
    sampling_probability = _number(sampling_probability, "sampling_probability", 0, 1,
                                   True, False)
    delta = _number(delta, "delta", 0, 1, True, True)
    if steps == 0:
        return 0.0
    try:
        import dp_accounting  # pylint: disable=import-outside-toplevel
    except ImportError:
        raise ImportError(_context.prefix() + " needs Google's dp-accounting package: "
                          "pip install dp-accounting") from None
    event = dp_accounting.PoissonSampledDpEvent(
        sampling_probability, dp_accounting.GaussianDpEvent(noise_multiplier))
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(event, int(steps))
    return float(accountant.get_epsilon(delta))

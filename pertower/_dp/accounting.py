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

Other mechanisms (`mechanism=`), each over T steps with k = `epochs` participations:
  "tree": DP-FTRL's tree aggregation (Kairouz et al. 2021, arXiv 2103.00039) in a fixed
    order without sampling (q = 1), the tree restarted at each epoch, so each example is
    in each of the k trees once: `SingleEpochTreeAggregationDpEvent(σ, T/k)` per tree
    (depth ceil(log2(T/k + 1)), Appendix D), neighbours by zero-out (dp-accounting's
    REPLACE_SPECIAL), RDP accountant only.
  "banded_mf": banded matrix-factorization noise (`pertower.BandedMFNoise`, C with b bands
    and max column norm 1). Fixed order (q = 1), participations at least b steps apart
    (T/k >= b): sensitivity sqrt(k), one Gaussian mechanism of multiplier σ / sqrt(k)
    (Choquette-Choo et al. 2023, arXiv 2306.08153, Sec. 3). With q < 1, b-min-sep
    sampling (the examples split into b groups, step t drawing each example of group
    t mod b with probability q; arXiv 2306.08153, Theorem 4): ceil(T/b) Poisson-subsampled
    Gaussians of multiplier σ, as DP-SGD. Ordinary Poisson sampling from all examples has
    no such bound and is not accounted. Neighbours by add/remove (or zero-out: the same
    Gaussian sensitivity).
"""

import collections
import functools
import math

from pertower import _checks
from pertower import _context

__all__ = ["compute_epsilon", "compute_noise_multiplier"]

_ACCOUNTANTS = ("rdp", "pld")
_MECHANISMS = ("gaussian", "tree", "banded_mf")


@_context.public("compute_epsilon")
def compute_epsilon(steps, noise_multiplier, sampling_probability, delta, accountant="rdp",
                    clipped_count_stddev=None, mechanism="gaussian", epochs=None, bands=None):
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
        Only with mechanism="gaussian".
      mechanism: "gaussian" (default: DP-SGD), "tree" (DP-FTRL; σ the noise of a tree
        node over the clip norm; sampling_probability 1) or "banded_mf"
        (`pertower.BandedMFNoise`; sampling_probability 1 for a fixed order, or q of
        b-min-sep sampling): the module docstring.
      epochs: k >= 1 (default 1) with "tree" and "banded_mf" in a fixed order: the
        participations of one example, one per epoch of T/k steps (the tree restarted
        at each epoch; banded MF needs T/k >= bands when k > 1). None otherwise.
      bands: b >= 1, the `bands` of the `pertower.BandedMFNoise`, with "banded_mf" only.

    Returns:
      ε as a float (0.0 for 0 steps).

    Raises:
      ValueError: for a bad argument, or one that does not fit `mechanism`.

    Example:
      eps = pertower.compute_epsilon(steps=60 * 60000 // 256, noise_multiplier=1.1,
                                     sampling_probability=256 / 60000, delta=1e-5)
      tighter = pertower.compute_epsilon(60 * 60000 // 256, 1.1, 256 / 60000, 1e-5,
                                         accountant="pld")
      ftrl = pertower.compute_epsilon(10 * 234, 4.0, 1.0, 1e-5, mechanism="tree",
                                      epochs=10)
      banded = pertower.compute_epsilon(10 * 234, 4.0, 1.0, 1e-5, mechanism="banded_mf",
                                        epochs=10, bands=16)
    """
    steps = _checks.positive_int(steps, "steps", low=0)
    noise_multiplier = _checks.real_number(noise_multiplier, "noise_multiplier", 0,
                                           math.inf, True, True)
    sampling_probability = _checks.real_number(sampling_probability,
                                               "sampling_probability", 0, 1, True, False)
    delta = _checks.real_number(delta, "delta", 0, 1, True, True)
    _check_accountant(accountant)
    spec = _mechanism(mechanism, steps, sampling_probability, accountant, epochs, bands)
    if clipped_count_stddev is not None:
        if mechanism != "gaussian":
            raise _context.error(ValueError, "`clipped_count_stddev` (adaptive clipping) "
                                 f"is accounted with mechanism='gaussian' only, not "
                                 f"{mechanism!r}.")
        count_stddev = _checks.real_number(clipped_count_stddev, "clipped_count_stddev",
                                           0, math.inf, True, True)
        # Theorem 1 of arXiv 1905.03871: Gaussians compose as σ^-2 = σ_Δ^-2 + (2 σ_b)^-2
        noise_multiplier = (noise_multiplier ** -2 + (2.0 * count_stddev) ** -2) ** -0.5
    if steps == 0:
        return 0.0
    return _epsilon(steps, noise_multiplier, sampling_probability, delta, accountant, spec)


# a mechanism's accounting: its name, k participations (or None) and b bands (or None)
_Spec = collections.namedtuple("_Spec", ["name", "epochs", "bands"])


def _mechanism(mechanism, steps, sampling_probability, accountant, epochs, bands):
    """The checked `_Spec` of `mechanism` for T = `steps` (the module docstring)."""
    if mechanism not in _MECHANISMS:
        raise _context.error(ValueError, f"`mechanism` must be one of {_MECHANISMS}, but "
                             f"received {mechanism!r}.")
    if bands is not None and mechanism != "banded_mf":
        raise _context.error(ValueError, f"`bands` is for mechanism='banded_mf', but "
                             f"mechanism={mechanism!r} received bands={bands!r}.")
    fixed_order = sampling_probability == 1
    if epochs is not None and (mechanism == "gaussian" or not fixed_order):
        raise _context.error(
            ValueError, f"`epochs` counts the participations of a fixed order "
            f"(mechanism 'tree' or 'banded_mf' with sampling_probability 1), but "
            f"mechanism={mechanism!r} and sampling_probability={sampling_probability:g} "
            f"received epochs={epochs!r}; leave it None.")
    if mechanism == "gaussian":
        return _Spec(mechanism, None, None)
    k = 1 if epochs is None else _checks.positive_int(epochs, "epochs")
    if fixed_order and steps and steps < k:
        raise _context.error(ValueError, f"`epochs` ({k}) cannot exceed `steps` ({steps}): "
                             "an epoch is at least one step.")
    if mechanism == "tree":
        if not fixed_order:
            raise _context.error(
                ValueError, "mechanism='tree' (DP-FTRL) is accounted without sampling: "
                f"pass sampling_probability=1 (a fixed order), not "
                f"{sampling_probability:g}.")
        if accountant != "rdp":
            raise _context.error(ValueError, "mechanism='tree' is accounted with "
                                 "accountant='rdp' only (dp-accounting's PLD accountant has "
                                 f"no tree event), but received {accountant!r}.")
        return _Spec(mechanism, k, None)
    if bands is None:
        raise _context.error(ValueError, "mechanism='banded_mf' needs `bands`, the "
                             "BandedMFNoise's number of bands.")
    b = _checks.positive_int(bands, "bands")
    if fixed_order and k > 1 and steps // k < b:
        raise _context.error(
            ValueError, f"mechanism='banded_mf' needs an example's participations at least "
            f"bands={b} steps apart, but {k} epochs of {steps} steps are {steps // k} "
            "steps apart; use fewer bands or epochs, or more steps per epoch.")
    return _Spec(mechanism, k, b)


def _check_accountant(accountant):
    if accountant not in _ACCOUNTANTS:
        raise _context.error(ValueError, f"`accountant` must be one of {_ACCOUNTANTS}, but "
                             f"received {accountant!r}.")


def _epsilon(steps, noise_multiplier, sampling_probability, delta, accountant, spec):
    """ε of `steps` > 0 steps of `spec`'s mechanism of multiplier σ > 0 (checked)."""
    try:
        import dp_accounting  # pylint: disable=import-outside-toplevel
    except ImportError:
        raise ImportError(_context.prefix() + " needs Google's dp-accounting package: "
                          "pip install dp-accounting") from None
    relation = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    gaussian = dp_accounting.GaussianDpEvent(noise_multiplier)
    count = steps
    if spec.name == "gaussian":
        event = dp_accounting.PoissonSampledDpEvent(sampling_probability, gaussian)
    elif spec.name == "tree":      # k trees of about T/k steps, one participation each
        relation = dp_accounting.NeighboringRelation.REPLACE_SPECIAL
        short, longer = divmod(steps, spec.epochs)
        event, count = dp_accounting.ComposedDpEvent([
            dp_accounting.SingleEpochTreeAggregationDpEvent(noise_multiplier, short + 1)
            for _ in range(longer)] + [
            dp_accounting.SingleEpochTreeAggregationDpEvent(noise_multiplier, short)
            for _ in range(spec.epochs - longer)]), 1
    elif sampling_probability == 1:   # banded MF, fixed order: sensitivity sqrt(k)
        event, count = dp_accounting.GaussianDpEvent(
            noise_multiplier / math.sqrt(spec.epochs)), 1
    else:                             # banded MF, b-min-sep sampling: ceil(T/b) steps
        event = dp_accounting.PoissonSampledDpEvent(sampling_probability, gaussian)
        count = -(-steps // spec.bands)
    if accountant == "pld":
        from dp_accounting import pld  # pylint: disable=import-outside-toplevel
        counter = pld.PLDAccountant(neighboring_relation=relation)
    else:
        counter = dp_accounting.rdp.RdpAccountant(neighboring_relation=relation)
    counter.compose(event, int(count))
    return float(counter.get_epsilon(delta))


# the bracket of compute_noise_multiplier: σ in [_SIGMA_LOW, _SIGMA_HIGH]
_SIGMA_LOW, _SIGMA_HIGH = 2.0 ** -10, 2.0 ** 20


@_context.public("compute_noise_multiplier")
def compute_noise_multiplier(target_epsilon, steps, sampling_probability, delta,
                             accountant="rdp", tolerance=1e-3, mechanism="gaussian",
                             epochs=None, bands=None):
    """The smallest σ whose ε after `steps` DP-SGD steps is at most `target_epsilon`.

    ε(σ) is `compute_epsilon(steps, σ, sampling_probability, delta, accountant)`, which
    decreases as σ grows. σ is bracketed by doubling or halving from 1, then bisected
    until the bracket [lo, hi] has hi - lo <= tolerance * hi; hi is returned, so that
    ε(σ) <= target_epsilon < ε(σ (1 - tolerance)) (TensorFlow Privacy's
    `compute_noise_from_budget`, Opacus' `get_noise_multiplier`).

    Args:
      target_epsilon: ε > 0 to reach.
      steps: T >= 1, as in `compute_epsilon`.
      sampling_probability: q in (0, 1], as in `compute_epsilon`.
      delta: δ in (0, 1).
      accountant: "rdp" (default) or "pld".
      tolerance: the relative resolution of σ, in (0, 0.5].
      mechanism, epochs, bands: as in `compute_epsilon`.

    Returns:
      σ as a float, for `pertower.DPOptimizer`'s `noise_multiplier` (that of its
      `mechanism`).

    Raises:
      ValueError: for a bad argument, a target that no σ up to 2^20 reaches (e.g. 1e9
        steps at q = 1), or one that every σ down to 2^-10 reaches.

    Example:
      sigma = pertower.compute_noise_multiplier(3.0, steps=60 * 60000 // 256,
                                                sampling_probability=256 / 60000,
                                                delta=1e-5)
    """
    target = _checks.real_number(target_epsilon, "target_epsilon", 0, math.inf, True, True)
    steps = _checks.positive_int(steps, "steps")
    sampling_probability = _checks.real_number(sampling_probability,
                                               "sampling_probability", 0, 1, True, False)
    delta = _checks.real_number(delta, "delta", 0, 1, True, True)
    _check_accountant(accountant)
    tolerance = _checks.real_number(tolerance, "tolerance", 0, 0.5, True, False)
    spec = _mechanism(mechanism, steps, sampling_probability, accountant, epochs, bands)

    @functools.lru_cache(maxsize=None)
    def epsilon(sigma):   # each σ once: the brackets' ends are asked for again
        return _epsilon(steps, sigma, sampling_probability, delta, accountant, spec)

    lo, hi = 0.5, 1.0
    while epsilon(hi) > target:       # grow until hi reaches the target
        lo, hi = hi, 2.0 * hi
        if hi > _SIGMA_HIGH:
            raise _context.error(
                ValueError, f"`target_epsilon` {target:g} is not reached by any noise "
                f"multiplier up to {_SIGMA_HIGH:g} (ε there is {epsilon(_SIGMA_HIGH):g} "
                f"with accountant={accountant!r}, steps={steps}, delta={delta:g}); raise "
                "target_epsilon or delta, or try accountant='pld'.")
    while epsilon(lo) <= target:      # shrink until lo misses it
        lo, hi = 0.5 * lo, lo
        if lo < _SIGMA_LOW:
            raise _context.error(
                ValueError, f"`target_epsilon` {target:g} is reached by every noise "
                f"multiplier down to {_SIGMA_LOW:g} (steps={steps}, "
                f"sampling_probability={sampling_probability:g}, delta={delta:g}); ask "
                "for a smaller target_epsilon.")
    while hi - lo > tolerance * hi:   # ε(lo) > target >= ε(hi)
        mid = 0.5 * (lo + hi)
        if epsilon(mid) > target:
            lo = mid
        else:
            hi = mid
    return hi

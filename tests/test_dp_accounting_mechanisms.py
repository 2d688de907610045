"""compute_epsilon's mechanisms "tree" (DP-FTRL) and "banded_mf" against dp-accounting's
own events and the closed forms they reduce to (a Gaussian mechanism of a larger
sensitivity), monotonicity, compute_noise_multiplier with a mechanism, bad arguments.
"""

import math

import dp_accounting
import pytest

import pertower


def _gaussian_epsilon(sigma, delta, accountant="rdp"):
    """ε of one Gaussian mechanism of multiplier σ (q = 1, one step)."""
    return pertower.compute_epsilon(1, sigma, 1.0, delta, accountant=accountant)


@pytest.mark.parametrize("steps, epochs, sigma", [(2340, 10, 4.0), (100, 1, 2.0), (50, 5, 1.5)])
def test_tree_epsilon_is_dp_accounting_s_tree_with_a_restart_per_epoch(steps, epochs, sigma):
    counter = dp_accounting.rdp.RdpAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_SPECIAL)
    counter.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.SingleEpochTreeAggregationDpEvent(sigma, steps // epochs), epochs))
    got = pertower.compute_epsilon(steps, sigma, 1.0, 1e-5, mechanism="tree", epochs=epochs)
    assert got == pytest.approx(counter.get_epsilon(1e-5), rel=1e-12)
    # k trees of depth ceil(log2(T/k + 1)) (arXiv 2103.00039, App. D): one Gaussian of
    # sensitivity sqrt(k depth)
    depth = math.ceil(math.log2(steps // epochs + 1))
    assert got == pytest.approx(_gaussian_epsilon(sigma / math.sqrt(epochs * depth), 1e-5),
                                rel=1e-9)


def test_tree_epochs_of_unequal_length():
    # 10 steps in 3 epochs: trees of 4, 3, 3 steps, depths 3, 2, 2: sensitivity² 7
    got = pertower.compute_epsilon(10, 2.0, 1.0, 1e-6, mechanism="tree", epochs=3)
    assert got == pytest.approx(_gaussian_epsilon(2.0 / math.sqrt(7), 1e-6), rel=1e-9)


@pytest.mark.parametrize("accountant, rel", [("rdp", 1e-9), ("pld", 1e-3)])
def test_banded_mf_in_a_fixed_order_is_the_gaussian_at_sigma_over_its_sensitivity(
        accountant, rel):
    cases = ((2340, 10, 16, 4.0), (300, 3, 100, 1.2), (8, 1, 1, 3.0))
    for steps, epochs, bands, sigma in cases[:1] if accountant == "pld" else cases:
        got = pertower.compute_epsilon(steps, sigma, 1.0, 1e-5, accountant=accountant,
                                       mechanism="banded_mf", epochs=epochs, bands=bands)
        sensitivity = pertower.BandedMFNoise(bands).sensitivity(epochs)     # sqrt(k)
        assert sensitivity == pytest.approx(math.sqrt(epochs))
        want = _gaussian_epsilon(sigma / sensitivity, 1e-5, accountant)
        assert got == pytest.approx(want, rel=rel), (steps, epochs, bands)


def test_banded_mf_with_min_sep_sampling_is_dp_sgd_over_the_steps_divided_by_the_bands():
    """arXiv 2306.08153, Theorem 4: ceil(T/b) Poisson-subsampled Gaussians; b = 1 is
    DP-SGD itself."""
    for steps, bands in ((1001, 10), (300, 1)):
        got = pertower.compute_epsilon(steps, 1.0, 0.05, 1e-5, mechanism="banded_mf",
                                       bands=bands)
        assert got == pytest.approx(pertower.compute_epsilon(
            -(-steps // bands), 1.0, 0.05, 1e-5), rel=1e-12)


def test_epsilons_move_the_right_way():
    tree = [pertower.compute_epsilon(1000, s, 1.0, 1e-5, mechanism="tree", epochs=5)
            for s in (2.0, 4.0, 8.0)]
    assert tree[0] > tree[1] > tree[2]
    by_epochs = [pertower.compute_epsilon(1000, 4.0, 1.0, 1e-5, mechanism=m, epochs=k,
                                          **({"bands": 8} if m == "banded_mf" else {}))
                 for m in ("tree", "banded_mf") for k in (1, 4, 10)]
    assert by_epochs[0] < by_epochs[1] < by_epochs[2]
    assert by_epochs[3] < by_epochs[4] < by_epochs[5]
    # the banded mechanism's sensitivity sqrt(k) is below the tree's sqrt(k depth)
    assert all(b < t for b, t in zip(by_epochs[3:], by_epochs[:3]))
    sampled = [pertower.compute_epsilon(1000, 1.0, 0.05, 1e-5, mechanism="banded_mf",
                                        bands=b) for b in (1, 4, 16)]
    assert sampled[0] > sampled[1] > sampled[2]
    assert pertower.compute_epsilon(0, 1.0, 1.0, 1e-5, mechanism="tree") == 0.0


@pytest.mark.parametrize("mechanism, extra", [("tree", {"epochs": 4}),
                                              ("banded_mf", {"epochs": 4, "bands": 8})])
def test_compute_noise_multiplier_with_a_mechanism(mechanism, extra):
    steps, target, tolerance = 400, 2.0, 1e-3
    sigma = pertower.compute_noise_multiplier(target, steps, 1.0, 1e-5, mechanism=mechanism,
                                              tolerance=tolerance, **extra)
    eps = lambda s: pertower.compute_epsilon(steps, s, 1.0, 1e-5,  # noqa: E731
                                             mechanism=mechanism, **extra)
    assert eps(sigma) <= target < eps(sigma * (1 - tolerance))


@pytest.mark.parametrize("kwargs, message", [
    (dict(mechanism="ftrl"), "`mechanism` must be one of"),
    (dict(mechanism="tree", sampling_probability=0.1), "pass sampling_probability=1"),
    (dict(mechanism="tree", accountant="pld"), "accountant='rdp' only"),
    (dict(mechanism="tree", bands=4), "`bands` is for mechanism='banded_mf'"),
    (dict(mechanism="tree", epochs=11), r"`epochs` \(11\) cannot exceed `steps` \(10\)"),
    (dict(mechanism="tree", epochs=0), "`epochs` must be a positive integer"),
    (dict(mechanism="banded_mf"), "needs `bands`"),
    (dict(mechanism="banded_mf", bands=0), "`bands` must be a positive integer"),
    (dict(mechanism="banded_mf", bands=4, epochs=3), "are 3 steps apart"),
    (dict(mechanism="banded_mf", bands=2, epochs=2, sampling_probability=0.5),
     "`epochs` counts the participations of a fixed order"),
    (dict(epochs=2), "`epochs` counts the participations"),
    (dict(mechanism="banded_mf", bands=2, clipped_count_stddev=1.0),
     "`clipped_count_stddev` .* mechanism='gaussian' only"),
])
def test_mechanism_arguments_are_checked(kwargs, message):
    arguments = dict(steps=10, noise_multiplier=1.0, sampling_probability=1.0, delta=1e-5)
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=f"pertower.compute_epsilon: .*{message}"):
        pertower.compute_epsilon(**arguments)
    del arguments["noise_multiplier"], arguments["steps"]
    if "clipped_count_stddev" not in arguments:
        with pytest.raises(ValueError,
                           match=f"pertower.compute_noise_multiplier: .*{message}"):
            pertower.compute_noise_multiplier(1.0, 10, **arguments)

"""The noise mechanisms of a DP step, behind one interface, and their configs.

A mechanism is an object with

    add(gradients, stddevs)   [*x.shape] per weight x -> g_x + s_x · (its noise); the
                              returned tensors move its state (one release per run)
    key()                     [2] int64, a fresh stateless key per computation, for
                              noise beside the gradient's (adaptive clipping's count)
    seed                      an int or None
    get_config()              the constructor's arguments (for Keras' `get_config`)

`_dp.noise.GaussianNoise` (DP-SGD's independent noise, the default),
`_dp.banded.BandedMFNoise` (`pertower.BandedMFNoise`, noise correlated across steps) and
`_dp.tree.TreeNoise` (DP-FTRL's tree aggregation) are given to
`DPOptimizer(..., mechanism=)`, the Keras DP classes and `DPSyncReplicasOptimizer`.
"""

from pertower import _context
from pertower._dp import banded
from pertower._dp import tree

__all__ = ["check_mechanism", "to_config", "from_config"]

# the mechanisms a Keras config can name, by class name
_CLASSES = {cls.__name__: cls for cls in (banded.BandedMFNoise, tree.TreeNoise)}


def check_mechanism(mechanism, seed, clipping_options):
    """`mechanism` when it is a noise object and `seed` is None; the tree's noise only
    with flat clipping at a fixed clip norm (a tree sums releases of one sensitivity)."""
    if not all(callable(getattr(mechanism, name, None)) for name in ("add", "key")):
        raise _context.error(
            TypeError, "`mechanism` must be None or a noise object such as "
            f"pertower.BandedMFNoise(bands=4), but received {type(mechanism).__name__} "
            f"({mechanism!r:.80}).")
    if seed is not None:
        raise _context.error(
            ValueError, f"`seed` ({seed}) is for the default Gaussian noise; with "
            "`mechanism`, give the seed to the mechanism (e.g. "
            "pertower.BandedMFNoise(4, seed=...)) and leave `seed` None.")
    if isinstance(mechanism, tree.TreeNoise) and (
            clipping_options.kind != "flat" or clipping_options.adaptive is not None):
        raise _context.error(
            ValueError, "the tree's noise (DP-FTRL) needs flat clipping with a fixed clip "
            f"norm, but received clipping={clipping_options.kind!r} and adaptive_clipping="
            f"{clipping_options.adaptive!r}. Pass clipping=\"flat\" and "
            "adaptive_clipping=None.")
    return mechanism


def to_config(mechanism):
    """None, or {"class_name": ..., "config": the constructor's arguments}."""
    if mechanism is None:
        return None
    if _CLASSES.get(type(mechanism).__name__) is not type(mechanism):
        raise _context.error(
            ValueError, f"a config cannot hold the mechanism {type(mechanism).__name__} "
            f"(only {', '.join(sorted(_CLASSES))}): save the model's weights "
            "(model.save_weights) and build the optimizer again in code.")
    return {"class_name": type(mechanism).__name__, "config": mechanism.get_config()}


def from_config(config):
    """The mechanism `to_config` described (a mechanism object or None passes through)."""
    if not isinstance(config, dict):
        return config
    if set(config) != {"class_name", "config"} or config["class_name"] not in _CLASSES:
        raise _context.error(
            ValueError, "`mechanism` as a dict must be {\"class_name\": one of "
            f"{sorted(_CLASSES)}, \"config\": its arguments}} (as get_config gives it), but "
            f"received {config!r:.120}.")
    return _CLASSES[config["class_name"]](**config["config"])

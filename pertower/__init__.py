"""pertower: per-example gradients for TensorFlow graph mode: per-op rules where they
provably apply, weight-copy towers elsewhere (method="auto", the default).

The public names are listed in `__all__` and loaded on first use (PEP 562): `import
pertower` imports neither TensorFlow nor any submodule and changes no setting.
`pertower.oracle` holds the slow, obviously correct one-example loop.
"""

import importlib
import importlib.util

from pertower._version import __version__

__all__ = [
    "per_example_gradients", "per_example_jacobians", "microbatch_gradients",
    "per_example_norms", "explain", "Towers", "build_towers", "check_independence",
    "estimate_memory", "Plan", "MemoryEstimate", "UnconnectedWeightsWarning",
    "PerExampleIndexedSlices", "flatten", "flatten_per_example", "dot", "cosine_similarity",
    "global_norms", "pairwise_dot", "pairwise_cosine", "DPOptimizer",
    "DPSyncReplicasOptimizer", "DPFTRLOptimizer", "AdaptiveClipping", "poisson_batches",
    "poisson_capacity",
    "compute_epsilon", "compute_noise_multiplier", "tracin", "tracin_over_checkpoints",
    "similarity_matrix", "class_similarity", "fisher_diagonal", "gradient_variance", "NoiseScale",
    "gradient_noise_scale", "empirical_ntk", "sum_grad_squared", "diag_ggn", "kfac_factors",
    "KroneckerFactors", "BandedMFNoise",
]

# public names by the module that defines them
_MODULES = {
    "pertower._api.gradients": ("per_example_gradients", "per_example_jacobians",
                                "microbatch_gradients"),
    "pertower._api.norms": ("per_example_norms",),
    "pertower._api.explain": ("explain", "estimate_memory"),
    "pertower._towers.build": ("Towers", "build_towers"),
    "pertower._guards.independence": ("check_independence",),
    "pertower._plan": ("Plan",),
    "pertower._guards.memory": ("MemoryEstimate",),
    "pertower._checks": ("UnconnectedWeightsWarning",),
    "pertower._towers.sparse": ("PerExampleIndexedSlices",),
    "pertower._reductions": ("flatten", "flatten_per_example", "dot", "cosine_similarity",
                             "global_norms", "pairwise_dot", "pairwise_cosine"),
    "pertower._dp.optimizer": ("DPOptimizer",),
    "pertower._dp.distributed": ("DPSyncReplicasOptimizer",),
    "pertower._dp.ftrl": ("DPFTRLOptimizer",),
    "pertower._dp.banded": ("BandedMFNoise",),
    "pertower._dp.clipping": ("AdaptiveClipping",),
    "pertower._dp.sampling": ("poisson_batches", "poisson_capacity"),
    "pertower._dp.accounting": ("compute_epsilon", "compute_noise_multiplier"),
    "pertower._analytics.influence": ("tracin", "tracin_over_checkpoints"),
    "pertower._analytics.similarity": ("similarity_matrix", "class_similarity", "empirical_ntk"),
    "pertower._analytics.gradient_statistics": ("fisher_diagonal", "gradient_variance",
                                                "NoiseScale", "gradient_noise_scale"),
    "pertower._api.curvature": ("sum_grad_squared", "diag_ggn"),
    "pertower._curvature.kfac": ("kfac_factors", "KroneckerFactors"),
}
_LAZY = {name: module for module, names in _MODULES.items() for name in names}


def __getattr__(name):
    """Imports the module defining public `name` on first access (PEP 562)."""
    module_name = _LAZY.get(name)
    if module_name is None:
        if not name.startswith("__") and importlib.util.find_spec(f"pertower.{name}"):
            # a submodule, e.g. `pertower.oracle`, as the eager imports used to load it
            return importlib.import_module(f"pertower.{name}")
        raise AttributeError(f"module 'pertower' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__():
    """The module's names and every public name, loaded or not."""
    return sorted(set(globals()) | set(__all__))

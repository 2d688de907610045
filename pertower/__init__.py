"""pertower: per-example gradients for TensorFlow graph mode: per-op rules where they
provably apply, weight-copy towers elsewhere (method="auto", the default).

Public surface:
    per_example_gradients, per_example_jacobians, microbatch_gradients,
    per_example_norms
    Towers, build_towers
    explain, check_independence, estimate_memory
    Plan, MemoryEstimate, UnconnectedWeightsWarning (what explain and estimate_memory
    return, and the warning that names weights `ys` does not reach)
    PerExampleIndexedSlices (sparse=True results for embedding weights)
    flatten, flatten_per_example, dot, cosine_similarity, global_norms,
    pairwise_dot, pairwise_cosine
    DPOptimizer, DPSyncReplicasOptimizer, AdaptiveClipping, poisson_batches,
    poisson_capacity, compute_epsilon
    tracin, tracin_over_checkpoints, similarity_matrix, class_similarity,
    fisher_diagonal, gradient_variance, NoiseScale, gradient_noise_scale, empirical_ntk
    sum_grad_squared, diag_ggn (curvature: the GGN / Fisher diagonal),
    kfac_factors, KroneckerFactors (its Kronecker factors per dense or Conv2D kernel)

`pertower.oracle` holds the slow, obviously correct one-example loop that the tests,
examples and demo compare with.

The public names are loaded on first use (PEP 562 module `__getattr__`): `import
pertower` imports neither TensorFlow nor any submodule, so the `pertower` command
starts quickly and `pertower --help` never loads TensorFlow. `pertower.X`,
`from pertower import X`, `from pertower import *` and `dir(pertower)` work as if
every name were imported eagerly. Importing pertower changes no environment
variable, allocator or TensorFlow setting.
"""

import importlib
import importlib.util

from pertower._version import __version__

__all__ = [
    "per_example_gradients",
    "per_example_jacobians",
    "microbatch_gradients",
    "per_example_norms",
    "explain",
    "Towers",
    "build_towers",
    "check_independence",
    "estimate_memory",
    "Plan",
    "MemoryEstimate",
    "UnconnectedWeightsWarning",
    "PerExampleIndexedSlices",
    "flatten",
    "flatten_per_example",
    "dot",
    "cosine_similarity",
    "global_norms",
    "pairwise_dot",
    "pairwise_cosine",
    "DPOptimizer",
    "DPSyncReplicasOptimizer",
    "AdaptiveClipping",
    "poisson_batches",
    "poisson_capacity",
    "compute_epsilon",
    "tracin",
    "tracin_over_checkpoints",
    "similarity_matrix",
    "class_similarity",
    "fisher_diagonal",
    "gradient_variance",
    "NoiseScale",
    "gradient_noise_scale",
    "empirical_ntk",
    "sum_grad_squared",
    "diag_ggn",
    "kfac_factors",
    "KroneckerFactors",
]

# public name -> the module that defines it
_LAZY = {
    "AdaptiveClipping": "pertower._dp.clipping",
    "build_towers": "pertower._towers.build",
    "check_independence": "pertower._guards.independence",
    "class_similarity": "pertower._analytics.similarity",
    "compute_epsilon": "pertower._dp.accounting",
    "cosine_similarity": "pertower._reductions",
    "dot": "pertower._reductions",
    "diag_ggn": "pertower._api.curvature",
    "DPOptimizer": "pertower._dp.optimizer",
    "DPSyncReplicasOptimizer": "pertower._dp.distributed",
    "empirical_ntk": "pertower._analytics.similarity",
    "estimate_memory": "pertower._api.explain",
    "explain": "pertower._api.explain",
    "fisher_diagonal": "pertower._analytics.gradient_statistics",
    "flatten": "pertower._reductions",
    "flatten_per_example": "pertower._reductions",
    "global_norms": "pertower._reductions",
    "gradient_noise_scale": "pertower._analytics.gradient_statistics",
    "gradient_variance": "pertower._analytics.gradient_statistics",
    "kfac_factors": "pertower._curvature.kfac",
    "KroneckerFactors": "pertower._curvature.kfac",
    "MemoryEstimate": "pertower._guards.memory",
    "microbatch_gradients": "pertower._api.gradients",
    "NoiseScale": "pertower._analytics.gradient_statistics",
    "pairwise_cosine": "pertower._reductions",
    "pairwise_dot": "pertower._reductions",
    "per_example_gradients": "pertower._api.gradients",
    "per_example_jacobians": "pertower._api.gradients",
    "per_example_norms": "pertower._api.norms",
    "poisson_batches": "pertower._dp.sampling",
    "poisson_capacity": "pertower._dp.sampling",
    "PerExampleIndexedSlices": "pertower._towers.sparse",
    "Plan": "pertower._plan",
    "similarity_matrix": "pertower._analytics.similarity",
    "sum_grad_squared": "pertower._api.curvature",
    "Towers": "pertower._towers.build",
    "tracin": "pertower._analytics.influence",
    "tracin_over_checkpoints": "pertower._analytics.influence",
    "UnconnectedWeightsWarning": "pertower._checks",
}


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

"""pertower: per-example gradients for TensorFlow graph mode: per-op rules where they
provably apply, weight-copy towers elsewhere (method="auto", the default).

Public surface:
    per_example_gradients, per_example_jacobians, microbatch_gradients,
    per_example_norms
    Towers, build_towers
    check_independence, estimate_memory
    PerExampleIndexedSlices (sparse=True results for embedding weights)
    flatten, flatten_per_example, dot, cosine_similarity, global_norms,
    pairwise_dot, pairwise_cosine
    DPOptimizer, compute_epsilon
    tracin, tracin_over_checkpoints, similarity_matrix, class_similarity,
    fisher_diagonal, gradient_variance, NoiseScale, gradient_noise_scale, empirical_ntk

`pertower.oracle` holds the slow, obviously correct one-example loop that the tests,
examples and demo compare with.
"""

from pertower._dp.accounting import compute_epsilon
from pertower._analytics import NoiseScale
from pertower._analytics import class_similarity
from pertower._analytics import empirical_ntk
from pertower._analytics import fisher_diagonal
from pertower._analytics import gradient_noise_scale
from pertower._analytics import gradient_variance
from pertower._analytics import similarity_matrix
from pertower._analytics import tracin
from pertower._analytics import tracin_over_checkpoints
from pertower._dp.optimizer import DPOptimizer
from pertower._api.gradients import microbatch_gradients
from pertower._api.gradients import per_example_gradients
from pertower._api.gradients import per_example_jacobians
from pertower._guards.independence import check_independence
from pertower._guards.memory import estimate_memory
from pertower._api.norms import per_example_norms
from pertower._reductions import cosine_similarity
from pertower._reductions import dot
from pertower._reductions import flatten
from pertower._reductions import flatten_per_example
from pertower._reductions import global_norms
from pertower._reductions import pairwise_cosine
from pertower._reductions import pairwise_dot
from pertower._towers.sparse import PerExampleIndexedSlices
from pertower._towers.build import Towers
from pertower._towers.build import build_towers

__version__ = "0.1.0"

__all__ = [
    "per_example_gradients",
    "per_example_jacobians",
    "microbatch_gradients",
    "per_example_norms",
    "Towers",
    "build_towers",
    "check_independence",
    "estimate_memory",
    "PerExampleIndexedSlices",
    "flatten",
    "flatten_per_example",
    "dot",
    "cosine_similarity",
    "global_norms",
    "pairwise_dot",
    "pairwise_cosine",
    "DPOptimizer",
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
]

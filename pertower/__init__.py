"""pertower: per-example gradients for TensorFlow graph mode, with weight-copy towers.

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

from pertower.accounting import compute_epsilon
from pertower.analytics import NoiseScale
from pertower.analytics import class_similarity
from pertower.analytics import empirical_ntk
from pertower.analytics import fisher_diagonal
from pertower.analytics import gradient_noise_scale
from pertower.analytics import gradient_variance
from pertower.analytics import similarity_matrix
from pertower.analytics import tracin
from pertower.analytics import tracin_over_checkpoints
from pertower.dp import DPOptimizer
from pertower.gradients import microbatch_gradients
from pertower.gradients import per_example_gradients
from pertower.gradients import per_example_jacobians
from pertower.independence import check_independence
from pertower.memory import estimate_memory
from pertower.norms import per_example_norms
from pertower.reductions import cosine_similarity
from pertower.reductions import dot
from pertower.reductions import flatten
from pertower.reductions import flatten_per_example
from pertower.reductions import global_norms
from pertower.reductions import pairwise_cosine
from pertower.reductions import pairwise_dot
from pertower.sparse import PerExampleIndexedSlices
from pertower.towers import Towers
from pertower.towers import build_towers

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

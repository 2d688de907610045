"""The rules' engine (method="rules"): per-example gradients from one batched backward
pass and per-op rules.

Notation:
    B   examples in the batch          G   groups: B (per example) or M (microbatches)
    x   one weight (entry of `xs`)     A   a weight-consuming op's batch-side input
    Z   that op's output               dZ  d sum(grad_ys * ys) / dZ, from ONE tf.gradients

For every weight x, every read of x that `ys` depends on must reach an op that has a
rule (`pertower.rules`), possibly through layout-only ops on the weight side
(Identity, ExpandDims, Squeeze, Reshape: Conv1D's filter is ExpandDims(W)) or through
functions of the weights alone (a Cast, g·v/||v||, a non-fused batch norm's scale and
shift: `rules._weight_functions`, which pulls the rule's result back to x); and
`pertower._batch_axis` must prove that the op's A and Z rows belong to examples and that
row i of `ys` depends on example i alone. Then

    grad_i(x) = sum over the uses u of x of  rule_u(A_u, dZ_u) for example i,

the chain rule summed over every use (a shared layer adds its contributions). A weight
for which anything is unproven is reported with the reason and left to the towers.

The proof that dZ's rows belong to examples holds for TensorFlow's registered gradients
of the ops between x and `ys`; a weight behind an op whose gradient the user replaced or
wrote in Python is left to the towers (`unassumed`).

Modules:
    plan        `build_plan`: for every weight, its rules' `Use`s or why it falls back
    passes      the batched backward pass and what the rules compute from it: the
                per-group gradients, the squared norms, the clipped sums
    checks      the number of groups, and the run-time checks of the fed batch size
    unassumed   gradients the proof does not assume (overridden, Python-coded)
"""

from pertower._engine.checks import group_count
from pertower._engine.checks import run_time_checks
from pertower._engine.passes import clipped_sums
from pertower._engine.passes import gradients
from pertower._engine.passes import norm_parts
from pertower._engine.passes import output_gradients
from pertower._engine.passes import squared_norms
from pertower._engine.plan import build_plan
from pertower._engine.unassumed import UnassumedGradients

__all__ = ["group_count", "run_time_checks", "clipped_sums", "gradients", "norm_parts",
           "output_gradients", "squared_norms", "build_plan", "UnassumedGradients"]

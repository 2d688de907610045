"""The rules' engine (method="rules"): per-example gradients from one batched backward
pass and per-op rules.

Notation:
    B   examples in the batch          G   groups: B (per example) or M (microbatches)
    x   one weight (entry of `xs`)     A   a weight-consuming op's batch-side input
    Z   that op's output               dZ  d sum(grad_ys * ys) / dZ, from ONE tf.gradients

A weight x is covered when every read of x that `ys` depends on reaches an op with a
rule (`pertower.rules`), directly, through layout-only ops or through functions of the
weights alone (`rules._weight_functions`), and `pertower._batch_axis` proves that the
op's A and Z rows belong to examples and that row i of `ys` depends on example i alone
(for TensorFlow's registered gradients: an overridden or Python-coded one is
`unassumed`). Then, by the chain rule summed over the uses u of x,

    grad_i(x) = sum_u rule_u(A_u, dZ_u) for example i.

Any other weight is left to the towers, with the reason. Modules: `plan` (`build_plan`),
`passes` (the backward pass and what the rules compute from it), `checks` (the number
of groups, run-time checks of the fed batch size), `unassumed`.
"""

from pertower._engine.checks import group_count
from pertower._engine.checks import run_time_checks
from pertower._engine.passes import clipped_sums
from pertower._engine.passes import gradients
from pertower._engine.passes import norm_parts
from pertower._engine.passes import output_gradients
from pertower._engine.plan import build_plan
from pertower._engine.unassumed import UnassumedGradients

__all__ = ["group_count", "run_time_checks", "clipped_sums", "gradients", "norm_parts",
           "output_gradients", "build_plan", "UnassumedGradients"]

"""`explain` and `estimate_memory`: the plan of a call, before anything is built."""

from pertower import _checks
from pertower import _docs
from pertower import _dispatch
from pertower import _request
from pertower import _context

__all__ = ["explain", "estimate_memory"]


@_context.public("explain")
@_docs.documented
def explain(ys, xs, batch=None, batch_size=None, num_microbatches=None, method="auto",
            rules=None, sparse=False, validate=None, batch_axis=None):
    """How pertower would compute the per-example gradients of `ys`, without building.

    Args:
      ys, xs: as in `pertower.per_example_gradients`.
      {options: batch, batch_size, method, rules, sparse, validate, batch_axis}
      num_microbatches: M, as in `pertower.microbatch_gradients` (None: per example).

    Returns:
      A `Plan` whose `str()` is a table: per weight, its method and the ops whose rules
      compute it, or why it falls back to the towers (or, past a TF1 while loop, row
      passes); the ops that couple examples; whether independence was proven or where
      the proof was lost (then a run-time check is added by default); the memory
      estimate. `plan.weights` holds the same per weight (`WeightPlan`s). Couplings
      and a strict method's uncovered weights are shown, not raised.

    Example:
      print(pertower.explain(cost, net.trainable_weights))
    """
    return _dispatch.plan_call(
        ys, xs, None, _request.Examples(batch, batch_size, num_microbatches, batch_axis),
        _dispatch.options(method, rules, sparse=sparse, validate=validate,
                          memory_limit=float("inf"), refuse=False))[2]


@_context.public("estimate_memory")
@_docs.documented
def estimate_memory(ys, xs, batch=None, batch_size=None, num_microbatches=None,
                    outputs_per_example=1, method="auto", rules=None, batch_axis=None):
    """Estimates the bytes per-example gradients of `ys` with respect to `xs` will hold,
    as the memory guard of every gradient function does (`pertower._guards.memory`).

    Args:
      ys, xs: as in `pertower.per_example_gradients`.
      {options: batch, batch_size, method, rules, batch_axis}
      num_microbatches: M for microbatch gradients (None: one row per example).
      outputs_per_example: K, the output entries per example for Jacobians.

    Returns:
      A `MemoryEstimate`, or None when B is not known yet (no static batch axis and
      no batch_size).

    Example:
      estimate = pertower.estimate_memory(cost, net.trainable_weights, batch_size=512)
      print(estimate.describe())
    """
    K = _checks.positive_int(outputs_per_example, "outputs_per_example")
    return _dispatch.plan_call(
        ys, xs, None, _request.Examples(batch, batch_size, num_microbatches, batch_axis),
        _dispatch.options(method, rules, validate=False, memory_limit=float("inf"),
                          outputs_per_example=K, refuse=False))[2].estimate

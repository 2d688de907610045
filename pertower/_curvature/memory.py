"""The memory guard of `diag_ggn` and `sum_grad_squared`: what each weight's route holds.

Notation:
    B   examples        C   columns (1 for `sum_grad_squared`, M for `diag_ggn`)
    x   one weight      s   bytes per number      Z  a rule's output (its dZ columns)

The general guard (`pertower._guards.memory`) counts B x C x |x| numbers for every
weight: C per-example gradients. The routes of `pertower._curvature.squares` hold less
or more than that, so the curvature functions estimate per route:

    rules, cheap form    what the rule says its `sum_squared_size` holds per example
                         (a dense layer with one row per example: nothing but the
                         [B, *x] result when per example; a convolution: its C wide
                         per-example gradients, or the ghost form's Gram matrices);
    rules, per column    C per-example gradients, B x C x |x|;
    fallback             C per-example gradients and the towers' copies before
                         stacking, as the general guard counts them;
  plus, for the rules, the C columns of every use's output gradient, B x C x |Z| per
  example, and the replayed forward activations (as the general guard).
A rule whose `sum_squared_size` is None (the default) is counted as per column.
"""

import dataclasses

import tensorflow as tf

from pertower._guards import memory

__all__ = ["CurvatureEstimate", "route_size", "guard"]


@dataclasses.dataclass(frozen=True)
class CurvatureEstimate(memory.MemoryEstimate):
    """A `MemoryEstimate` whose result term is what the curvature routes hold.

    Attributes (besides `MemoryEstimate`'s):
      columns: C.
      column_bytes: the C output-gradient columns of the rules' outputs.
    """

    columns: int = 1
    column_bytes: int = 0

    @property
    def total_bytes(self):
        return super().total_bytes + self.column_bytes

    def describe(self):
        gb = memory.gb
        held = (f", the {self.num_towers} {self.fallback}' gradients before stacking "
                f"{gb(self.tower_gradient_bytes)}" if self.tower_gradient_bytes else "")
        return (f"{gb(self.total_bytes)}: what the routes hold for {self.batch_size} "
                f"examples x {self.columns} columns over {self.num_weights} weights = "
                f"{gb(self.result_bytes)}{held}, the columns' output gradients "
                f"{gb(self.column_bytes)}, replayed activations "
                f"{gb(self.activation_bytes)}")


def route_size(uses, x, C, per_example):
    """Numbers per example that the route of weight `x` (covered by `uses`) holds for C
    columns; 0 for a weight no use reaches, None when x's shape is not static."""
    size = memory.static_size(tf.TensorShape(x.shape))
    if not uses or size is None:
        return 0 if not uses else None
    if len(uses) == 1:
        cheap = uses[0].rule.sum_squared_size(uses[0], C, per_example)
        if cheap is not None:
            return cheap
    return C * size


def guard(plan, C, per_example, memory_limit):
    """`plan` with its estimate replaced by the routes' (`CurvatureEstimate`) and
    `memory_limit`; raises ValueError when the estimate exceeds the limit.

    Args:
      plan: the `Plan`, built with memory_limit=inf (its own guard counts C per-example
        gradients for every weight).
      C: the number of columns.
      per_example: whether the result is [B, *x] (else [*x]).
      memory_limit: as the user gave it (checked: `memory.resolve_limit`).
    """
    base = plan.estimate
    if base is None:    # B unknown: nothing is estimated (as the general guard)
        return dataclasses.replace(plan, memory_limit=memory_limit)
    request = plan.request
    B = base.batch_size
    covered, fallback = 0, 0
    column_bytes, seen = 0, set()
    for k, x in enumerate(request.xs):
        if not request.reads[k].reached:
            continue
        nbytes = tf.as_dtype(x.dtype).base_dtype.size
        if k in plan.fallback:
            fallback += (memory.static_size(tf.TensorShape(x.shape)) or 0) * nbytes
            continue
        uses = plan.uses[k] or ()
        covered += (route_size(uses, x, C, per_example) or 0) * nbytes
        for use in uses:
            per_example_size = memory.static_size(use.output.shape[1:])
            if id(use.output) in seen or per_example_size is None:
                continue
            seen.add(id(use.output))
            rows = use.rows.k if use.rows.k is not None else 1
            column_bytes += (C * B * rows * per_example_size *
                             use.output.dtype.base_dtype.size)
    estimate = CurvatureEstimate(
        batch_size=B, num_towers=base.num_towers, rows=base.rows, outputs_per_example=C,
        num_weights=base.num_weights, result_bytes=B * (covered + C * fallback),
        tower_gradient_bytes=base.num_towers * C * fallback,
        activation_bytes=base.activation_bytes, fallback=base.fallback, columns=C,
        column_bytes=column_bytes)
    plan = dataclasses.replace(plan, estimate=estimate, memory_limit=memory_limit)
    memory.check_plan(plan, memory_limit)
    return plan

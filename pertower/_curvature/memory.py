"""The memory guard of `diag_ggn` and `sum_grad_squared`: what each weight's route holds.

Notation:
    B   examples        C   columns (1 for `sum_grad_squared`, M for `diag_ggn`)
    x   one weight      Z   a rule's output (its dZ columns)

Where the general guard (`pertower._guards.memory`) counts B x C x |x| numbers per
weight, this counts per route of `pertower._curvature.squares`: "rules, cheap form" the
rule's `sum_squared_size` per example (None: as per column); "rules, per column" and
the fallback B x C x |x| (the fallback's towers' copies too); plus the C columns of
every use's output gradient, B x C x |Z|, and the replayed forward activations.
"""

import dataclasses

import tensorflow as tf

from pertower._guards import memory

__all__ = ["CurvatureEstimate", "guard"]


@dataclasses.dataclass(frozen=True)
class CurvatureEstimate(memory.MemoryEstimate):
    """A `MemoryEstimate` whose result term is what the curvature routes hold."""

    columns: int = 1        # C
    column_bytes: int = 0   # the C output-gradient columns of the rules' outputs

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


def guard(plan, C, per_example, memory_limit):
    """`plan` (built with memory_limit=inf) with the routes' `CurvatureEstimate` for C
    columns and `memory_limit`; `per_example`: results [B, *x] (else [*x]). Raises
    ValueError when the estimate exceeds the limit."""
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
        size = memory.static_size(tf.TensorShape(x.shape))     # None: not static
        if k in plan.fallback:
            fallback += (size or 0) * nbytes
            continue
        uses = plan.uses[k] or ()
        # numbers per example the route holds: the cheap form's, else C per-example
        # gradients (0 for a weight no use reaches or a shape that is not static)
        if uses and size is not None:
            cheap = (uses[0].rule.sum_squared_size(uses[0], C, per_example)
                     if len(uses) == 1 else None)
            covered += (cheap if cheap is not None else C * size) * nbytes
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

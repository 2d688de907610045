"""The plan records: what a call will build, per weight, and its readable table.

Notation:
    B   examples in the batch          G   groups: B (per example) or M (microbatches)
    K   output entries per example     x   one weight (entry of `xs`)

A `Plan` is made by `pertower._dispatch.make_plan` before any op is added; `str(plan)`
is the table `pertower.explain` shows.
"""

import dataclasses

import tensorflow as tf

__all__ = ["Plan", "WeightPlan", "weight_name"]


def weight_name(x):
    """A readable name of the weight `x` for tables and messages."""
    name = getattr(x, "name", None)
    return name if isinstance(name, str) else repr(x)


@dataclasses.dataclass(frozen=True)
class WeightPlan:
    """How one weight is computed.

    Attributes:
      name: the weight's name.
      shape: its shape.
      method: "rules", "towers", "passes" (one backward pass of the original graph
        per example, for graphs with TF1 while loops), or "unreached" (`ys` does not
        depend on it).
      ops: for "rules", the ops whose rules compute it, as "name (Type)" strings.
      reason: for "towers" and "passes", why no rule covers it (or that towers were
        asked for), and for "passes" why towers cannot be used.
    """

    name: str
    shape: tf.TensorShape
    method: str
    ops: tuple = ()
    reason: str = None


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a call will build, decided before any op is added. Immutable.

    `str(plan)` is a readable table (see `pertower.explain`).

    Attributes:
      function_name: the public function the plan is for.
      method: "auto", "rules" or "towers", as asked.
      request: the checked request (`pertower._request.Request`).
      uses: per entry of xs, a tuple of `rules.Use` (empty when `ys` does not reach
        x), or None when x falls back to the towers.
      reasons: per entry of xs, why it falls back (str), or None.
      couplings: the ops found to couple examples (each with `.op`, `.reason`,
        `.advice`); a plan with couplings is refused by every builder.
      verdict: "independent" (proven: row i of `ys` depends on example i alone),
        "coupled", or "unproven" (the analysis lost the batch axis on the way to `ys`).
      lost_at: for "unproven", (op, why) where the proof was lost; else None.
      outputs_per_example: K (Jacobians), else 1.
      forms_gradients: False for `per_example_norms`, whose rules form no
        per-example gradient.
      estimate: the `MemoryEstimate` of what will be built (None while B is unknown).
      validate: whether the run-time independence check will be added.
      memory_limit: as given (bytes, None for the default, inf for no limit).
      checked_by_default: whether `validate` was left to its default and the run-time
        check was added because the proof was lost (the call then warns).

    The first TF1 (v1) while loop op between the batch and `ys` is `request.loop_op`
    (`plan.loop_op`); when set, the weights no rule covers are computed by row passes
    instead of towers.
    """

    function_name: str
    method: str
    request: object
    uses: tuple
    reasons: tuple
    couplings: tuple
    verdict: str
    lost_at: tuple
    outputs_per_example: int
    forms_gradients: bool
    estimate: object
    validate: bool
    memory_limit: object = None
    checked_by_default: bool = False

    @property
    def loop_op(self):
        """The first TF1 (v1) while loop op between the batch and `ys`, or None."""
        return self.request.loop_op

    @property
    def fallback(self):
        """Indices into xs of the weights no rule computes (towers or row passes)."""
        return [k for k, u in enumerate(self.uses) if u is None]

    @property
    def fallback_method(self):
        """How the fallback weights are computed: "passes" with a TF1 loop, else "towers"."""
        return "passes" if self.loop_op is not None else "towers"

    @property
    def passes_reason(self):
        """Why row passes replace the towers (None without a TF1 loop)."""
        if self.loop_op is None:
            return None
        op = self.loop_op
        return (f"a TF1 (v1) while loop ({op.name!r}, {op.type}) lies between the batch "
                "and `ys`, which towers cannot build gradients through: one backward pass "
                "of the original graph per "
                + ("example" if self.request.num_groups is None else "microbatch"))

    @property
    def covered(self):
        """Indices into xs of the weights the rules side computes (those `ys` does not
        reach included: they get zeros)."""
        return [k for k, u in enumerate(self.uses) if u is not None]

    @property
    def uses_rules(self):
        """Whether any weight is computed by a rule."""
        return any(self.uses[k] for k in self.covered)

    @property
    def weights(self):
        """One `WeightPlan` per entry of xs."""
        rows = []
        for x, uses, reason in zip(self.request.xs, self.uses, self.reasons):
            name, shape = weight_name(x), x.shape
            if uses is None and self.loop_op is not None:
                rows.append(WeightPlan(name, shape, "passes",
                                       reason=f"{reason}; {self.passes_reason}"))
            elif uses is None:
                rows.append(WeightPlan(name, shape, "towers", reason=reason))
            elif not uses:
                rows.append(WeightPlan(name, shape, "unreached"))
            else:
                ops = tuple(dict.fromkeys(u.label for u in uses))
                rows.append(WeightPlan(name, shape, "rules", ops=ops))
        return tuple(rows)

    def __str__(self):
        request = self.request
        B = request.batch_size
        lines = [f"pertower plan for {self.function_name}(method={self.method!r}): "
                 f"ys {request.ys.name} {request.ys.shape}, batch "
                 f"{_batch_listing(request)}, B = "
                 f"{B if B is not None else 'any (fed at run time)'}"
                 + (f", {request.num_groups} microbatches" if request.num_groups else "")]
        table = [("weight", "shape", "method", "rule or reason")]
        for w in self.weights:
            detail = ", ".join(w.ops) if w.method == "rules" else (w.reason or "")
            table.append((w.name, str(w.shape.as_list() if w.shape.rank is not None
                                      else w.shape), w.method, detail))
        widths = [max(len(row[c]) for row in table) for c in range(3)]
        for row in table:
            lines.append("  " + "  ".join(row[c].ljust(widths[c]) for c in range(3))
                         + "  " + row[3])
        if self.couplings:
            lines.append("couplings (refused):")
            lines.extend(f"  {c.op.name} ({c.op.type}): {c.reason}" for c in self.couplings)
        else:
            lines.append("couplings: none found")
        if self.verdict == "independent":
            lines.append("independence: proven (row i of ys depends on example i alone)")
        elif self.verdict == "unproven":
            op, why = self.lost_at
            lines.append(f"independence: not proven; the proof was lost at {op.name} "
                         f"({op.type}): {why}")
        lines.append("run-time check: " + ("added (validate)" if self.validate else "none"))
        if self.estimate is not None:
            lines.append(f"memory: {self.estimate.describe()}")
        else:
            lines.append("memory: estimated once B is known")
        return "\n".join(lines)


def _batch_listing(request):
    """The batch tensors, each with its batch axis when that is not 0 (and, when `ys`
    joins several batches along axis 0, each batch with its size, in row order)."""
    if request.segments is not None:
        return ", then ".join(
            " and ".join(request.batch[j].name for j in indices) + f" ({size} examples)"
            for indices, size in request.segments) + " (joined along axis 0 of ys)"
    return ", ".join(b.name + (f" (batch axis {a})" if a else "")
                     for b, a in zip(request.batch, request.batch_axes))


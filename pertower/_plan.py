"""The plan records: what a call will build, per weight, and its readable table (made
by `pertower._dispatch.make_plan` before any op is added)."""

import dataclasses

import tensorflow as tf

from pertower import _batch_sizes

__all__ = ["Plan", "WeightPlan", "weight_name"]


def weight_name(x):
    """A readable name of the weight `x` for tables and messages."""
    name = getattr(x, "name", None)
    return name if isinstance(name, str) else repr(x)


@dataclasses.dataclass(frozen=True)
class WeightPlan:
    """How one weight is computed: `method` "rules" (by the rules of `ops`, "name
    (Type)" strings), "towers", "passes" (one backward pass of the original graph per
    example, past TF1 while loops) or "unreached"; `reason`: why no rule covers it."""

    name: str
    shape: tf.TensorShape
    method: str
    ops: tuple = ()
    reason: str = None


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a call will build, decided before any op is added; `str(plan)` is the
    table `pertower.explain` shows.

    Attributes:
      function_name, method: the public function and the method asked for.
      request: the checked `pertower._request.Request`.
      uses: per entry of xs, a tuple of `rules.Use` (empty when `ys` does not reach
        x), or None when x falls back (towers, or row passes past a TF1 loop).
      reasons: per entry of xs, why it falls back (str), or None.
      couplings: the ops found to couple examples (`.op`, `.reason`, `.advice`).
      verdict: "independent" (proven: row i of `ys` depends on example i alone),
        "coupled", or "unproven"; lost_at: then (op, why) where the proof was lost.
      outputs_per_example, forms_gradients: as in `pertower._request.Options`.
      estimate: the `MemoryEstimate` (None while B is unknown).
      validate: whether the run-time independence check will be added;
        checked_by_default: added because the proof was lost (the call then warns).
      memory_limit: as given.
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
    def covered(self):
        """Indices into xs of the weights the rules side computes (unreached ones too)."""
        return [k for k, u in enumerate(self.uses) if u is not None]

    @property
    def uses_rules(self):
        """Whether any weight is computed by a rule."""
        return any(self.uses[k] for k in self.covered)

    @property
    def weights(self):
        """One `WeightPlan` per entry of xs."""
        rows, op = [], self.loop_op
        for x, uses, reason in zip(self.request.xs, self.uses, self.reasons):
            name, shape = weight_name(x), x.shape
            if uses is None and op is not None:   # why row passes replace the towers
                group = "example" if self.request.num_groups is None else "microbatch"
                rows.append(WeightPlan(name, shape, "passes", reason=(
                    f"{reason}; a TF1 (v1) while loop ({op.name!r}, {op.type}) lies between "
                    "the batch and `ys`, which towers cannot build gradients through: one "
                    f"backward pass of the original graph per {group}")))
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
        lines.append("memory: " + (self.estimate.describe() if self.estimate is not None
                                   else "estimated once B is known"))
        return "\n".join(lines)


def _batch_listing(request):
    """The batch tensors with their batch axis when not 0 (or the joined batches)."""
    if request.segments is not None:
        return (_batch_sizes.listing(request.batch, request.segments, " ({} examples)")
                + " (joined along axis 0 of ys)")
    return ", ".join(b.name + (f" (batch axis {a})" if a else "")
                     for b, a in zip(request.batch, request.batch_axes))

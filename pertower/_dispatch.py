"""The one dispatch every public function goes through: request -> plan -> guards -> build.

Notation:
    B   examples in the batch          G   groups: B (per example) or M (microbatches)
    K   output entries per example     x   one weight (entry of `xs`)

    request  `_request.prepare`: the arguments checked once (a `Prepared` record), the
             batch tensors found, the batch-axis analysis run.
    plan     `make_plan`: per weight, the rule that computes it or the reason it falls
             back to the towers; the analysis' verdict (proven independent, coupled,
             or not proven and where the proof was lost); the memory estimate of
             exactly what will be built. `pertower.explain` returns it.
    guards   the memory limit, on the plan; couplings refused; where the proof was
             lost, the run-time check of `_guards.independence` (validate).
    build    `build`: the rules' batched backward pass for the covered weights, and
             for the weights that fall back (only those) towers, or, when a TF1 (v1)
             while loop lies between the batch and `ys` (towers cannot build gradients
             through a replayed v1 loop), row passes: one backward pass of the
             original graph per group, grad_ys masked to the group's rows
             (`pertower._row_passes`).

Methods: "auto" (default: rules where proven, towers elsewhere), "rules" (strict: every
weight must have a proven rule, else the call is refused listing each weight and why),
"towers" (the literal design: replay the model once per group on weight copies).
"""

import dataclasses
import warnings

import tensorflow as tf

from pertower import _graph_walk as graph_walk
from pertower import _request
from pertower import _row_passes
from pertower._guards import independence
from pertower._guards import memory
from pertower._guards import row_pass_gradients
from pertower._towers import build as towers_lib
from pertower import rules as rules_lib
from pertower.rules import _engine
from pertower import _context

__all__ = ["METHODS", "Plan", "WeightPlan", "make_plan", "build", "check_method"]

METHODS = ("auto", "towers", "rules")

# `validate` values: None (default) checks at run time exactly where the proof was lost.
_VALIDATE_VALUES = (None, True, False)


def check_method(method, rules=None):
    """Validates `method` (and that `rules` goes with a method that uses it)."""
    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(
            f"pertower.{_context.name()}: `method` must be one of {METHODS}, got {method!r}.")
    if rules is not None and method == "towers":
        raise ValueError(
            f"pertower.{_context.name()}: `rules` is used by method='rules' or 'auto', but "
            "method='towers' was given; drop `rules` or choose another method.")
    if rules is not None and not isinstance(rules, rules_lib.RuleRegistry):
        raise TypeError(f"pertower.{_context.name()}: `rules` must be a "
                        "pertower.rules.RuleRegistry (see pertower.rules.default_registry()), "
                        f"but received {type(rules).__name__}.")
    return method


def _check_validate(validate):
    if validate not in _VALIDATE_VALUES or not isinstance(validate, (bool, type(None))):
        raise ValueError(
            f"pertower.{_context.name()}: `validate` must be None (the default: check at run "
            "time only where the static analysis could not prove that the examples are "
            f"independent), True (always check) or False (never), but received {validate!r}.")
    return validate


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
      prepared: the checked request (`_request.Prepared`).
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
      loop_op: the first TF1 (v1) while loop op between the batch and `ys`, or None;
        when set, the weights no rule covers are computed by row passes instead of
        towers.
    """

    function_name: str
    method: str
    prepared: object
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
    loop_op: object = None

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
                + ("example" if self.prepared.num_groups is None else "microbatch"))

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
        for x, uses, reason in zip(self.prepared.xs, self.uses, self.reasons):
            name, shape = _weight_name(x), x.shape
            if uses is None and self.loop_op is not None:
                rows.append(WeightPlan(name, shape, "passes",
                                       reason=f"{reason}; {self.passes_reason}"))
            elif uses is None:
                rows.append(WeightPlan(name, shape, "towers", reason=reason))
            elif not uses:
                rows.append(WeightPlan(name, shape, "unreached"))
            else:
                ops = tuple(dict.fromkeys(f"{u.op.name} ({u.op.type})" for u in uses))
                rows.append(WeightPlan(name, shape, "rules", ops=ops))
        return tuple(rows)

    def __str__(self):
        prepared = self.prepared
        B = prepared.batch_size
        lines = [f"pertower plan for {self.function_name}(method={self.method!r}): "
                 f"ys {prepared.ys.name} {prepared.ys.shape}, batch "
                 f"{_batch_listing(prepared)}, B = "
                 f"{B if B is not None else 'any (fed at run time)'}"
                 + (f", {prepared.num_groups} microbatches" if prepared.num_groups else "")]
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


def _batch_listing(prepared):
    """The batch tensors, each with its batch axis when that is not 0 (and, when `ys`
    joins several batches along axis 0, each batch with its size, in row order)."""
    if prepared.segments is not None:
        return ", then ".join(
            " and ".join(prepared.batch[j].name for j in indices) + f" ({size} examples)"
            for indices, size in prepared.segments) + " (joined along axis 0 of ys)"
    return ", ".join(b.name + (f" (batch axis {a})" if a else "")
                     for b, a in zip(prepared.batch, prepared.batch_axes))


def _weight_name(x):
    name = getattr(x, "name", None)
    return name if isinstance(name, str) else repr(x)


def _analyse(prepared, registry):
    """(uses, reasons, couplings, verdict, lost_at) from the request's analysis."""
    uses, reasons = _engine.build_plan(prepared, registry)
    analysis = prepared.analysis
    return uses, reasons, tuple(analysis.couplings), analysis.verdict, analysis.lost_at


def make_plan(ys, xs, batch=None, batch_size=None, num_groups=None, *, method="auto",
              rules=None, sparse=False, validate=None, outputs_per_example=1,
              forms_gradients=True, memory_limit=None, groups_argument="num_microbatches",
              refuse=True, batch_axis=None):
    """Checks the request and decides how every weight will be computed. Adds no op.

    Args:
      ys, xs, batch, batch_size: as given to the public function.
      num_groups: M for microbatches, None for one group per example.
      method, rules, sparse, validate, memory_limit: as given to the public function.
      outputs_per_example: K for Jacobians.
      forms_gradients: False for the norms (the rules form no [B, P] tensor).
      groups_argument: the public name of the number of groups, for messages.
      refuse: when False (`pertower.explain`), couplings and a strict method's
        uncovered weights are recorded in the plan instead of raised.
      batch_axis: the batch axis of each batch tensor (None: 0), as given.

    Returns:
      A `Plan`.
    """
    check_method(method, rules)
    _check_validate(validate)
    memory.resolve_limit(memory_limit)
    registry = rules if rules is not None else rules_lib.default_registry()
    prepared = _request.prepare(ys, xs, batch, num_groups, batch_size, groups_argument,
                                batch_size_required=False,
                                registry=registry, refuse_couplings=refuse,
                                batch_axis=batch_axis)
    with prepared.graph.as_default():
        uses, reasons, couplings, verdict, lost_at = _analyse(prepared, registry)
    uses, reasons = list(uses), list(reasons)
    if method == "towers":   # (with a TF1 loop: row passes, see Plan.passes_reason)
        for k, reads in enumerate(prepared.reads):
            if reads.reached:
                uses[k], reasons[k] = None, "method='towers' was asked for"
    loop_op = graph_walk.v1_loop_op(prepared)
    if loop_op is not None:
        _row_passes_assume_no_python_gradient(prepared, uses, reasons, loop_op, refuse)
    if sparse:
        gathered = [k for k, reads in enumerate(prepared.reads)
                    if uses[k] and reads.gather_ops and not reads.read_tensors
                    and not reads.call_inputs and not reads.loop_inputs]
        if gathered and loop_op is not None and not refuse:
            gathered = []   # (explain shows the plan sparse=False would build)
        if gathered and loop_op is not None:
            names = ", ".join(_weight_name(prepared.xs[k]) for k in gathered)
            raise ValueError(
                f"pertower.{_context.name()}: sparse=True keeps the per-example rows of "
                f"gathered weights ({names}) sparse by computing them with towers, but a "
                f"TF1 (v1) while loop ({loop_op.name!r}, {loop_op.type}) lies between the "
                "batch and `ys`, which towers cannot build gradients through. Pass "
                "sparse=False (these weights then come back dense, [B, *x.shape]), or "
                "build the model with tf.compat.v1.enable_control_flow_v2().")
        for k in gathered:
            uses[k] = None
            reasons[k] = "sparse=True: the towers keep its per-example rows sparse"
    checked_by_default = validate is None and verdict == "unproven"
    if validate is None:
        validate = checked_by_default
    plan = Plan(function_name=_context.name(), method=method, prepared=prepared,
                uses=tuple(uses), reasons=tuple(reasons), couplings=couplings,
                verdict=verdict, lost_at=lost_at, outputs_per_example=outputs_per_example,
                forms_gradients=forms_gradients, estimate=None, validate=bool(validate),
                memory_limit=memory_limit, checked_by_default=checked_by_default,
                loop_op=loop_op)
    plan = dataclasses.replace(plan, estimate=memory.estimate_plan(plan))
    if refuse:
        _refuse_what_cannot_be_built(plan)
    return plan


def _row_passes_assume_no_python_gradient(prepared, uses, reasons, loop_op, refuse):
    """Row passes mask grad_ys to one example's rows in a backward pass of the batched
    graph: a weight whose gradient flows through an op with an overridden or Python
    gradient not proven row-wise (`row_pass_gradients`) is refused naming the op (with
    `refuse`; else the reason is shown in the plan)."""
    cache = {}   # each override's backward is built and read once
    for k, reads in enumerate(prepared.reads):
        if uses[k] is not None or not reads.reached:
            continue
        found = row_pass_gradients.unproven_gradient(prepared, reads, cache)
        if found is None:
            continue
        op, why = found
        text = (f"the weight {reads.name!r} is computed by one backward pass of the "
                f"original graph per example, as a TF1 (v1) while loop ({loop_op.name!r}, "
                f"{loop_op.type}) lies between the batch and `ys`; each pass keeps only "
                f"one example's rows of grad_ys, but its gradient flows through "
                f"{op.name!r} ({op.type}): {why}. Such a backward pass may spread one "
                "example's rows over the others, so the pass would not give that example's "
                "gradient. Write the op's gradient row by row (no reduction or mixing over "
                "the batch axis), remove the override, or leave this weight out of `xs`.")
        if refuse:
            raise _context.error(ValueError, text)
        reasons[k] = f"refused: {text}"


def _listing(plan, indices):
    return "; ".join(f"{_weight_name(plan.prepared.xs[k])}: {plan.reasons[k]}"
                     for k in indices)


def _refuse_what_cannot_be_built(plan):
    """Raises for a strict method with uncovered weights, towers without B, and a
    run-time check that cannot be built."""
    function_name, prepared = plan.function_name, plan.prepared
    if plan.method == "rules" and plan.fallback:
        raise ValueError(
            f"pertower.{function_name}: method='rules' is strict, and no rule covers "
            f"{len(plan.fallback)} of the weights ({_listing(plan, plan.fallback)}). Use "
            "method='auto' (rules where they apply, towers for these), register a rule "
            "for the op (pertower.rules.default_registry().register), or leave these "
            "weights out of `xs`. pertower.explain(ys, xs) shows the plan.")
    needs_towers = bool(plan.fallback) or plan.validate
    if prepared.batch_size is None and needs_towers:
        names = ", ".join(f"{b.name} {b.shape}" for b in prepared.batch)
        what = []
        if plan.fallback:
            what.append(f"these weights fall back to {plan.fallback_method}, which are "
                        "built for a fixed number of examples "
                        f"({_listing(plan, plan.fallback)})")
        if plan.validate:
            if plan.verdict == "unproven":
                op, why = plan.lost_at
                what.append("the independence of the examples could not be proven (the "
                            f"proof was lost at {op.name!r} ({op.type}): {why}), so it is "
                            "checked at run time by recomputing `ys` slice by slice, for "
                            "a fixed number of examples")
            else:
                what.append("validate=True recomputes `ys` slice by slice, for a fixed "
                            "number of examples")
        raise ValueError(
            f"pertower.{function_name}: the batch axis is not static ({names}) and no "
            f"`batch_size` was given, but {'; and '.join(what)}. Pass batch_size=B, the "
            "number of examples you will feed.")
    if plan.validate:
        _refuse_a_check_that_cannot_pass(plan)
    memory.check_plan(plan, plan.memory_limit)


def _refuse_a_check_that_cannot_pass(plan):
    """The run-time check recomputes `ys` slice by slice; a stateful random op whose
    draws are shaped by the batch (dropout in training mode) draws other numbers in
    every slice, so the check would fail on every run: refused here, saying why."""
    prepared = plan.prepared
    noisy = graph_walk.random_ops(prepared.batch_downstream)
    if not noisy:
        return
    if plan.checked_by_default:
        op, why = plan.lost_at
        reason = (f"could not prove that row i of `ys` depends on example i alone (the "
                  f"proof was lost at {op.name!r} ({op.type}): {why}), and")
    else:
        reason = "validate=True asks for the run-time check, but"
    raise ValueError(
        f"pertower.{plan.function_name}: {reason} the check that would decide it at run "
        f"time cannot pass: `ys` depends on the random op {noisy[0].name!r} "
        f"({noisy[0].type}), e.g. dropout in training mode, which draws other numbers "
        "when `ys` is recomputed slice by slice. Build `ys` without it (training=False), "
        "or pass validate=False if you know that each example's value depends on its "
        "own example alone.")


def warn_if_unproven(plan):
    """Warns once per call when the default run-time check was switched on."""
    if plan.checked_by_default:
        op, why = plan.lost_at
        warnings.warn(
            f"pertower.{plan.function_name}: could not prove that row i of `ys` depends "
            f"on example i alone: the proof was lost at {op.name!r} ({op.type}): {why}. "
            "The result is checked at run time (fetching it fails if `ys` recomputed "
            "slice by slice differs from `ys`). Pass validate=False to skip the check, "
            "or validate=True to keep it without this warning.", stacklevel=4)


class Built:
    """The covered weights' gradients from the rules, the others' from towers built for
    those weights only; and `ys` recomputed slice by slice for the run-time check.

    `gradients(grad_ys=None, unconnected_gradients="zero", name=None, sparse=False)`
    gives one [G, *x.shape] entry per x (G = B or M; None for a weight `ys` does not
    reach with unconnected_gradients="none").
    """

    def __init__(self, plan, devices=None):
        prepared = plan.prepared
        self.plan = plan
        self.xs = tuple(prepared.xs)
        self.ys = prepared.ys
        self.batch_size = prepared.batch_size
        self.groups = _engine.group_count(prepared, prepared.num_groups)
        self.towers = None
        self.passes = None
        # no rule used: the towers compute every weight (exactly `build_towers`)
        self.towers_only = (bool(plan.fallback) and not plan.uses_rules
                            and plan.loop_op is None)
        if plan.fallback and plan.loop_op is not None:
            self.passes = _row_passes.RowPasses(
                prepared.ys, [self.xs[k] for k in plan.fallback], prepared.batch_size,
                prepared.num_groups or prepared.batch_size)
        elif self.towers_only:
            self.towers = towers_lib.build(
                prepared.ys, list(self.xs), list(prepared.batch), prepared.num_groups,
                prepared.batch_size, "towers", _groups_argument(prepared), devices,
                prepared=prepared)
        elif plan.fallback:
            self.towers = towers_lib.build(
                prepared.ys, [self.xs[k] for k in plan.fallback], list(prepared.batch),
                prepared.num_groups, prepared.batch_size, "towers", _groups_argument(prepared),
                devices, prepared=prepared.restricted(plan.fallback))

    def _rule_checks(self):
        """The run-time checks of the fed batch that the rules' and the row passes' ops
        wait for (the towers check it where they split the batch)."""
        if self.plan.uses_rules or self.passes is not None:
            return _engine.run_time_checks(self.plan.prepared)
        return []

    def _fallback_gradients(self, name):
        """{k: [B, *xs[k].shape]}: the per-example gradients of the weights the rules do
        not compute (every weight when the towers compute them all), from the towers or
        the row passes; weights without a gradient are left out."""
        if self.towers is not None:
            indices = range(len(self.xs)) if self.towers_only else self.plan.fallback
            grads = self.towers.gradients(name=name)
        elif self.passes is not None:
            indices, grads = self.plan.fallback, self.passes.gradients(name="row_passes")
        else:
            return {}
        return {k: g for k, g in zip(indices, grads) if g is not None}

    def gradients(self, grad_ys=None, unconnected_gradients="zero", name=None, sparse=False):
        if self.towers_only:
            return [independence.gated(g) for g in self.towers.gradients(
                grad_ys=grad_ys, unconnected_gradients=unconnected_gradients,
                name=name or "gradients", sparse=sparse)]
        with tf.name_scope(name or "gradients"):
            with tf.control_dependencies(self._rule_checks()):
                results = [None] * len(self.xs)
                covered = _engine.gradients(self.plan, self.plan.covered, self.groups,
                                            grad_ys, unconnected_gradients)
                for k, g in covered.items():
                    results[k] = g
                if self.towers is not None:
                    for k, g in zip(self.plan.fallback, self.towers.gradients(
                            grad_ys=grad_ys, unconnected_gradients=unconnected_gradients,
                            name="towers", sparse=sparse)):
                        results[k] = g
                if self.passes is not None:
                    for k, g in zip(self.plan.fallback, self.passes.gradients(
                            grad_ys=grad_ys, unconnected_gradients=unconnected_gradients,
                            name="row_passes")):
                        results[k] = g
                return [independence.gated(g) for g in results]

    def squared_norms(self, name=None):
        """[B] squared norms of each example's gradient over all xs (norms)."""
        with tf.name_scope(name or "gradients"):
            prepared = self.plan.prepared
            B = self.groups
            with tf.control_dependencies(self._rule_checks()):
                squares = list(_engine.squared_norms(self.plan, self.plan.covered,
                                                     B).values())      # [B] each
                fallback = self._fallback_gradients(
                    "towers" if not self.towers_only else "tower_gradients")
            for g in fallback.values():                                 # [B, *x.shape]
                squares.append(tf.reduce_sum(tf.square(g), axis=list(range(1, g.shape.rank))))
            if not squares:   # no weight is reached
                squares = [tf.zeros(tf.reshape(B, [1]), dtype=prepared.ys.dtype)]
            return tf.add_n([tf.cast(s, prepared.ys.dtype) for s in squares])  # [B]

    def clipped_sum(self, factors_of, name=None):
        """DP-SGD's clipped sum from one forward pass and one backward pass.

        The rules' norms and their reweighted sum share the dZ of ONE tf.gradients of
        sum(ys) (`_engine.norm_parts`, `_engine.clipped_sums`), so a random op (dropout)
        is differentiated with the draws of `ys` in the same run; the weights that fall
        back to towers or row passes are formed there, [B, *x.shape], and contracted
        with the factors.

        Args:
          factors_of: maps the [B] per-example gradient norms to the [B] factors f.
          name: name scope.

        Returns:
          (norms [B], factors [B], sums): sums[k] = sum_i f_i grad_i(xs[k]),
          [*xs[k].shape], zeros for a weight `ys` does not reach; f is held constant.
        """
        with tf.name_scope(name or "clipped_sum"):
            plan, prepared, B = self.plan, self.plan.prepared, self.groups
            with tf.control_dependencies(self._rule_checks()):
                covered = [] if self.towers_only else plan.covered
                d_outputs, squares, formed = _engine.norm_parts(plan, covered, B)
                fallback = self._fallback_gradients("towers")   # towers or row passes
            squares = list(squares.values())                                # [B] each
            for g in fallback.values():                                     # [B, *x.shape]
                squares.append(tf.reduce_sum(tf.square(g), axis=list(range(1, g.shape.rank))))
            if not squares:   # no weight is reached
                squares = [tf.zeros(tf.reshape(B, [1]), dtype=prepared.ys.dtype)]
            norms = tf.sqrt(tf.add_n([tf.cast(s, prepared.ys.dtype) for s in squares]))
            norms = self.validated([norms])[0]                              # [B]
            factors = tf.stop_gradient(factors_of(norms))                   # [B]
            sums = _engine.clipped_sums(plan, covered, d_outputs, formed, factors)
            for k, g in fallback.items():
                # [B] x [B, *x.shape] -> [*x.shape]
                sums[k] = tf.tensordot(tf.cast(factors, g.dtype), g, axes=1)
            results = []
            for k, x in enumerate(self.xs):
                if k not in sums:
                    sums[k] = tf.zeros(x.shape, x.dtype.base_dtype) if \
                        x.shape.is_fully_defined() else tf.zeros_like(x)
                results.append(independence.gated(sums[k]))
            return norms, factors, results

    def validated(self, results):
        """`results` gated on the run-time independence check when the plan asks for it."""
        plan = self.plan
        if not plan.validate:
            return results
        prepared = plan.prepared
        if self.towers is not None:
            stacked = self.towers.stacked
        else:
            stacked = independence.recomputed_by_slices(
                prepared.ys, list(prepared.batch), prepared.num_groups,
                prepared.batch_size, _groups_argument(prepared),
                batch_axis=list(prepared.batch_axes))
        return independence.validated(results, prepared.ys, stacked)


def _groups_argument(prepared):
    return "batch_size" if prepared.num_groups is None else prepared.groups_argument


def build(plan, devices=None):
    """Builds what `plan` decided, under the current name scope; returns a `Built`."""
    warn_if_unproven(plan)
    with plan.prepared.graph.as_default():
        return Built(plan, devices)

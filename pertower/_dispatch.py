"""The one dispatch every public function goes through: request -> plan -> guards -> build.

Notation: B examples, G groups (B or M microbatches), K outputs per example, x a weight.

    request  `pertower._request.make_request`: the arguments checked once.
    plan     `make_plan`: per weight, the rule that computes it or why it falls back;
             the analysis' verdict; the memory estimate (`pertower._plan.Plan`).
    guards   refused: a strict method with weights no rule covers, a fallback or
             run-time check without a known B, a run-time check that cannot pass,
             the memory limit (`pertower._guards.memory`); couplings by the request.
    build    `build`: the rules' batched backward pass for the covered weights and
             one fallback for the others: towers, or past a TF1 (v1) while loop (which
             towers cannot differentiate through) row passes, one backward pass of the
             original graph per group (`pertower._combiner.Built`).
"""

import dataclasses
import warnings

from pertower import _checks
from pertower import _combiner
from pertower import _context
from pertower import _engine
from pertower import _plan
from pertower import _graph_walk as graph_walk
from pertower import _request
from pertower import rules as rules_lib
from pertower._guards import memory

__all__ = ["options", "plan_call", "make_plan", "build"]


def options(method="auto", rules=None, **others):
    """The `pertower._request.Options` of a public call: `method`, the registry of
    `rules` (checked; None: the default registry), and the fields `others`."""
    _request.check_method(method)
    if rules is not None and method == "towers":
        raise _context.error(
            ValueError, "`rules` is used by method='rules' or 'auto', but method='towers' "
            "was given; drop `rules` or choose another method.")
    if rules is not None and not isinstance(rules, rules_lib.RuleRegistry):
        raise _context.error(TypeError, "`rules` must be a pertower.rules.RuleRegistry (see "
                             "pertower.rules.default_registry()), but received "
                             f"{type(rules).__name__}.")
    registry = rules if rules is not None else rules_lib.default_registry()
    return _request.Options(method=method, registry=registry, **others)


def plan_call(ys, xs, devices, examples, given, **keywords):
    """(devices checked, the `_checks.Partitions` of xs, the plan of its parts);
    `keywords` are those of `_request.make_request`."""
    _checks.require_graph_mode()
    devices = _checks.device_list(devices)
    partitions = _checks.Partitions(_checks.as_list(xs))   # PartitionedVariables split
    return devices, partitions, make_plan(_request.make_request(
        ys, partitions.flat, examples, given, **keywords))


def make_plan(request, *arguments, **keywords):
    """The `Plan` of `request` (a `Request`, or as a shorthand `ys`, `xs`, the fields of
    `Examples` and the keywords of `options`). Adds no op; unless refuse=False, what
    cannot be built is refused here."""
    if not isinstance(request, _request.Request):
        xs, *positional = arguments
        fields = {f: keywords.pop(f) for f in ("batch", "batch_size", "num_groups",
                                               "batch_axis") if f in keywords}
        request = _request.make_request(request, xs, _request.Examples(*positional, **fields),
                                        options(**keywords))
    given = request.options
    with request.graph.as_default():
        uses, reasons = _engine.build_plan(request)
    analysis = request.analysis
    couplings, verdict, lost_at = tuple(analysis.couplings), analysis.verdict, analysis.lost_at
    uses, reasons = list(uses), list(reasons)
    if given.method == "towers":   # (with a TF1 loop: row passes, see Plan.weights)
        for k, reads in enumerate(request.reads):
            if reads.reached:
                uses[k], reasons[k] = None, "method='towers' was asked for"
    loop_op = request.loop_op
    if loop_op is not None:
        _refuse_python_gradients_in_row_passes(request, uses, reasons, given.refuse)
    if given.sparse:
        gathered = [k for k, reads in enumerate(request.reads)
                    if uses[k] and reads.gather_ops and not reads.read_tensors
                    and not reads.call_inputs and not reads.loop_inputs]
        if gathered and loop_op is not None and not given.refuse:
            gathered = []   # (explain shows the plan sparse=False would build)
        if gathered and loop_op is not None:
            names = ", ".join(_plan.weight_name(request.xs[k]) for k in gathered)
            raise _context.error(
                ValueError, "sparse=True keeps the per-example rows of gathered weights "
                f"({names}) sparse by computing them with towers, but a TF1 (v1) while "
                f"loop ({loop_op.name!r}, {loop_op.type}) lies between the batch and `ys`, "
                "which towers cannot build gradients through. Pass sparse=False (these "
                "weights then come back dense, [B, *x.shape]), or build the model with "
                "tf.compat.v1.enable_control_flow_v2().")
        for k in gathered:
            uses[k] = None
            reasons[k] = "sparse=True: the towers keep its per-example rows sparse"
    checked_by_default = given.validate is None and verdict == "unproven"
    validate = checked_by_default if given.validate is None else given.validate
    plan = _plan.Plan(
        function_name=_context.name(), method=given.method, request=request,
        uses=tuple(uses), reasons=tuple(reasons), couplings=couplings, verdict=verdict,
        lost_at=lost_at, outputs_per_example=given.outputs_per_example,
        forms_gradients=given.forms_gradients, estimate=None, validate=bool(validate),
        memory_limit=given.memory_limit, checked_by_default=checked_by_default)
    plan = dataclasses.replace(plan, estimate=memory.estimate_plan(plan))
    if given.refuse:
        _refuse_what_cannot_be_built(plan)
    return plan


def build(plan, devices=None):
    """Builds what `plan` decided, under the current name scope; returns a `Built`."""
    if plan.checked_by_default:
        op, why = plan.lost_at
        warnings.warn(_context.prefixed(
            "could not prove that row i of `ys` depends "
            f"on example i alone: the proof was lost at {op.name!r} ({op.type}): {why}. "
            "The result is checked at run time (fetching it fails if `ys` recomputed "
            "slice by slice differs from `ys`). Pass validate=False to skip the check, "
            "or validate=True to keep it without this warning."), stacklevel=3)
    with plan.request.graph.as_default():
        return _combiner.Built(plan, devices)


def _listing(plan, indices):
    """"w1, w2: reason; w3: other reason": each reason once, after the weights it sends
    to the fallback."""
    by_reason = {}
    for k in indices:
        by_reason.setdefault(plan.reasons[k], []).append(
            _plan.weight_name(plan.request.xs[k]))
    return "; ".join(f"{', '.join(names)}: {reason}" for reason, names in by_reason.items())


def _left_out_of_batch(request):
    """The lead of the refusal when placeholders that `ys` reads with a non-static axis 0
    are not in the batch (labels left out of `batch=`): they may carry the examples."""
    left_out = graph_walk.placeholders_left_out(request.ys_upstream, request.batch)
    if not left_out:
        return ""
    names = ", ".join(f"{t.name} {t.shape}" for t in left_out)
    every = ", ".join(t.name for t in list(request.batch) + left_out)
    return (f"`ys` reads {names}, which is not in `batch=` "
            f"({', '.join(b.name for b in request.batch)}) and whose axis 0 is not static: "
            "if it also carries the examples (labels, a mask), it must be in `batch=` "
            f"(batch=[{every}]), else the per-example computations read it whole. "
            "Otherwise, ")


def _refuse_what_cannot_be_built(plan):
    """Raises for what cannot be built (see the module docstring, guards)."""
    request = plan.request
    if plan.method == "rules" and plan.fallback:
        raise _context.error(
            ValueError, f"method='rules' is strict, and no rule covers "
            f"{len(plan.fallback)} of the weights ({_listing(plan, plan.fallback)}). Use "
            "method='auto' (rules where they apply, towers for these), register a rule "
            "for the op (pertower.rules.default_registry().register), or leave these "
            "weights out of `xs`. pertower.explain(ys, xs) shows the plan.")
    needs_towers = bool(plan.fallback) or plan.validate
    padded = request.options.batch_capacity is not None and plan.fallback_method == "towers"
    if request.batch_size is None and needs_towers and not padded:
        rows = request.analysis.rows(request.ys)
        if plan.verdict == "unproven" and rows is not None and rows.lead != 0:
            raise _context.error(
                ValueError, f"`ys` ({request.ys.name}, shape {request.ys.shape}) must have "
                f"the examples on axis 0, but they were found on axis {rows.lead}. Pass "
                "the per-example values with the batch first: tf.transpose(ys) or "
                "ys[0] for a [1, B] `ys`.")
        names = ", ".join(f"{b.name} {b.shape}" for b in request.batch)
        what = []
        if plan.fallback:
            by = "row passes" if plan.fallback_method == "passes" else "towers"
            what.append(f"these weights fall back to {by}, which are "
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
        raise _context.error(
            ValueError, f"{_left_out_of_batch(request)}the batch axis is not static "
            f"({names}) and no `batch_size` was given, but {'; and '.join(what)}. Pass "
            "batch_size=B, the number of examples you will feed.")
    # a random op shaped by the batch (dropout in training mode) draws other numbers in
    # every slice, so the run-time check would fail on every run
    noisy = graph_walk.random_ops(request.batch_downstream) if plan.validate else []
    if noisy:
        if plan.checked_by_default:
            op, why = plan.lost_at
            reason = (f"could not prove that row i of `ys` depends on example i alone (the "
                      f"proof was lost at {op.name!r} ({op.type}): {why}), and")
        else:
            reason = "validate=True asks for the run-time check, but"
        raise _context.error(
            ValueError, f"{reason} the check that would decide it at run "
            f"time cannot pass: `ys` depends on the random op {noisy[0].name!r} "
            f"({noisy[0].type}), e.g. dropout in training mode, which draws other numbers "
            "when `ys` is recomputed slice by slice. Build `ys` without it "
            "(training=False), or pass validate=False if you know that each example's "
            "value depends on its own example alone.")
    memory.check_plan(plan, plan.memory_limit)


def _refuse_python_gradients_in_row_passes(request, uses, reasons, refuse):
    """Row passes mask grad_ys to one example's rows in a backward pass of the batched
    graph: a weight whose gradient flows through an overridden or Python gradient not
    proven row-wise (`_engine.UnassumedGradients`) is refused (with `refuse`; else the
    reason goes to the plan)."""
    loop_op = request.loop_op
    unassumed = _engine.UnassumedGradients(request)   # each override read once
    for k, reads in enumerate(request.reads):
        if uses[k] is not None or not reads.reached:
            continue
        why = unassumed.reason(k)
        if why is None:
            continue
        text = (f"the weight {reads.name!r} is computed by one backward pass of the "
                f"original graph per example, as a TF1 (v1) while loop ({loop_op.name!r}, "
                f"{loop_op.type}) lies between the batch and `ys`; each pass keeps only "
                f"one example's rows of grad_ys, but {why}. Such a backward pass may "
                "spread one example's rows over the others, so the pass would not give "
                "that example's gradient. Write the op's gradient row by row (no reduction "
                "or mixing over the batch axis), remove the override, or leave this weight "
                "out of `xs`.")
        if refuse:
            raise _context.error(ValueError, text)
        reasons[k] = f"refused: {text}"

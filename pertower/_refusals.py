"""The refusals of a plan: what cannot be built is refused before any op is added.

A strict method with weights no rule covers; towers (or row passes, or the run-time
check) without a known B; a run-time check that cannot pass (a random op shaped by the
batch); and the memory guard (`pertower._guards.memory`).
"""

from pertower import _context
from pertower import _graph_walk as graph_walk
from pertower import _plan
from pertower._guards import memory
from pertower import _engine

__all__ = ["refuse_what_cannot_be_built"]


def _listing(plan, indices):
    return "; ".join(f"{_plan.weight_name(plan.request.xs[k])}: {plan.reasons[k]}"
                     for k in indices)


def refuse_what_cannot_be_built(plan):
    """Raises for a strict method with uncovered weights, towers without B, and a
    run-time check that cannot be built."""
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
            ValueError, f"the batch axis is not static ({names}) and no "
            f"`batch_size` was given, but {'; and '.join(what)}. Pass batch_size=B, the "
            "number of examples you will feed.")
    if plan.validate:
        _refuse_a_check_that_cannot_pass(plan)
    memory.check_plan(plan, plan.memory_limit)


def _refuse_a_check_that_cannot_pass(plan):
    """The run-time check recomputes `ys` slice by slice; a stateful random op whose
    draws are shaped by the batch (dropout in training mode) draws other numbers in
    every slice, so the check would fail on every run: refused here, saying why."""
    noisy = graph_walk.random_ops(plan.request.batch_downstream)
    if not noisy:
        return
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
        "when `ys` is recomputed slice by slice. Build `ys` without it (training=False), "
        "or pass validate=False if you know that each example's value depends on its "
        "own example alone.")


def refuse_python_gradients_in_row_passes(request, uses, reasons, refuse):
    """Row passes mask grad_ys to one example's rows in a backward pass of the batched
    graph: a weight whose gradient flows through an op with an overridden or Python
    gradient not proven row-wise (the rules' own test, `_engine.UnassumedGradients`) is
    refused naming the op (with `refuse`; else the reason is shown in the plan,
    `pertower.explain`)."""
    loop_op = request.loop_op
    unassumed = _engine.UnassumedGradients(request)   # each override read once
    for k, reads in enumerate(request.reads):
        if uses[k] is not None or not reads.reached:
            continue
        why = unassumed.reason(reads, request.ys_upstream)
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

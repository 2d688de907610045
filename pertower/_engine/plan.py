"""`build_plan`: which weights the rules cover, through which uses (notation:
`pertower._engine`)."""

import dataclasses

import tensorflow as tf

from pertower import _batch_sizes
from pertower import _tf
from pertower._engine.unassumed import UnassumedGradients
from pertower import _loops
from pertower.rules import _weight_functions

__all__ = ["build_plan"]


def build_plan(request):
    """(uses, reasons): per entry of xs, a tuple of `rules.Use` (empty when `ys` does
    not reach x) or None when x falls back; and why it falls back, or None. No op built."""
    ys, batch, analysis = request.ys, request.batch, request.analysis
    registry = request.options.registry   # (the one `analysis` was made with)
    reason = None
    if analysis.verdict != "independent":
        lost = analysis.lost_at
        where = (f"; the proof was lost at {lost[0].name!r} ({lost[0].type}): {lost[1]}"
                 if lost is not None else "")
        reason = (f"the rows of `ys` ({ys.name}) could not be traced to the examples of "
                  f"the batch{where}")
    elif analysis.segments is not None:
        # a rule's [B_s] result would have to be placed at its batch's rows of `ys`
        reason = (f"`ys` ({ys.name}) joins several batches along axis 0 "
                  f"({_batch_sizes.listing(batch, analysis.segments)}); the towers compute "
                  "it example by example in that order")
    if reason is not None:
        return (tuple(None if r.reached else () for r in request.reads),
                tuple(reason if r.reached else None for r in request.reads))
    uses, reasons = [], []
    unassumed = UnassumedGradients(request)
    loops = _loops.Loops(request, analysis, registry)
    for k, (x, reads) in enumerate(zip(request.xs, request.reads)):
        found = _weight_uses(x, reads, request.ys_upstream, analysis, registry, loops)
        if not isinstance(found, str) and found:
            found = unassumed.reason(k) or found
        if isinstance(found, str):
            uses.append(None)
            reasons.append(found)
        else:
            uses.append(tuple(found))
            reasons.append(None)
    return tuple(uses), tuple(reasons)


def _weight_uses(x, reads, ys_upstream, analysis, registry, loops):
    """The `Use`s of x, or a string saying why x is not covered (reads inside TF2 while
    loops: `pertower._loops`)."""
    if not reads.reached:
        return []
    if isinstance(x, tf.Tensor) and x.dtype == tf.resource:
        return ("it is a resource handle tensor (the rules shape their results by the "
                "entry of `xs`, here the handle's []); pass the variable instead")
    found = loops.uses(reads, _in_v1_loop)   # TF2 loops and TF1 frames: pertower._loops
    if isinstance(found, str):
        return found
    terminals = _weight_functions.exits(reads, ys_upstream, analysis)
    if isinstance(terminals, str):
        return terminals
    order = _tf.op_order_key()
    terminals.sort(key=lambda e: (order(e.op), e.slot))
    for exit_ in terminals:
        op, slot = exit_.op, exit_.slot
        inside = loops.inner_uses(exit_, _in_v1_loop)   # passed to a loop: pertower._loops
        if inside is not None:
            if isinstance(inside, str):
                return inside
            found.extend(inside)
            continue
        where = f"{op.name!r} ({op.type})" + (
            "" if exit_.reorder_only else
            " through " + ", ".join(f"{o.name!r} ({o.type})" for o in exit_.through))
        rule = registry.lookup(op.type)
        if rule is None:
            return f"it is read by {where}, which has no rule"
        use = rule.match(op, slot, analysis)
        if isinstance(use, str):
            return f"it is read by {where}: {use}"
        if use.rule is not rule:   # the registered rule computes what it matched
            use = dataclasses.replace(use, rule=rule)
        if use.weight_shape is None:   # read through a resource handle
            if not isinstance(x, tf.Variable):
                return f"it is read through a resource handle at {op.name!r} ({op.type})"
            use = dataclasses.replace(use, weight_shape=x.shape)
        dynamic = not exit_.reorder_only and getattr(rule, "dynamic_weight_shape", False)
        if not (use.weight_shape.is_fully_defined() or dynamic):
            return f"its shape at {op.name!r} ({use.weight_shape}) is not static"
        if not exit_.reorder_only:   # a function of the weights: pulled back to x
            use = _weight_functions.wrap(use, exit_)
            if not use.weight_shape.is_fully_defined():
                return f"its shape ({use.weight_shape}) is not static"
        found.append(use)
    return found


def _in_v1_loop(enter):
    return (f"it is read inside the TF1 (v1) while loop that {enter.name!r} ({enter.type}) "
            "enters, where tf.gradients cannot reach the dZ a rule needs")

"""Reductions over the batch axis whose result only sizes shapes or bounds loops.

Notation: as in `lattice`. tf.compat.v1.nn.dynamic_rnn takes max(sequence_length) over
the batch to bound its loop; `tf.range(tf.reduce_max(lengths))` sizes a mask. Such a
reduction reads every example, yet no example's *value* depends on the others: the
towers and the rules evaluate sizes and bounds with the whole batch, as `ys` does. The
scan asks `only_bounds` where a reduction's result goes before calling it a coupling.
"""

import tensorflow as tf

from pertower import _op_types as op_types
from pertower._batch_axis import functions
from pertower._batch_axis import loop_bounds
from pertower._batch_axis import transfer_layout

__all__ = ["only_bounds"]


def _integral(op):
    return all(o.dtype.is_integer or o.dtype == tf.bool for o in op.outputs)


def only_bounds(scan, op):
    """Where the outputs of `op` go in the scan `scan`: "bounds" when they only reach
    shape or axis operands and loop bounds (through integer arithmetic), "unclear" when
    they reach a function or loop whose use of them is not followed, "unmasked" when
    they bound a loop not proven to keep each example's state fixed past its own end
    (`loop_bounds`), "data" otherwise."""
    verdict = "bounds"
    stack, seen = list(op.outputs), set()
    while stack:
        tensor = stack.pop()
        if any(tensor is t for t in scan.targets) or not any(
                c in scan.region for c in tensor.consumers()):
            return "data"   # a result (`ys`, a body's output, the end of the ops)
        for consumer in tensor.consumers():
            if consumer not in scan.region:
                continue
            for j, t in enumerate(consumer.inputs):
                if t is not tensor or j in transfer_layout.shape_slots(consumer):
                    continue
                if consumer.type in op_types.V1_LOOP_COND_OP_TYPES:   # it bounds a TF1 loop
                    if not loop_bounds.masked_past_end(
                            op, loop_bounds.V1Loop(consumer), scan.shape_value):
                        verdict = "unmasked"
                    continue
                if _integral(consumer) and (
                        consumer.type in op_types.V1_BOUND_PLUMBING_OP_TYPES or (
                            consumer.type in op_types.V1_SWITCH_OP_TYPES and j == 0)):
                    for out in consumer.outputs:   # (an unused Exit, Merge index or
                        # Switch branch ends there)
                        if out.ref() not in seen and any(
                                c in scan.region for c in out.consumers()):
                            seen.add(out.ref())
                            stack.append(out)
                    continue
                if consumer.type in op_types.WHILE_OP_TYPES:
                    if not _passes_through(scan, consumer, j):
                        verdict = "unclear"
                    elif not _while_masked_past_end(scan, op, consumer):
                        verdict = "unmasked" if verdict == "bounds" else verdict
                    continue
                if consumer.type in functions.TRANSFERS:   # control flow, calls
                    verdict = "unclear"
                    continue
                if consumer.type in op_types.BOUND_ARITHMETIC_OP_TYPES and _integral(consumer):
                    for out in consumer.outputs:
                        if out.ref() not in seen:
                            seen.add(out.ref())
                            stack.append(out)
                    continue
                return "data"
    return verdict


def _while_masked_past_end(scan, reduction, op):
    """`loop_bounds.masked_past_end` for the While `op`, which `reduction` bounds."""
    cond, body = scan.function_graph(op, "cond"), scan.function_graph(op, "body")
    if cond is None or body is None or len(cond.inputs) != len(body.inputs):
        return False
    return loop_bounds.masked_past_end(
        reduction, loop_bounds.V2Loop(op, cond, body, scan.region), scan.shape_value)


def _passes_through(scan, op, j):
    """Whether loop variable j of a While is handed unchanged from iteration to
    iteration (the body only copies it; the condition may compare with it)."""
    body = scan.function_graph(op, "body")
    if body is None or j >= len(body.inputs):
        return False
    target = body.outputs[j]
    stack = [body.inputs[j]]
    while stack:
        tensor = stack.pop()
        if tensor is target:
            continue
        for consumer in tensor.consumers():
            if consumer.type != "Identity":
                return False
            stack.append(consumer.outputs[0])
    return True

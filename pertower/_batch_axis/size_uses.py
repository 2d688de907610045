"""How a value computed from the batch's size is used: as data or as a size.

Notation: B examples in the batch, T towers of B/T examples, n = tf.shape(x)[0].

A SIZE value (n, tf.size(x), tf.range(n), a shape [n, d]) means B in the whole batch and
B/T in a tower. Which one a replay must feed depends on the use, decided here only:

* **data**: the size enters the values that reach `ys` (`cost / tf.cast(n, tf.float32)`,
  `labels * n`): it means the whole batch's B, so the towers read it from the whole
  batch's graph (`Analysis.size_data_edges`), as the rules' batched backward pass does.
* **size**: anything else (a shape, an axis, a bound, tf.range over the examples, segment
  ids, gather indices): the towers keep their own size. `is_row_index` proves the index
  `tf.range(n)`, whose entry i is the row of example i in the batch and in every tower.

A reduction over the batch whose result only sizes shapes or bounds loops (dynamic_rnn's
max(sequence_length)) reads every example, yet no example's *value* depends on the
others: the scan asks `only_bounds` where such a result goes before calling it a
coupling.
"""

import tensorflow as tf

from pertower import _op_types as op_types
from pertower._batch_axis import functions
from pertower._batch_axis import loop_bounds
from pertower._batch_axis import static
from pertower._batch_axis.lattice import SIZE

__all__ = ["is_data_use", "is_row_index", "only_bounds"]

# Ops through which an integer keeps its value (an index stays the same index).
_SAME_VALUE_OP_TYPES = frozenset({"Identity", "Cast", "Snapshot"})


def is_data_use(op, j, ins, outs):
    """Whether the integer SIZE input j (not a shape slot) of `op` is a data use;
    `ins`, `outs`: the lattice values of op's inputs and outputs."""
    if op.type == "Cast":
        return any(t.dtype.is_floating or t.dtype.is_complex for t in op.outputs)
    if op.type in op_types.ELEMENTWISE_OP_TYPES:
        # a scalar size scaling per-example values (labels * n); a [B] range added to
        # them (tf.range(n) * C + labels) is an index of the tower's own rows
        return op.inputs[j].shape.rank == 0 and any(v is not SIZE for v in outs)
    return False


def is_row_index(shape_value, tensor, rows):
    """Whether `tensor`, [B] (or [B, 1]), is provably tf.range(n), n the number of
    examples of a tensor laid out as `rows` (one row per example): entry i is the row of
    example i. `shape_value`: the scan's `static.ShapeEvaluator` (n is B when it is
    tf.shape(x)[a] of a batch axis a with one row per example, or tf.size of a [B] x)."""
    tensor = _column(tensor)
    while tensor.op.type in _SAME_VALUE_OP_TYPES and tensor.op.inputs:
        tensor = tensor.op.inputs[0]
    op = tensor.op
    if op.type != "Range" or rows.k != 1:
        return False
    start, delta = static.static_value(op.inputs[0]), static.static_value(op.inputs[2])
    if start is None or delta is None or int(start) != 0 or int(delta) != 1:
        return False
    return shape_value(op.inputs[1]) == [(1, 1)]


def _column(tensor):
    """The [B] tensor of which the [B, 1] `tensor` is a column (tf.expand_dims(r, 1),
    r[:, None], tf.reshape(r, [-1, 1])); `tensor` itself otherwise."""
    op = tensor.op
    if tensor.shape.rank != 2 or tf.compat.dimension_value(tensor.shape[1]) != 1:
        return tensor
    if op.type in ("ExpandDims", "Reshape", "StridedSlice") and op.inputs[0].shape.rank == 1:
        if op.type == "StridedSlice" and op.get_attr("new_axis_mask") != 2:
            return tensor
        return op.inputs[0]
    return tensor


def _integral(op):
    return all(o.dtype.is_integer or o.dtype == tf.bool for o in op.outputs)


def only_bounds(scan, op):
    """Where the outputs of the reduction `op` go in `scan`: "bounds" (only shape or
    axis operands and loop bounds, through integer arithmetic), "unclear" (a function
    or loop not followed), "unmasked" (a loop not proven to keep each example's state
    past its own end, `loop_bounds`), else "data"."""
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
                if t is not tensor or j in static.shape_slots(consumer):
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

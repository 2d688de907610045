"""How a value computed from the batch's size is used: as data or as a size.

Notation: B examples in the batch, T towers of B/T examples, n = tf.shape(x)[0].

A SIZE value (n, tf.size(x), tf.range(n), a shape [n, d]) means B in the whole batch and
B/T in a tower that replays the graph on B/T examples. Which of the two a replay must
feed depends on the use, decided here and nowhere else:

* **data**: the size enters the arithmetic of the values that reach `ys`: it becomes a
  float (`cost / tf.cast(n, tf.float32)`) or scales per-example integers (`labels * n`).
  It means the whole batch's B, so the towers read it from the whole batch's graph
  (`Analysis.size_data_edges`), and the rules' batched backward pass sees B as `ys` does.
* **size**: anything else (a shape, an axis, a bound, a range over the examples, an index
  for `tf.gather_nd`, segment ids, the positions `embedding_lookup` partitions by): the
  towers keep their own size (the replayed op sees its slice, as the batched op sees the
  batch). `is_row_index` proves the TF1 index `tf.range(n)`, whose entry i is the row of
  example i, in the batch and in every tower alike.

A reduction over the batch whose result only sizes shapes or bounds loops (dynamic_rnn's
max(sequence_length), `tf.range(tf.reduce_max(lengths))`) reads every example, yet no
example's *value* depends on the others: the scan asks `only_bounds` where such a result
goes before calling it a coupling.
"""

import tensorflow as tf

from pertower import _op_types as op_types
from pertower._batch_axis import functions
from pertower._batch_axis import loop_bounds
from pertower._batch_axis import static
from pertower._batch_axis.lattice import SIZE, Rows

__all__ = ["is_data_use", "is_row_index", "only_bounds"]

# Ops through which an integer keeps its value (an index stays the same index).
_SAME_VALUE_OP_TYPES = frozenset({"Identity", "Cast", "Snapshot"})


def is_data_use(op, j, ins, outs):
    """Whether the integer SIZE input j (not a shape slot) of `op` enters the values
    reaching `ys`; `ins`, `outs`: the lattice values of op's inputs and outputs."""
    if op.type == "Cast":
        return any(t.dtype.is_floating or t.dtype.is_complex for t in op.outputs)
    if op.type in op_types.ELEMENTWISE_OP_TYPES:
        # a scalar size scaling per-example values (labels * n); a [B] range added to
        # them (tf.range(n) * C + labels) is an index of the tower's own rows
        return op.inputs[j].shape.rank == 0 and any(v is not SIZE for v in outs)
    return False


def is_row_index(value_of, tensor, rows):
    """Whether `tensor`, [B] (or [B, 1]), is provably tf.range(n), n the number of
    examples of a tensor laid out as `rows` (one row per example): entry i is the row of
    example i. `value_of`: tensor -> lattice value (the scan's)."""
    tensor = _column(tensor)
    while tensor.op.type in _SAME_VALUE_OP_TYPES and tensor.op.inputs:
        tensor = tensor.op.inputs[0]
    op = tensor.op
    if op.type != "Range" or rows.k != 1:
        return False
    start, delta = static.static_value(op.inputs[0]), static.static_value(op.inputs[2])
    if start is None or delta is None or int(start) != 0 or int(delta) != 1:
        return False
    return _is_batch_size(value_of, op.inputs[1])


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


def _is_batch_size(value_of, n):
    """Whether the scalar `n` is B: tf.shape(x)[a] with a the batch axis of x (one row
    per example), or tf.size(x) of a [B] tensor x."""
    while n.op.type in _SAME_VALUE_OP_TYPES and n.op.inputs:
        n = n.op.inputs[0]
    op = n.op
    if op.type == "Size":
        x = op.inputs[0]
        value = value_of(x)
        return isinstance(value, Rows) and value.k == 1 and x.shape.rank == 1
    if op.type != "StridedSlice" or op.inputs[0].op.type != "Shape":
        return False
    if op.get_attr("shrink_axis_mask") != 1 or op.get_attr("ellipsis_mask") or op.get_attr(
            "new_axis_mask") or op.get_attr("begin_mask") & 1:
        return False
    begin = static.static_value(op.inputs[1])
    if begin is None or len(begin) != 1:
        return False
    x = op.inputs[0].op.inputs[0]
    value = value_of(x)
    return (isinstance(value, Rows) and value.k == 1 and x.shape.rank is not None
            and int(begin[0]) % x.shape.rank == value.lead)


def _integral(op):
    return all(o.dtype.is_integer or o.dtype == tf.bool for o in op.outputs)


def only_bounds(scan, op):
    """Where the outputs of the reduction `op` go in `scan`: "bounds" when they only
    reach shape or axis operands and loop bounds (through integer arithmetic), "unclear"
    when they reach a function or loop whose use of them is not followed, "unmasked"
    when they bound a loop not proven to keep each example's state fixed past its own
    end (`loop_bounds`), "data" otherwise."""
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

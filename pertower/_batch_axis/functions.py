"""Function bodies and control flow: functional If/While/calls, TensorLists, TF1 (v1)
cond and while frames, v1 TensorArrays, and TF1 loops over the batch's examples.

Notation: as in `lattice`. A function body is analysed like the outer graph, its inputs
seeded with the op's input values (`scan.body_values`); a coupling inside is reported
on the op that runs it. A TensorList and a v1 TensorArray's *flow* hold the value of
their elements. A v1 while frame's ops pass their data on unchanged; the scan reads the
back edge NextIteration -> Merge on its next pass. The number of iterations must not
depend on the batch's values (raw_rnn's loop is not proven).

tf.compat.v1.map_fn(f, x) over the batch scatters the rows of x [B, ...] into a
TensorArray, reads element i in a v1 loop and writes f of it at i of a second array:

* the flow of an array whose elements are the examples is EXAMPLE_ELEMENTS,
  Rows(lead=-1, k=1, .): scattered from one row per example at the indices 0..B-1, and
  gathered back at those indices into Rows(0, 1, .);
* reading it at an index tensor i gives `Example(i)`; an op whose other inputs do not
  depend on the batch's values computes from that example alone: `Example(i)` too;
* writing an `Example(i)` at the same index tensor i puts example i's result at row i.

Anything else is lost: an `Example` combined with other rows or another iteration's
element, carried into the next iteration, leaving the loop or written elsewhere.
"""

import tensorflow as tf

from pertower import _op_types as op_types
from pertower._batch_axis import lattice
from pertower._batch_axis.lattice import INDEPENDENT, SIZE, UNKNOWN, Example, Rows

__all__ = ["TRANSFERS", "CONTROL_FLOW_OP_TYPES", "example_transfer", "reads_example"]

# The flow of a TensorArray whose elements are the batch's examples.
EXAMPLE_ELEMENTS = Rows(-1, 1, None)


def cond(scan, op, ins):
    """tf.cond with a predicate that does not depend on the batch's values: the join of
    both branches."""
    if lattice.depends_on_values(ins[0]):
        raise lattice.Lost("the branch taken depends on the batch's values")
    branches = [scan.body_values(op, attr, ins[1:]) for attr in ("then_branch", "else_branch")]
    return [lattice.join(a, b) for a, b in zip(*branches)]


def call(scan, op, ins):
    return scan.body_values(op, "f", ins)


def _loop_join(first, second):
    """A loop variable's value over iterations (an empty list takes its elements')."""
    if first in (INDEPENDENT, SIZE) and isinstance(second, Rows):
        return second
    return lattice.join(first, second)


def while_loop(scan, op, ins):
    """Analyses the body until the values of the loop variables settle."""
    values = list(ins)
    for _ in range(4):
        outs = scan.body_values(op, "body", values)
        if len(outs) != len(values):
            raise lattice.Lost("its body's outputs do not match its loop variables")
        merged = [_loop_join(a, b) for a, b in zip(values, outs)]
        if merged == values:
            predicate = scan.body_values(op, "cond", values)[0]
            if lattice.depends_on_values(predicate):
                raise lattice.Lost("the number of iterations depends on the batch's values")
            return values
        values = merged
    raise lattice.Lost("the values of its loop variables did not settle")


def _shifted(value, shift, what):
    """The Rows of a list's elements (shift -1) or of their stack (shift +1); SIZE for a
    list that does not hold the batch's rows."""
    if value is UNKNOWN:
        raise lattice.Lost(f"its {what} batch axis was already lost")
    return Rows(value.lead + shift, value.k, None) if isinstance(value, Rows) else SIZE


def _index_checked(ins, j):
    if lattice.depends_on_values(ins[j]):
        raise lattice.Lost("its index depends on the batch's values")


def list_from_tensor(scan, op, ins):
    if isinstance(ins[0], Rows) and ins[0].lead == 0:
        raise lattice.Lost("it makes a TensorList over the batch axis: one element per "
                           "example, which a loop then visits in turn (tf.scan, "
                           "tf.map_fn over the batch)")
    return [_shifted(ins[0], -1, "input's")]


def list_get_item(scan, op, ins):
    """TensorListGetItem(list, index, shape), TensorArrayReadV3(handle, index, flow)."""
    _index_checked(ins, 1)
    if op.type == "TensorListGetItem":
        return [ins[0]]
    return [Example(op.inputs[1].name) if ins[2] == EXAMPLE_ELEMENTS else ins[2]]


def list_set_item(scan, op, ins):
    _index_checked(ins, 1)
    return [_loop_join(ins[0], ins[2])]


def list_push_back(scan, op, ins):
    """TensorListPushBack(list, element) -> list (a while_v2 body's gradient accumulators);
    TensorListPopBack(list, shape) -> (list, element)."""
    if op.type == "TensorListPopBack":
        return [ins[0], ins[0]]
    return [_loop_join(ins[0], ins[1])]


def list_stack(scan, op, ins):
    return [_shifted(ins[0], 1, "list's")]


def switch(scan, op, ins):
    """TF1 cond: both outputs carry the data; a predicate from the batch's values is lost."""
    if lattice.depends_on_values(ins[1]):
        raise lattice.Lost("the branch taken depends on the batch's values")
    return [ins[0], ins[0]]


def merge(scan, op, ins):
    """TF1 cond: the branch that ran; TF1 loop: the entering value joined with the
    one NextIteration hands back. Output 1 is an index."""
    value = INDEPENDENT
    for t, v in zip(op.inputs, ins):
        value = (_loop_join(value, v) if t.op.type in op_types.V1_NEXT_ITERATION_OP_TYPES
                 else lattice.join(value, v))
    return [value, INDEPENDENT]


def v1_loop_pass(scan, op, ins):
    """Enter, Exit, NextIteration, LoopCond: the value goes on unchanged."""
    if op.type == "LoopCond" and lattice.depends_on_values(ins[0]):
        raise lattice.Lost("the number of iterations of its TF1 while loop depends on the "
                           "batch's values")
    return [ins[0]]


def tensor_array_scatter(scan, op, ins):
    """TensorArrayScatterV3(handle, indices, value [N, ...], flow) -> flow: the elements
    are value's rows along axis 0, so the batch axis moves down by one."""
    _index_checked(ins, 1)
    value = ins[2]
    if isinstance(value, Rows) and value.lead == 0:   # one element per example
        # (tf.compat.v1.map_fn over the batch)
        if value.k != 1 or not _identity_indices(op.inputs[1]):
            raise lattice.Lost("it makes a TensorArray over the batch axis whose elements "
                               "are not the examples in order (several rows per example, "
                               "or indices other than 0, 1, ..., B - 1)")
        return [_loop_join(ins[3], EXAMPLE_ELEMENTS)]
    return [_loop_join(ins[3], _shifted(value, -1, "input's"))]


def tensor_array_write(scan, op, ins):
    """TensorArrayWriteV3(handle, index, value, flow) -> flow."""
    _index_checked(ins, 1)
    value = ins[2]
    if isinstance(value, Example):
        if op.inputs[1].name != value.index:
            raise lattice.Lost("it writes one example's value (read at "
                               f"{value.index!r}) at another index")
        value = EXAMPLE_ELEMENTS
    return [_loop_join(ins[3], value)]


def tensor_array_gather(scan, op, ins):
    """TensorArrayGatherV3(handle, indices, flow) -> [N, ...elements]."""
    _index_checked(ins, 1)
    if ins[2] == EXAMPLE_ELEMENTS and not _identity_indices(op.inputs[1]):
        raise lattice.Lost("it gathers the examples of a TensorArray at indices other than "
                           "0, 1, ..., B - 1")
    return [_shifted(ins[2], 1, "TensorArray's")]


def reads_example(op, ins):
    """Whether `example_transfer` gives the outputs of `op` (an input is an Example)."""
    return op.type != "TensorArrayWriteV3" and any(isinstance(v, Example) for v in ins)


def example_transfer(scan, op, ins):
    """The outputs of `op`, one of whose inputs is an `Example` (see the module)."""
    examples = {v for v in ins if isinstance(v, Example)}
    if len(examples) > 1:
        raise lattice.Lost("it combines elements that a loop over the batch's examples "
                           "read at different indices")
    example = examples.pop()
    if any(not isinstance(v, Example) and v not in (INDEPENDENT, SIZE) for v in ins):
        raise lattice.Lost("it combines one example (the element a loop over the batch's "
                           "examples reads) with values computed from other examples")
    if op.type in op_types.V1_EXIT_OP_TYPES:
        raise lattice.Lost("one example's value leaves the loop over the batch's examples "
                           "(only the TensorArray written at the index it was read at "
                           "is followed)")
    if op.type in op_types.V1_MERGE_OP_TYPES and any(
            isinstance(v, Example) and t.op.type in op_types.V1_NEXT_ITERATION_OP_TYPES
            for t, v in zip(op.inputs, ins)):
        raise lattice.Lost("a loop variable carries one example's value into the next "
                           "iteration (the next example's)")
    if op.type.startswith("TensorArray"):   # (a write: `tensor_array_write`)
        raise lattice.Lost("a TensorArray op reads one example's value other than as the "
                           "value written at the index it was read at")
    return [example] * len(op.outputs)


def _identity_indices(tensor):
    """Whether `tensor` is tf.range(0, n, 1), as TensorArray.unstack and .stack use."""
    op = tensor.op
    if op.type != "Range":
        return False
    start, delta = (tf.get_static_value(t) for t in (op.inputs[0], op.inputs[2]))
    return start is not None and delta is not None and int(start) == 0 and int(delta) == 1


TRANSFERS = {
    "TensorListFromTensor": list_from_tensor, "TensorListGetItem": list_get_item,
    "TensorListSetItem": list_set_item, "TensorListStack": list_stack,
    "TensorListPushBack": list_push_back, "TensorListPopBack": list_push_back,
    "TensorArrayScatterV3": tensor_array_scatter, "TensorArrayReadV3": list_get_item,
    "TensorArrayWriteV3": tensor_array_write, "TensorArrayGatherV3": tensor_array_gather,
    "TensorArraySizeV3": lambda scan, op, ins: [SIZE],
}
for _types, _transfer in ((op_types.IF_OP_TYPES, cond),
                          (op_types.FUNCTION_CALL_OP_TYPES, call),
                          (op_types.WHILE_OP_TYPES, while_loop),
                          (op_types.V1_SWITCH_OP_TYPES, switch),
                          (op_types.V1_MERGE_OP_TYPES, merge),
                          (op_types.V1_LOOP_OP_TYPES, v1_loop_pass)):
    TRANSFERS.update(dict.fromkeys(_types, _transfer))
# Ops whose transfer functions read UNKNOWN inputs themselves.
CONTROL_FLOW_OP_TYPES = frozenset(TRANSFERS) - {"TensorListFromTensor", "TensorListStack",
                                               "TensorListPushBack", "TensorListPopBack",
                                               "TensorArrayScatterV3",
                                               "TensorArrayGatherV3"}

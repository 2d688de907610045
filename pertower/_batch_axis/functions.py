"""Function bodies and control flow: functional If/While/calls, TensorLists, v1 Switch/Merge,
v1 while loops (Enter/Exit/NextIteration/LoopCond) and v1 TensorArrays.

Notation: as in `lattice`. A function body is analysed like the outer graph, its
inputs seeded with the values of the op's inputs (`scan.body_values`); a coupling
inside is reported on the op that runs the function. A TensorList (the variant a
while loop carries: tf.scan's elements, a Keras RNN's time steps) holds the value of
its *elements*.

A TF1 (v1) while loop is not a function but a frame of ops in the graph: Enter passes
a value into the frame, Merge joins it with the value NextIteration hands back from the
previous iteration (a back edge, which the scan follows by running again until the
values settle, see `analysis._Scan.run`), Switch on LoopCond either continues the body
or leaves through Exit. Each of them passes its data on unchanged; the number of
iterations must not depend on the batch's values (LoopCond). A v1 TensorArray (the
time steps of tf.compat.v1.nn.dynamic_rnn) is followed through its *flow* tensor,
which holds the value of its elements, as a TensorList's variant does; a TensorArray
of the batch's examples (tf.compat.v1.map_fn over the batch) is followed by `examples`.

So tf.compat.v1.nn.dynamic_rnn is proven with LSTMCell, GRUCell, BasicRNNCell and a
MultiRNNCell of them, with or without sequence_length, whether `ys` reads its outputs or
its final state (the scan visits a loop's Merge before its body: `analysis._topological`
does not follow the back edge). raw_rnn's loop, which runs until every example has
finished (a reduce_all over the batch), is not proven: the run-time check decides.
"""

from pertower import _op_types as op_types
from pertower._batch_axis import examples
from pertower._batch_axis import lattice
from pertower._batch_axis.lattice import INDEPENDENT, SIZE, UNKNOWN, Rows

__all__ = ["TRANSFERS", "CONTROL_FLOW_OP_TYPES"]


def cond(scan, op, ins):
    """tf.cond (and Keras Dropout / BatchNormalization with training=None): with a
    predicate that does not depend on the batch's values, each output is what both
    branches agree on."""
    if lattice.depends_on_values(ins[0]):
        raise lattice.Lost("the branch taken depends on the batch's values")
    branches = [scan.body_values(op, attr, ins[1:]) for attr in ("then_branch", "else_branch")]
    return [lattice.join(a, b) for a, b in zip(*branches)]


def call(scan, op, ins):
    return scan.body_values(op, "f", ins)


def _loop_join(first, second):
    """A loop variable's value over iterations; an empty TensorList (SIZE or
    INDEPENDENT) takes the value of the elements set into it."""
    if first in (INDEPENDENT, SIZE) and isinstance(second, Rows):
        return second
    return lattice.join(first, second)


def while_loop(scan, op, ins):
    """The body maps loop variables to their next values: analyse it until the values
    of the loop variables stop changing."""
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
    _index_checked(ins, 1)
    return [ins[0]]


def list_set_item(scan, op, ins):
    _index_checked(ins, 1)
    return [_loop_join(ins[0], ins[2])]


def list_stack(scan, op, ins):
    return [_shifted(ins[0], 1, "list's")]


def switch(scan, op, ins):
    """TF1 cond: both outputs carry the data; a predicate from the batch's values is lost."""
    if lattice.depends_on_values(ins[1]):
        raise lattice.Lost("the branch taken depends on the batch's values")
    return [ins[0], ins[0]]


def merge(scan, op, ins):
    """TF1 cond: the value of whichever branch ran (output 1 is its index). TF1 loop:
    the value entering the loop joined with the one NextIteration hands back."""
    value = INDEPENDENT
    for t, v in zip(op.inputs, ins):
        value = (_loop_join(value, v) if t.op.type in op_types.V1_NEXT_ITERATION_OP_TYPES
                 else lattice.join(value, v))
    return [value, INDEPENDENT]


def v1_loop_pass(scan, op, ins):
    """Enter, Exit, NextIteration: the value goes on unchanged; LoopCond: a predicate
    from the batch's values would make the number of iterations differ per batch."""
    if op.type == "LoopCond" and lattice.depends_on_values(ins[0]):
        raise lattice.Lost("the number of iterations of its TF1 while loop depends on the "
                           "batch's values")
    return [ins[0]]


def tensor_array_scatter(scan, op, ins):
    """TensorArrayScatterV3(handle, indices, value [N, ...], flow) -> flow: the elements
    are value's rows along axis 0 (N time steps), so the batch axis moves down by one."""
    _index_checked(ins, 1)
    value = ins[2]
    if isinstance(value, Rows) and value.lead == 0:   # one element per example
        # (tf.compat.v1.map_fn over the batch)
        if value.k != 1 or not examples.identity_indices(op.inputs[1]):
            raise lattice.Lost("it makes a TensorArray over the batch axis whose elements "
                               "are not the examples in order (several rows per example, "
                               "or indices other than 0, 1, ..., B - 1)")
        return [_loop_join(ins[3], examples.EXAMPLE_ELEMENTS)]
    return [_loop_join(ins[3], _shifted(value, -1, "input's"))]


def tensor_array_read(scan, op, ins):
    """TensorArrayReadV3(handle, index, flow) -> one element; of an array whose
    elements are the examples: one example, Example(index)."""
    _index_checked(ins, 1)
    if ins[2] == examples.EXAMPLE_ELEMENTS:
        return [lattice.Example(op.inputs[1].name)]
    return [ins[2]]


def tensor_array_write(scan, op, ins):
    """TensorArrayWriteV3(handle, index, value, flow) -> flow; one example's value
    written at the index it was read at makes an array whose elements are the
    examples."""
    _index_checked(ins, 1)
    value = ins[2]
    if isinstance(value, lattice.Example):
        if op.inputs[1].name != value.index:
            raise lattice.Lost("it writes one example's value (read at "
                               f"{value.index!r}) at another index")
        value = examples.EXAMPLE_ELEMENTS
    return [_loop_join(ins[3], value)]


def tensor_array_gather(scan, op, ins):
    """TensorArrayGatherV3(handle, indices, flow) -> [N, ...elements]."""
    _index_checked(ins, 1)
    if ins[2] == examples.EXAMPLE_ELEMENTS and not examples.identity_indices(op.inputs[1]):
        raise lattice.Lost("it gathers the examples of a TensorArray at indices other than "
                           "0, 1, ..., B - 1")
    return [_shifted(ins[2], 1, "TensorArray's")]


def tensor_array_size(scan, op, ins):
    return [SIZE]


TRANSFERS = {
    "TensorListFromTensor": list_from_tensor, "TensorListGetItem": list_get_item,
    "TensorListSetItem": list_set_item, "TensorListStack": list_stack,
    "TensorArrayScatterV3": tensor_array_scatter, "TensorArrayReadV3": tensor_array_read,
    "TensorArrayWriteV3": tensor_array_write, "TensorArrayGatherV3": tensor_array_gather,
    "TensorArraySizeV3": tensor_array_size,
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
                                               "TensorArrayScatterV3",
                                               "TensorArrayGatherV3"}

"""Function bodies and control flow: functional If/While/calls, TensorLists, v1 Switch/Merge.

Notation: as in `lattice`. A function body is analysed like the outer graph, its
inputs seeded with the values of the op's inputs (`scan.body_values`); a coupling
inside is reported on the op that runs the function. A TensorList (the variant a
while loop carries: tf.scan's elements, a Keras RNN's time steps) holds the value of
its *elements*.
"""

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


def list_from_tensor(scan, op, ins):
    value = ins[0]
    if value is UNKNOWN:
        raise lattice.Lost("its input's batch axis was already lost")
    if not isinstance(value, Rows):
        return [SIZE]
    if value.lead == 0:
        raise lattice.Lost("it makes a TensorList over the batch axis: one element per "
                           "example, which a loop then visits in turn (tf.scan, "
                           "tf.map_fn over the batch)")
    return [Rows(value.lead - 1, value.k, None)]


def list_get_item(scan, op, ins):
    if lattice.depends_on_values(ins[1]):
        raise lattice.Lost("its index depends on the batch's values")
    return [ins[0]]


def list_set_item(scan, op, ins):
    if lattice.depends_on_values(ins[1]):
        raise lattice.Lost("its index depends on the batch's values")
    return [_loop_join(ins[0], ins[2])]


def list_stack(scan, op, ins):
    value = ins[0]
    if value is UNKNOWN:
        raise lattice.Lost("its list's batch axis was already lost")
    if not isinstance(value, Rows):
        return [SIZE]
    return [Rows(value.lead + 1, value.k, None)]


def switch(scan, op, ins):
    """TF1 cond: both outputs carry the data; a predicate from the batch's values is lost."""
    if lattice.depends_on_values(ins[1]):
        raise lattice.Lost("the branch taken depends on the batch's values")
    return [ins[0], ins[0]]


def merge(scan, op, ins):
    """TF1 cond: the value of whichever branch ran (output 1 is its index)."""
    value = INDEPENDENT
    for v in ins:
        value = lattice.join(value, v)
    return [value, INDEPENDENT]


TRANSFERS = {
    "If": cond, "StatelessIf": cond, "PartitionedCall": call,
    "StatefulPartitionedCall": call, "While": while_loop, "StatelessWhile": while_loop,
    "TensorListFromTensor": list_from_tensor, "TensorListGetItem": list_get_item,
    "TensorListSetItem": list_set_item, "TensorListStack": list_stack,
    "Switch": switch, "RefSwitch": switch, "Merge": merge, "RefMerge": merge,
}
# Ops whose transfer functions read UNKNOWN inputs themselves.
CONTROL_FLOW_OP_TYPES = frozenset(TRANSFERS) - {"TensorListFromTensor", "TensorListStack"}

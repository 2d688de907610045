"""TF1 loops over the batch's examples: tf.compat.v1.map_fn over the batch axis.

Notation: as in `lattice`. tf.compat.v1.map_fn(f, x) scatters the rows of x [B, ...]
into a TensorArray (one element per example), and its v1 while loop reads element i,
computes f on it and writes the result at i of a second TensorArray, which is then
stacked into [B, ...]. Inside the body, element i is one example: a reduction over
every axis of it (tf.reduce_sum(row)) reduces one example, not the batch.

The scan follows it with three values (see `functions` for the TensorArray ops):

* the flow of a TensorArray whose elements are the examples is Rows(lead=-1, k=1, .):
  made by scattering a [B, ...] tensor with one row per example at the indices
  0, 1, ..., B - 1, and gathered back at those indices into Rows(lead=0, k=1, .);
* reading it at an index tensor i gives `Example(i)`, one example's values;
* every op whose inputs are that `Example` and values that do not depend on the
  batch's values (weights, constants, the batch's size) computes from that example
  alone: its outputs are `Example(i)` too (`transfer`);
* writing an `Example(i)` at the same index tensor i puts example i's result at row i
  of the output array (flow Rows(lead=-1, ...)).

Anything else is lost, not proven: an `Example` combined with the rows of other
examples, two iterations' elements combined, a loop variable that carries one
example's value into the next iteration (tf.scan over the batch), one example's value
leaving the loop (Exit) or written at another index.
"""

import tensorflow as tf

from pertower import _op_types as op_types
from pertower._batch_axis import lattice
from pertower._batch_axis.lattice import INDEPENDENT, SIZE, Example, Rows

__all__ = ["EXAMPLE_ELEMENTS", "transfer", "handles", "identity_indices"]

# The flow of a TensorArray whose elements are the batch's examples.
EXAMPLE_ELEMENTS = Rows(-1, 1, None)
# Ops that read an Example themselves (`functions`).
_OWN_TRANSFER_OP_TYPES = frozenset({"TensorArrayWriteV3"})


def handles(op, ins):
    """Whether `transfer` gives the outputs of `op` (an input is an Example)."""
    return op.type not in _OWN_TRANSFER_OP_TYPES and any(
        isinstance(v, Example) for v in ins)


def transfer(scan, op, ins):
    """The outputs of `op`, one of whose inputs is an `Example` (see the module
    docstring); raises lattice.Lost where one example's values are not followed."""
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
    if op.type.startswith("TensorArray"):   # (a write is read by `functions`)
        raise lattice.Lost("a TensorArray op reads one example's value other than as the "
                           "value written at the index it was read at")
    return [example] * len(op.outputs)


def identity_indices(tensor):
    """Whether `tensor` is tf.range(0, n, 1) (the indices 0, ..., n - 1 in order), as
    TensorArray.unstack and .stack use."""
    op = tensor.op
    if op.type != "Range":
        return False
    start, delta = (tf.get_static_value(t) for t in (op.inputs[0], op.inputs[2]))
    return start is not None and delta is not None and int(start) == 0 and int(delta) == 1

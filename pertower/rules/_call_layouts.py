"""The re-layouts between a function call's tensors and the body op a rule covers
(`rules.function_call`; N = B*k rows, an argument of the body is the call's input of
the same index).

A re-layout (Identity, ExpandDims, Squeeze, Reshape) only re-reads its input's values
in row-major order, so a chain of them from a body argument to an input of `inner` (or
from `inner`'s output to a body output) computes t_inner = reshape(t_arg,
shape(t_inner)), its gradient the reshape back. Two kinds of chain are mapped:

    batch-preserving  every op keeps axis 0 with its size (a Reshape [N, *r] -> [N, *r'],
                      r, r' static, prod(r) = prod(r') > 0): t_inner = reshape(t_arg,
                      [-1, *r']), the call tensor's rows.
    static            the chain's ends have static shapes (a weight's [3, 4, 8] ->
                      [1, 3, 4, 8]).

Anything else (a Transpose, a Reshape that moves the batch axis, an unknown size) is
refused with the op's name.
"""

import tensorflow as tf

from pertower import _batch_axis
from pertower._layout import _rows

__all__ = ["RELAYOUT_OP_TYPES", "Chain", "past_relayouts", "source", "returned", "consumers",
           "relayout", "per_group_to", "MappedAnalysis"]

RELAYOUT_OP_TYPES = frozenset({"Identity", "ExpandDims", "Squeeze", "Reshape"})
_SHAPE_OP_TYPES = frozenset({"Shape", "ShapeN", "Size", "Rank"})   # read no values


class Chain:
    """A re-layout chain from `start` to `end` (body tensors): `ops` in order, whether it
    keeps the batch axis (`keeps_batch`), and `why` (None, or why it does not)."""

    def __init__(self, start, end, ops):
        self.start, self.end, self.ops = start, end, tuple(ops)
        self.why = next((why for why in map(_batch_kept, self.ops) if why is not None), None)
        self.keeps_batch = self.why is None

    @property
    def identity(self):
        """Whether every op of the chain is an Identity (the body tensor is the call's)."""
        return all(op.type == "Identity" for op in self.ops)

    def mappable(self):
        """None when `relayout` maps between the chain's ends exactly, else why not."""
        if self.identity:
            return None
        ends = (self.start, self.end)
        if self.keeps_batch and all(t.shape.rank and None not in t.shape.as_list()[1:]
                                    for t in ends):
            return None
        if all(t.shape.is_fully_defined() for t in ends):
            return None
        return self.why or (f"{self.ops[-1].name!r} ({self.ops[-1].type}) has sizes that "
                            "are not static")


def _constant(tensor):
    """The value of a body Const `tensor` as a list of ints, or None."""
    if tensor.op.type != "Const":
        return None
    return [int(v) for v in tf.make_ndarray(tensor.op.get_attr("value")).ravel()]


def _batch_kept(op):
    """None when re-layout `op` keeps axis 0 (the batch's) as axis 0, else why not."""
    if op.type == "Identity":
        return None
    rank_in, rank_out = op.inputs[0].shape.rank, op.outputs[0].shape.rank
    if rank_in is None or rank_out is None or rank_in == 0 or rank_out == 0:
        return f"{op.name!r} ({op.type}) has an unknown rank"
    if op.type == "ExpandDims":
        axis = _constant(op.inputs[1])
        if axis is None or len(axis) != 1 or axis[0] % rank_out == 0:
            return f"{op.name!r} (ExpandDims) adds axis 0"
        return None
    if op.type == "Squeeze":
        dims = [d % rank_in for d in op.get_attr("squeeze_dims")]
        if not dims or 0 in dims:
            return f"{op.name!r} (Squeeze) may remove axis 0"
        return None
    # Reshape: [N, *r] -> [N, *r'], both r static with the same product > 0
    size_in = op.inputs[0].shape[1:].num_elements()
    size_out = op.outputs[0].shape[1:].num_elements()
    if size_in is None or size_out is None:
        return f"{op.name!r} (Reshape) has sizes past axis 0 that are not static"
    if size_in != size_out or size_in == 0:
        return f"{op.name!r} (Reshape) moves the batch axis"
    return None


def past_relayouts(tensor):
    """The tensor that `tensor` re-lays out (itself when its op is no re-layout)."""
    while tensor.op.type in RELAYOUT_OP_TYPES:
        tensor = tensor.op.inputs[0]
    return tensor


def source(tensor, body):
    """(argument index, `Chain` from the argument to `tensor`) when `tensor` is a body
    argument past re-layout ops (their data input), else None."""
    ops = []
    current = tensor
    while current.op.type in RELAYOUT_OP_TYPES:
        ops.append(current.op)
        current = current.op.inputs[0]
    for index, argument in enumerate(body.inputs):
        if current is argument:
            return index, Chain(argument, tensor, reversed(ops))
    return None


def consumers(tensor):
    """The (consumer op, input index) pairs of `tensor` past re-layout ops (through their
    data input; a re-layout's shape or axis input ends the walk there)."""
    found = []
    for op in tensor.consumers():
        slots = [j for j, t in enumerate(op.inputs) if t is tensor]
        if op.type in RELAYOUT_OP_TYPES and slots == [0]:
            found.extend(consumers(op.outputs[0]))
        else:
            found.extend((op, j) for j in slots)
    return found


def returned(tensor, body):
    """Every (output index, `Chain` from `tensor` to that body output) along the paths of
    re-layout ops from `tensor`, when nothing but re-layouts and Shape ops reads those
    tensors in the body (a gradient of the call may return several); else None."""
    found = []

    def walk(current, ops):
        found.extend((k, Chain(tensor, current, ops)) for k, out in enumerate(body.outputs)
                     if out is current)
        for op in current.consumers():
            slots = [j for j, t in enumerate(op.inputs) if t is current]
            if op.type in _SHAPE_OP_TYPES:
                continue
            if op.type not in RELAYOUT_OP_TYPES or slots != [0]:
                return False
            if not walk(op.outputs[0], ops + [op]):
                return False
        return True

    return found if walk(tensor, []) else None


def relayout(tensor, target, chain):
    """`tensor`, laid out like one end of the mappable `chain`, in the layout of the
    chain's other end `target` (see the module docstring)."""
    if chain.identity:
        return tensor
    shape = target.shape.as_list()
    if chain.keeps_batch:
        out = tf.reshape(tensor, _rows.group_shape(-1, shape[1:]))
        out.set_shape(tensor.shape[:1].concatenate(shape[1:]))
        return out
    return tf.reshape(tensor, shape)


def per_group_to(tensor, target, leading):
    """`tensor` [*leading, ...] (gradients of a body weight tensor, `leading` ints or
    scalar tensors) as [*leading, *shape(target)], `target` a body tensor of static shape."""
    return tf.reshape(tensor, _rows.group_shape(leading[0], list(leading[1:]) +
                                                target.shape.as_list())
                      if leading else target.shape.as_list())


class MappedAnalysis:
    """A batch-axis analysis in which each body tensor of `mapping` ({`ref()`: the call's
    tensor, or None for UNKNOWN}) has the layout of its call tensor."""

    def __init__(self, analysis, mapping):
        self._analysis = analysis
        self._mapping = mapping

    def value(self, tensor):
        """The lattice value of `tensor` (of its call tensor when mapped)."""
        mapped = self._mapping.get(tensor.ref(), tensor)
        return _batch_axis.UNKNOWN if mapped is None else self._analysis.value(mapped)

    def rows(self, tensor):
        """The Rows of `tensor` (of its call tensor when mapped)."""
        mapped = self._mapping.get(tensor.ref(), tensor)
        return None if mapped is None else self._analysis.rows(mapped)

    def __getattr__(self, name):   # registry, segments, verdict, ...: the analysis's
        return getattr(self._analysis, name)

"""Several batches joined along the batch axis: whose examples each tensor's rows hold.

Notation: as in `lattice`; s_1, s_2, ... the batch tensors, by their index in `batch`.

A model may feed two batches and join their results along the batch axis,
`ys = tf.concat([f(s1), f(s2)], 0)`: the rows of `ys` are the examples of s_1, then
those of s_2. The scan follows this by giving every tensor its *parts*: a tuple of
frozensets of batch indices, one per block of rows, in row order. () means no batch
tensor reaches it; (S,) that its rows are the examples of one batch, computed from the
batch tensors in S (which are fed the same examples, like features and labels);
(S_1, S_2, ...) that its rows are the examples of S_1, then those of S_2, ...
"""

from pertower._batch_axis import lattice
from pertower._batch_axis.lattice import Rows

__all__ = ["JoinedBatches"]


class JoinedBatches:
    """The parts of the tensors of one scan (see the module docstring)."""

    def __init__(self, batch_tensors=()):
        self._parts = lattice.TensorMap()   # tensor -> its parts
        self._joined = {}                   # concat op -> the parts of its output
        for j, tensor in enumerate(batch_tensors):
            self._parts[tensor] = (frozenset([j]),)

    def parts_of(self, tensor):
        """The parts of `tensor`: () when no batch tensor reaches it; (S,) with S the
        batch indices it is computed from when its rows are the examples of one batch;
        (S_1, S_2, ...) when its rows are the examples of S_1, then those of S_2, ...
        (`ys = tf.concat([f(s1), f(s2)], 0)`: ({0}, {1}))."""
        return self._parts.get(tensor, ())

    def join_along_batch(self, op, tensors, values):
        """For a concat of `tensors` along their common batch axis: the Rows of the
        output when each input holds whole examples of batches none of the other
        inputs reads (f(s1) and f(s2)); records the output's parts. None otherwise."""
        if not all(isinstance(v, Rows) for v in values):
            return None
        if len({v.lead for v in values}) != 1 or len({v.k for v in values}) != 1:
            return None
        parts, seen = [], frozenset()
        for tensor in tensors:
            own = self.parts_of(tensor)
            sources = frozenset().union(*own)
            if not own or sources & seen:
                return None
            seen |= sources
            parts.extend(own)
        self._joined[op] = tuple(parts)
        return Rows(values[0].lead, values[0].k, None)

    def output_parts(self, op, ins):
        """The parts of the outputs of `op` whose inputs have the values `ins`; None
        when it mixes rows of several joined batches with rows in another order."""
        if op in self._joined:
            return self._joined[op]
        joined, flat = set(), frozenset()
        for tensor, value in zip(op.inputs, ins):
            own = self.parts_of(tensor)
            flat = flat.union(*own)
            if isinstance(value, Rows):
                joined.add(own if len(own) > 1 else None)
        if any(p is not None for p in joined):
            if len(joined) > 1:
                return None
            return joined.pop()
        return (flat,) if flat else ()

    def record(self, tensor, parts, value):
        """Keeps the parts of an output `tensor` of value `value` (a lattice value or a
        batch-axis int): its rows keep the blocks of `parts` when it has rows (Rows or
        an int), else it is computed from all of them at once."""
        if not parts:
            return
        has_rows = isinstance(value, (Rows, int)) and not isinstance(value, bool)
        self._parts[tensor] = parts if has_rows else (frozenset().union(*parts),)

"""The verdict of the batch-axis analysis (`analysis`), and the batches `ys` joins.

The verdict is "independent" when `ys` has one row per example (Rows(0, 1, .), a row
layout) and no op couples examples; "coupled" when one does; "unproven" otherwise
(`lost_at` says where and why). The rules use `Analysis.rows` only when "independent".

Several batches: `ys = tf.concat([f(s1), f(s2)], 0)` joins the results of the batch
tensors s_1, s_2 (their index in `batch`) along the batch axis. Every tensor has *parts*
(`JoinedBatches`), one frozenset of batch indices per block of rows, in row order: ()
when no batch tensor reaches it; (S,) when its rows are the examples of one batch fed
to the batch tensors in S; (S_1, S_2, ...) for the examples of S_1, then of S_2, ...
"""

from pertower._batch_axis import lattice
from pertower._batch_axis.lattice import INDEPENDENT, SIZE, Rows

__all__ = ["Analysis", "JoinedBatches"]


class Analysis:
    """The result of `analyze`.

    Attributes:
      couplings: every `Coupling` found, in graph order.
      verdict: "independent", "coupled" or "unproven" (see the module docstring).
      lost_at: None, or (op, reason): where the proof was lost (when "unproven").
      size_data_edges: (consumer op, input index) pairs where a value computed from the
        batch's size enters the values reaching `ys` (`size_uses`).
      num_groups, registry: as given to `analyze`.
      segments: None when the rows of `ys` are the examples of the batch; else, when
        `ys` joins several batches along axis 0, one tuple of batch indices per batch,
        in the order of the rows of `ys`: ((0,), (1,)).
    """

    def __init__(self, scan, ys, num_groups, registry=None, num_batch=1):
        self.registry = registry
        self._values = scan.values
        self.region = frozenset(scan.region)   # the ops between the batch and `ys`
        self.couplings = list(scan.couplings)
        self.size_data_edges = list(dict.fromkeys(scan.size_data_edges))
        self.num_groups = num_groups
        self.lost_at = None
        self.segments = None
        ys_rows = None if ys is None else self.rows(ys)
        parts = () if ys is None else scan.batches.parts_of(ys)
        covers_batch = frozenset().union(*parts) == frozenset(range(num_batch))
        if self.couplings:
            self.verdict = "coupled"
        elif (ys_rows is not None and ys_rows.lead == 0 and ys_rows.k == 1
              and not scan.doubts and (len(parts) < 2 or covers_batch)):
            self.verdict = "independent"
            if len(parts) > 1:
                self.segments = tuple(tuple(sorted(p)) for p in parts)
        elif len(parts) > 1 and not covers_batch and not scan.doubts and not scan.losses:
            self.verdict = "unproven"
            self.lost_at = (ys.op, "`ys` joins several batches along axis 0, but not every "
                                   "batch tensor is part of one of them")
        else:
            self.verdict = "unproven"
            if scan.doubts:
                self.lost_at = next(l for l in scan.losses if l[0] is scan.doubts[0])
            elif scan.losses:
                self.lost_at = scan.losses[0]
            elif ys is not None:
                value = scan.value_of(ys)
                if value is SIZE:
                    why = "`ys` carries the batch only through its size"
                elif ys_rows is not None and ys_rows.lead != 0:
                    why = f"`ys` has the examples on axis {ys_rows.lead}, not on axis 0"
                else:
                    why = "`ys` does not hold one row per example on axis 0"
                self.lost_at = (ys.op, why)

    def value(self, tensor):
        """The lattice value of `tensor` (INDEPENDENT for tensors not from the batch)."""
        return self._values.get(tensor, INDEPENDENT)

    def rows(self, tensor):
        """The Rows of `tensor` when it has a row layout (every axis before `lead` of
        static size 1), k and E completed from its static shape; else None."""
        value = self._values.get(tensor)
        if not lattice.contiguous(value, tensor.shape):
            return None
        return lattice.complete(value, tensor.shape)


class JoinedBatches:
    """The parts of the tensors of one scan."""

    def __init__(self, batch_tensors=()):
        self._parts = lattice.TensorMap()   # tensor -> its parts
        self._joined = {}                   # concat op -> the parts of its output
        for j, tensor in enumerate(batch_tensors):
            self._parts[tensor] = (frozenset([j]),)

    def parts_of(self, tensor):
        """The parts of `tensor` (see the module docstring)."""
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
        batch-axis int): `parts` when it has rows, else all of them in one."""
        if not parts:
            return
        has_rows = isinstance(value, (Rows, int)) and not isinstance(value, bool)
        self._parts[tensor] = parts if has_rows else (frozenset().union(*parts),)

"""Argument checks and graph facts shared by every method (towers, rules, auto).

`prepare` runs the argument checks of every public function (towers, rules, auto), so
that bad input is refused the same way whichever method computes the gradients: `ys`,
`xs`, the batch tensors and B, the number of groups, that `ys` depends on the batch,
that no op couples examples (`pertower._batch_axis`), and where each weight is read.
The batch-axis analysis runs once here and is kept on the result (`Prepared.analysis`)
for the rules.
"""

import collections
import numbers

import numpy as np
import tensorflow as tf

from pertower import _checks
from pertower import _graph_walk as graph_walk
from pertower import _batch_axis
from pertower import _context


class Prepared(collections.namedtuple(
        "Prepared", ["ys", "xs", "graph", "ys_upstream", "batch", "batch_size",
                     "num_groups", "reads", "analysis", "groups_argument",
                     "batch_axes", "segments", "batch_downstream"])):
    """Checked inputs.

    Fields:
      ys, xs (list), graph: as given, checked; a Keras 3 variable in xs is replaced by
        the tf.Variable holding its value.
      ys_upstream: the ops `ys` depends on.
      batch: the batch tensors (found or checked).
      batch_size: B, or None when the batch axis is not static and no batch_size was
        given (allowed only for method="rules").
      num_groups: M for microbatches, or None for one group per example.
      reads: one `graph_walk.WeightReads` per entry of xs.
      analysis: the `pertower._batch_axis.Analysis` of the ops between the batch and
        `ys` (its `registry` attribute: the rule registry it was run with).
      groups_argument: the public name of the number of groups, for messages.
      batch_axes: per batch tensor, the axis that carries the batch (0 unless
        `batch_axis` said otherwise, e.g. 1 for time-major [T, B, d] inputs). `ys`
        always carries the batch on axis 0.
      segments: None when every batch tensor is fed the same B examples; when `ys`
        joins several batches along axis 0 (`tf.concat([f(s1), f(s2)], 0)`), one
        (batch indices, B_s) pair per batch in the order of the rows of `ys`, e.g.
        (((0,), 2), ((1,), 3)); then batch_size = B = B_1 + B_2 + ... .
      batch_downstream: the ops between the batch and `ys` (those of ys_upstream that
        depend on a batch tensor), walked once here for every later reader.
    """

    def restricted(self, indices):
        """The same checked inputs for xs[k], k in `indices`, only (the weights one
        method leaves to another)."""
        return self._replace(xs=[self.xs[k] for k in indices],
                             reads=[self.reads[k] for k in indices])


def prepare(ys, xs, batch, num_groups, batch_size, groups_argument,
            batch_size_required, registry=None, refuse_couplings=True, batch_axis=None):
    """Checks the arguments of a public gradient function; returns a `Prepared`.

    Args:
      ys, xs, batch, batch_size: as given to the public function.
      num_groups: M (microbatches or towers), or None.
      groups_argument: the name of the argument that gave `num_groups`.
      batch_size_required: whether a None batch axis needs `batch_size` (the towers'
        contract); when False and neither is known, B is left to run time.
      registry: the `pertower.rules.RuleRegistry` whose rules may declare the row
        layout of their ops (`Rule.output_layouts`) to the analysis, or None.
      batch_axis: None (axis 0 of every batch tensor), an int (the batch axis of every
        batch tensor) or a list parallel to the batch tensors.
    """
    _checks.require_graph_mode()
    ys = _checks.require_graph_tensor(ys, "ys")
    graph = ys.graph
    if graph.finalized:
        raise RuntimeError(
            f"pertower.{_context.name()}: the graph of `ys` is finalized (a "
            "MonitoredSession or graph.finalize() froze it). Build the towers before "
            "the graph is finalized.")
    if ys.shape.rank == 0:
        raise ValueError(
            f"pertower.{_context.name()}: `ys` ({ys.name}) is a scalar, but it needs a batch "
            "axis on axis 0 with one value per example. Pass the unreduced per-example "
            "values (for example a loss built with reduction=NONE, before tf.reduce_mean).")
    if not ys.dtype.is_floating:
        raise TypeError(
            f"pertower.{_context.name()}: `ys` ({ys.name}) must be a floating-point tensor, "
            f"but has dtype {ys.dtype.name}.")
    xs = _checks.weight_list(xs, "xs")  # Keras 3 variables: their tf.Variable
    if not xs:
        raise ValueError(f"pertower.{_context.name()}: `xs` is empty; pass at least one weight.")
    with graph.as_default():
        ys_upstream = graph_walk.upstream_ops([ys])
        found = batch is None
        batch = _batch_tensors(ys, batch, ys_upstream, graph)
        axes = batch_axes(batch_axis, batch)
        static_known = any(_checks.static_batch_size(b, a) is not None
                           for b, a in zip(batch, axes))
        M = None if num_groups is None else _checks.positive_int(
            num_groups, groups_argument)
        batch_downstream = graph_walk.downstream_ops(batch, ys_upstream)
        if ys.op not in batch_downstream and all(ys is not b for b in batch):
            raise ValueError(
                f"pertower.{_context.name()}: `ys` ({ys.name}) does not depend on the batch "
                f"({', '.join(t.name for t in batch)}); pass the per-example values "
                "computed from the batch.")
        analysis = _batch_axis.analyze(ys, batch, ys_upstream,
                                       _size_hint(batch, axes, batch_size), M, registry,
                                       batch_axes=axes)
        segments = None
        if analysis.segments is not None:
            # `ys` joins several batches along axis 0: B = B_1 + B_2 + ...
            B, segments = _segment_sizes(ys, batch, axes, analysis.segments, batch_size,
                                         M, groups_argument)
        else:
            batch_size = _one_batch_size(batch_size, batch)
            if batch_size_required or static_known or batch_size is not None:
                B = _batch_size(ys, batch, axes, batch_size)
            else:
                B = None
            if M is not None and B is not None and B % M:
                raise ValueError(
                    f"pertower.{_context.name()}: `{groups_argument}` ({M}) must divide the "
                    f"batch size ({B}); choose a divisor of {B}, or feed a batch whose size "
                    f"is a multiple of {M}.")
        # refuse ops that couple examples (with one group holding the whole batch,
        # coupling changes nothing); pertower.explain records them instead
        if refuse_couplings and analysis.couplings and (B if M is None else M) != 1:
            message = analysis.couplings[0].message()
            if found:
                message += _side_input_hint(analysis.couplings[0].op, batch)
            raise ValueError(message)
        reads = [graph_walk.weight_reads(x, k, ys_upstream, batch)
                 for k, x in enumerate(xs)]
    return Prepared(ys, xs, graph, ys_upstream, batch, B, M, reads, analysis,
                    groups_argument, tuple(axes), segments, frozenset(batch_downstream))


def batch_axes(batch_axis, batch):
    """The batch axis of each batch tensor (non-negative ints), from `batch_axis`:
    None (0 for every tensor), an int (for every tensor), or a list parallel to
    `batch`. Refuses a non-int, a list of another length, or an axis out of range."""
    if batch_axis is None:
        return [0] * len(batch)
    if isinstance(batch_axis, (list, tuple)):
        if len(batch_axis) != len(batch):
            raise ValueError(
                f"pertower.{_context.name()}: `batch_axis` has {len(batch_axis)} entries, "
                f"but there are {len(batch)} batch tensors "
                f"({', '.join(b.name for b in batch)}); give one axis per batch tensor, "
                "in the order of `batch`, or one int for all of them.")
        given, as_list = list(batch_axis), True
    else:
        given, as_list = [batch_axis] * len(batch), False
    axes = []
    for j, (b, axis) in enumerate(zip(batch, given)):
        what = f"batch_axis[{j}]" if as_list else "batch_axis"
        if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
            raise TypeError(
                f"pertower.{_context.name()}: `{what}` must be an int (the axis of the "
                f"batch tensor that carries the batch), but received {axis!r}.")
        axis = int(axis)
        rank = b.shape.rank
        if rank is None:
            if axis != 0:
                raise ValueError(
                    f"pertower.{_context.name()}: `{what}` is {axis}, but the batch tensor "
                    f"{b.name} has an unknown rank; give it a static rank (set_shape) or "
                    "pass its batch on axis 0.")
            axes.append(0)
            continue
        if not -rank <= axis < rank:
            hint = ("; with several batch tensors of different ranks pass a list "
                    "parallel to `batch`" if not as_list and len(batch) > 1 else "")
            raise ValueError(
                f"pertower.{_context.name()}: `{what}` is {axis}, out of range for the "
                f"batch tensor {b.name} of shape {b.shape} (rank {rank}){hint}.")
        axes.append(axis % rank)
    return axes


def _size_hint(batch, axes, batch_size):
    """B for the analysis (a leading static 1 axis is then never the batch axis): the
    static batch size when the batch tensors share one, else an int `batch_size`."""
    static = {_checks.static_batch_size(b, a) for b, a in zip(batch, axes)} - {None}
    if len(static) == 1:
        return static.pop()
    if isinstance(batch_size, numbers.Integral) and not isinstance(batch_size, bool):
        return int(batch_size)
    return None


def _one_batch_size(batch_size, batch):
    """`batch_size` as given, or its one value when it is a list of equal sizes; a list
    of different sizes is refused (it is for `ys` joining several batches)."""
    if not isinstance(batch_size, (list, tuple)):
        return batch_size
    if len(batch_size) != len(batch) or len(set(map(repr, batch_size))) != 1:
        raise ValueError(
            f"pertower.{_context.name()}: `batch_size` is the list {list(batch_size)!r}. A "
            "list gives one size per batch tensor (parallel to `batch`, here "
            f"{', '.join(b.name for b in batch)}) when `ys` joins several batches along "
            "axis 0 (tf.concat([f(s1), f(s2)], 0)); but the rows of `ys` are the examples "
            "of one batch fed to every batch tensor, so pass one int, B.")
    return batch_size[0]


def _segment_sizes(ys, batch, axes, segments, batch_size, M, groups_argument):
    """(B, ((indices, B_s), ...)) for `ys` joining the batches `segments` (tuples of
    batch indices) along axis 0; B_s from the static shapes or `batch_size` (an int
    for every batch tensor, or a list parallel to `batch`)."""
    names = ", ".join(b.name for b in batch)
    if isinstance(batch_size, (list, tuple)):
        if len(batch_size) != len(batch):
            raise ValueError(
                f"pertower.{_context.name()}: `batch_size` has {len(batch_size)} entries, "
                f"but there are {len(batch)} batch tensors ({names}); give one size per "
                "batch tensor, in the order of `batch`.")
        given = [_checks.positive_int(v, f"batch_size[{j}]")
                 for j, v in enumerate(batch_size)]
    elif batch_size is None:
        given = [None] * len(batch)
    else:
        given = [_checks.positive_int(batch_size, "batch_size")] * len(batch)
    sizes = []
    for j, (b, axis) in enumerate(zip(batch, axes)):
        static = _checks.static_batch_size(b, axis)
        if static is not None and given[j] is not None and static != given[j]:
            raise ValueError(
                f"pertower.{_context.name()}: `batch_size` gives {given[j]} examples for "
                f"{b.name}, but it has a static batch size of {static} on axis {axis}.")
        if static is None and given[j] is None:
            raise ValueError(
                f"pertower.{_context.name()}: `ys` ({ys.name}) joins several batches along "
                f"axis 0 ({_listing(batch, segments)}) and the batch axis of {b.name} "
                f"({b.shape}) is not static, so `batch_size` is needed: pass one size per "
                f"batch tensor, batch_size=[B_1, B_2, ...] in the order of `batch` ({names}), "
                "or one int when they are all equal. Each batch is computed example by "
                "example, for a fixed number of examples.")
        sizes.append(static if static is not None else given[j])
    pairs = []
    for segment in segments:
        own = {sizes[j] for j in segment}
        if len(own) > 1:
            listing = ", ".join(f"{batch[j].name} has {sizes[j]}" for j in segment)
            raise ValueError(
                f"pertower.{_context.name()}: the batch tensors {listing} examples, but `ys` "
                "computes each of its rows from all of them together, so they must be "
                "fed the same number of examples.")
        pairs.append((tuple(segment), sizes[segment[0]]))
    B = sum(size for _, size in pairs)
    _check_ys_rows(ys, B, f"the batches it joins have {B} examples together "
                          f"({_listing(batch, pairs, sizes=True)})")
    if M is not None and (B % M or any(size % (B // M) for _, size in pairs)):
        valid = [m for m in range(1, B + 1)
                 if B % m == 0 and all(size % (B // m) == 0 for _, size in pairs)]
        raise ValueError(
            f"pertower.{_context.name()}: `{groups_argument}` ({M}) does not split the rows "
            f"of `ys` ({ys.name}) at the boundaries of the batches it joins along axis 0 "
            f"({_listing(batch, pairs, sizes=True)}, {B} rows together): each microbatch "
            "must hold examples of one batch only, B/M of them. Valid values here: "
            f"{', '.join(map(str, valid))} (with batches of equal sizes, the number of "
            "batches gives one microbatch per batch).")
    return B, tuple(pairs)


def _listing(batch, segments, sizes=False):
    """'s1:0 then s2:0' (with sizes: 's1:0 with 2 examples, then s2:0 with 3')."""
    words = []
    for segment in segments:
        indices, size = segment if sizes else (segment, None)
        text = " and ".join(batch[j].name for j in indices)
        words.append(text + (f" with {size} examples" if sizes else ""))
    return ", then ".join(words)


def _side_input_hint(op, batch):
    """When the batch tensors were found, not given: the ones the coupling op reads
    along their batch axis may be side inputs (class weights gathered by label), not
    examples; say how to leave them out."""
    read = op.inputs[0] if op.inputs else None
    suspects = [b for b in batch if b is read]
    others = [b for b in batch if b is not read]
    if not suspects or not others:
        return ""
    return (f" The batch tensors were found automatically ({', '.join(b.name for b in batch)}); "
            f"if {', '.join(b.name for b in suspects)} is not per-example data but a side "
            "input (class weights indexed by label, a lookup table fed with the batch), "
            f"pass batch=[{', '.join(b.name for b in others)}] (the tensors that carry the "
            "examples), and it is read whole by every example.")


def _rows_hint(ys, rows, B):
    """Likely causes of a `ys` whose axis 0 is not the batch."""
    hints = []
    if ys.shape.rank is not None and ys.shape.rank >= 2 and any(
            tf.compat.dimension_value(d) in (B, None) for d in ys.shape[1:]):
        hints.append("is it transposed (the batch on another axis)? Transpose it so the "
                     "batch comes first (ys keeps the batch on axis 0 even with "
                     "batch_axis=)")
    if rows == 1:
        hints.append("was it reduced over the batch (tf.reduce_mean(..., axis=0, "
                     "keepdims=True), or a loss with reduction SUM/MEAN)? Pass the "
                     "unreduced per-example values")
    return (" " + " ".join(h[0].upper() + h[1:] + "." for h in hints)) if hints else ""


def _batch_tensors(ys, batch, ys_upstream, graph):
    if batch is None:
        return graph_walk.find_batch_tensors(ys, ys_upstream)
    batch = _checks.as_list(batch)
    if not batch:
        raise ValueError(f"pertower.{_context.name()}: `batch` is empty; pass the batch "
                         "tensor(s), or None to find them.")
    for j, b in enumerate(batch):
        _checks.require_graph_tensor(b, f"batch[{j}]")
        if b.graph is not graph:
            raise ValueError(f"pertower.{_context.name()}: `batch[{j}]` ({b.name}) is in "
                             "another graph than `ys`.")
        if b.shape.rank == 0:
            raise ValueError(f"pertower.{_context.name()}: `batch[{j}]` ({b.name}) is a "
                             "scalar; batch tensors need the batch on axis 0.")
    return batch


def _batch_size(ys, batch, axes, batch_size):
    """B: the static batch size of the batch tensors (on their batch axes), or
    `batch_size`."""
    static = {}
    for b, axis in zip(batch, axes):
        size = _checks.static_batch_size(b, axis)
        if size is not None:
            static.setdefault(size, (b, axis))
    if len(static) > 1:
        listing = ", ".join(f"{b.name} has {n}" + (f" on axis {axis}" if axis else "")
                            for n, (b, axis) in static.items())
        raise ValueError(
            f"pertower.{_context.name()}: the batch tensors have different static batch "
            f"sizes ({listing}); they must share the batch axis. For time-major inputs "
            "([T, B, ...]) pass batch_axis=1 (or a list with one axis per batch tensor).")
    if batch_size is not None:
        batch_size = _checks.positive_int(batch_size, "batch_size")
    if static:
        (B, (b, axis)), = static.items()
        if batch_size is not None and batch_size != B:
            hint = ("" if any(a != 0 for a in axes) else
                    " If its batch is on another axis (time-major [T, B, ...]), pass "
                    "batch_axis=1 (or the axis that carries the batch).")
            raise ValueError(f"pertower.{_context.name()}: `batch_size` is {batch_size}, but "
                             f"the batch tensor {b.name} has a static batch size of {B} "
                             f"on axis {axis}.{hint}")
    elif batch_size is None:
        names = ", ".join(f"{b.name} {b.shape}" for b in batch)
        raise ValueError(
            f"pertower.{_context.name()}: the batch axis is not static ({names}), so "
            "`batch_size` is needed: pass batch_size=B, the number of examples you will "
            "feed. Towers are built for a fixed number of examples.")
    else:
        B = batch_size
    _check_ys_rows(ys, B, f"the batch has {B} examples")
    return B


def _check_ys_rows(ys, B, batch_words):
    """Raises when the static axis 0 of `ys` is not the B rows of the batch."""
    ys_rows = _checks.static_batch_size(ys)
    if ys_rows is not None and ys_rows != B:
        raise ValueError(
            f"pertower.{_context.name()}: `ys` ({ys.name}, shape {ys.shape}) has {ys_rows} "
            f"row{'' if ys_rows == 1 else 's'} on axis 0, but {batch_words}; `ys` needs "
            f"one row per example on axis 0.{_rows_hint(ys, ys_rows, B)}")

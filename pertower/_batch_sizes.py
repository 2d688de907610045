"""The batch's sizes: each batch tensor's batch axis, B, and the sizes B_s of the batches
`ys` joins along axis 0 (B = B_1 + B_2 + ...), from the static shapes and `batch_size`.
"""

import numbers

import numpy as np
import tensorflow as tf

from pertower import _checks
from pertower import _context
from pertower import _graph_walk as graph_walk

__all__ = ["batch_axes", "size_hint", "one_batch_size", "concat_segments", "segment_sizes",
           "batch_size_of", "check_ys_rows", "listing"]

# ops between a concat and `ys` that keep its rows in place (one batch-fed input)
_ROW_KEEPING = ("Identity", "Neg", "Square", "Sqrt", "Exp", "Log", "Abs", "Cast", "Mul",
                "RealDiv", "AddV2", "Sub")


def batch_axes(batch_axis, batch):
    """The batch axis of each batch tensor (non-negative ints) from `batch_axis`: None
    (0), an int (for every tensor), or a list parallel to `batch`."""
    if batch_axis is None:
        return [0] * len(batch)
    if isinstance(batch_axis, (list, tuple)):
        if len(batch_axis) != len(batch):
            raise _context.error(
                ValueError, f"`batch_axis` has {len(batch_axis)} entries, "
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
            raise _context.error(
                TypeError, f"`{what}` must be an int (the axis of the "
                f"batch tensor that carries the batch), but received {axis!r}.")
        axis = int(axis)
        rank = b.shape.rank
        if rank is None:
            if axis != 0:
                raise _context.error(
                    ValueError, f"`{what}` is {axis}, but the batch tensor "
                    f"{b.name} has an unknown rank; give it a static rank (set_shape) or "
                    "pass its batch on axis 0.")
            axes.append(0)
            continue
        if not -rank <= axis < rank:
            hint = ("; with several batch tensors of different ranks pass a list "
                    "parallel to `batch`" if not as_list and len(batch) > 1 else "")
            raise _context.error(
                ValueError, f"`{what}` is {axis}, out of range for the "
                f"batch tensor {b.name} of shape {b.shape} (rank {rank}){hint}.")
        axes.append(axis % rank)
    return axes


def size_hint(static_sizes, batch_size):
    """B for the analysis: the static batch size the batch tensors share, else an int
    `batch_size`."""
    static = set(static_sizes) - {None}
    if len(static) == 1:
        return static.pop()
    if isinstance(batch_size, numbers.Integral) and not isinstance(batch_size, bool):
        return int(batch_size)
    return None


def one_batch_size(batch_size, batch, lost_at=None):
    """`batch_size`, or the one value of a list of equal sizes; other lists (for `ys`
    joining several batches) are refused, saying why with the analysis' `lost_at`."""
    if not isinstance(batch_size, (list, tuple)):
        return batch_size
    if len(batch_size) != len(batch) or len(set(map(repr, batch_size))) != 1:
        if lost_at is None:
            found = ("but the rows of `ys` are the examples of one batch fed to every "
                     "batch tensor, so pass one int, B.")
        else:
            op, why = lost_at
            found = ("but `ys` is not a concat along axis 0 of values read from disjoint "
                     "batch tensors, and the analysis could not trace its rows further "
                     f"(the proof was lost at {op.name!r} ({op.type}): {why}). Join the "
                     "batches with tf.concat(..., 0) as the last op before `ys`, or feed "
                     "every batch tensor the same examples and pass one int, B.")
        raise _context.error(
            ValueError, f"`batch_size` is the list {list(batch_size)!r}. A "
            "list gives one size per batch tensor (parallel to `batch`, here "
            f"{', '.join(b.name for b in batch)}) when `ys` joins several batches along "
            f"axis 0 (tf.concat([f(s1), f(s2)], 0)); {found}")
    return batch_size[0]


def concat_segments(ys, batch):
    """The batches `ys` joins, read from the graph alone (when the analysis lost its
    proof before the join): `ys` is, up to row-keeping ops, a concat along axis 0 whose
    inputs read disjoint sets of batch tensors, together all of them. One tuple of batch
    indices per input, in row order, or None (the run-time check checks the rest)."""
    def reads(tensor):
        upstream = graph_walk.upstream_ops([tensor])
        return frozenset(j for j, b in enumerate(batch)
                         if b is tensor or b.op in upstream)

    tensor = ys
    while tensor.op.type in _ROW_KEEPING:
        fed = [t for t in tensor.op.inputs if reads(t)]
        if len(fed) != 1:
            return None
        tensor = fed[0]
    if tensor.op.type not in ("ConcatV2", "Concat"):
        return None
    inputs = list(tensor.op.inputs)
    axis, parts = (inputs.pop() if tensor.op.type == "ConcatV2" else inputs.pop(0)), []
    if tf.get_static_value(axis) not in (0,):
        return None
    for part in inputs:
        own = reads(part)
        if not own or any(own & other for other in parts):
            return None
        parts.append(own)
    if len(parts) < 2 or frozenset().union(*parts) != frozenset(range(len(batch))):
        return None
    return tuple(tuple(sorted(p)) for p in parts)


def segment_sizes(ys, batch, axes, static_sizes, ys_rows, segments, batch_size, M,
                  groups_argument):
    """(B, ((indices, B_s), ...)) for `ys` joining the batches `segments` along axis 0;
    B_s from the static shapes or `batch_size` (an int, or a list parallel to `batch`)."""
    names = ", ".join(b.name for b in batch)
    if isinstance(batch_size, (list, tuple)):
        if len(batch_size) != len(batch):
            raise _context.error(
                ValueError, f"`batch_size` has {len(batch_size)} entries, "
                f"but there are {len(batch)} batch tensors ({names}); give one size per "
                "batch tensor, in the order of `batch`.")
        given = [_checks.positive_int(v, f"batch_size[{j}]")
                 for j, v in enumerate(batch_size)]
    elif batch_size is None:
        given = [None] * len(batch)
    else:
        given = [_checks.positive_int(batch_size, "batch_size")] * len(batch)
    sizes = []
    for j, (b, axis, static) in enumerate(zip(batch, axes, static_sizes)):
        if static is not None and given[j] is not None and static != given[j]:
            raise _context.error(
                ValueError, f"`batch_size` gives {given[j]} examples for "
                f"{b.name}, but it has a static batch size of {static} on axis {axis}.")
        if static is None and given[j] is None:
            raise _context.error(
                ValueError, f"`ys` ({ys.name}) joins several batches along "
                f"axis 0 ({listing(batch, segments)}) and the batch axis of {b.name} "
                f"({b.shape}) is not static, so `batch_size` is needed: pass one size per "
                f"batch tensor, batch_size=[B_1, B_2, ...] in the order of `batch` ({names}), "
                "or one int when they are all equal. Each batch is computed example by "
                "example, for a fixed number of examples.")
        sizes.append(static if static is not None else given[j])
    pairs = []
    for segment in segments:
        own = {sizes[j] for j in segment}
        if len(own) > 1:
            counts = ", ".join(f"{batch[j].name} has {sizes[j]}" for j in segment)
            raise _context.error(
                ValueError, f"the batch tensors {counts} examples, but `ys` "
                "computes each of its rows from all of them together, so they must be "
                "fed the same number of examples.")
        pairs.append((tuple(segment), sizes[segment[0]]))
    B = sum(size for _, size in pairs)
    joined = listing(batch, pairs, " with {} examples")
    check_ys_rows(ys, ys_rows, B, f"the batches it joins have {B} examples together "
                                  f"({joined})")
    if M is not None and (B % M or any(size % (B // M) for _, size in pairs)):
        valid = [m for m in range(1, B + 1)
                 if B % m == 0 and all(size % (B // m) == 0 for _, size in pairs)]
        raise _context.error(
            ValueError, f"`{groups_argument}` ({M}) does not split the rows "
            f"of `ys` ({ys.name}) at the boundaries of the batches it joins along axis 0 "
            f"({joined}, {B} rows together): each microbatch "
            "must hold examples of one batch only, B/M of them. Valid values here: "
            f"{', '.join(map(str, valid))} (with batches of equal sizes, the number of "
            "batches gives one microbatch per batch).")
    return B, tuple(pairs)


def listing(batch, segments, sizes=None):
    """The batches `ys` joins, in row order: 's1:0, then s2:0 and t2:0' for `segments`
    of batch indices; with `sizes` (e.g. ' with {} examples'), (indices, B_s) pairs,
    each followed by sizes.format(B_s)."""
    return ", then ".join(
        " and ".join(batch[j].name for j in (segment[0] if sizes else segment))
        + (sizes.format(segment[1]) if sizes else "") for segment in segments)


def batch_size_of(ys, batch, axes, static_sizes, ys_rows, batch_size):
    """B: the static batch size of the batch tensors, or `batch_size`."""
    static = {}
    for b, axis, size in zip(batch, axes, static_sizes):
        if size is not None:
            static.setdefault(size, (b, axis))
    if len(static) > 1:
        counts = ", ".join(f"{b.name} has {n}" + (f" on axis {axis}" if axis else "")
                           for n, (b, axis) in static.items())
        raise _context.error(
            ValueError, f"the batch tensors have different static batch "
            f"sizes ({counts}); they must share the batch axis. For time-major inputs "
            "([T, B, ...]) pass batch_axis=1 (or a list with one axis per batch tensor).")
    if batch_size is not None:
        batch_size = _checks.positive_int(batch_size, "batch_size")
    if static:
        (B, (b, axis)), = static.items()
        if batch_size is not None and batch_size != B:
            hint = ("" if any(a != 0 for a in axes) else
                    " If its batch is on another axis (time-major [T, B, ...]), pass "
                    "batch_axis=1 (or the axis that carries the batch).")
            raise _context.error(ValueError,f"`batch_size` is {batch_size}, but "
                             f"the batch tensor {b.name} has a static batch size of {B} "
                             f"on axis {axis}.{hint}")
    elif batch_size is None:
        names = ", ".join(f"{b.name} {b.shape}" for b in batch)
        raise _context.error(
            ValueError, f"the batch axis is not static ({names}), so "
            "`batch_size` is needed: pass batch_size=B, the number of examples you will "
            "feed. Towers are built for a fixed number of examples.")
    else:
        B = batch_size
    check_ys_rows(ys, ys_rows, B, f"the batch has {B} examples")
    return B


def check_ys_rows(ys, ys_rows, B, batch_words):
    """Raises when the static axis 0 of `ys` is not B rows, with the likely causes."""
    if ys_rows is None or ys_rows == B:
        return
    hints = []
    if ys.shape.rank is not None and ys.shape.rank >= 2 and any(
            tf.compat.dimension_value(d) in (B, None) for d in ys.shape[1:]):
        hints.append("is it transposed (the batch on another axis)? Transpose it so the "
                     "batch comes first (ys keeps the batch on axis 0 even with "
                     "batch_axis=)")
    if ys_rows == 1:
        hints.append("was it reduced over the batch (tf.reduce_mean(..., axis=0, "
                     "keepdims=True), or a loss with reduction SUM/MEAN)? Pass the "
                     "unreduced per-example values")
    hint = (" " + " ".join(h[0].upper() + h[1:] + "." for h in hints)) if hints else ""
    raise _context.error(
        ValueError, f"`ys` ({ys.name}, shape {ys.shape}) has {ys_rows} "
        f"row{'' if ys_rows == 1 else 's'} on axis 0, but {batch_words}; `ys` needs "
        f"one row per example on axis 0.{hint}")

"""Transfer functions of ops that pick entries by position or index: slices, strided
slices, gathers, one-hot encodings (the contract: `transfer_layout`). Picking, ordering
or shifting examples along the batch axis couples them.
"""

import tensorflow as tf

from pertower._batch_axis import lattice
from pertower._batch_axis import size_uses
from pertower._batch_axis import static
from pertower._batch_axis.lattice import SIZE, UNKNOWN, Rows
from pertower._batch_axis.transfer_layout import (batch_axis_words, normalize,
                                                  only_data_input, require_rank)

__all__ = ["TRANSFERS"]

_INT32_MAX = 2 ** 31 - 1


def _bit(mask, i):
    return bool(mask & (1 << i))


def slice_(scan, op, ins):
    value = only_data_input(op, ins, 0)
    begin, size = static.static_value(op.inputs[1]), static.static_value(op.inputs[2])
    if begin is None or size is None:
        raise lattice.Lost("its bounds are not static")
    a = value.lead
    dim = tf.compat.dimension_value(op.inputs[0].shape[a])
    b, s = int(begin[a]), int(size[a])
    if b == 0 and (s == -1 or (dim is not None and s == dim)):
        return [a]
    raise lattice.Coupled(
        f"slices along {batch_axis_words(op.inputs[0], a)} (begin {b}, size {s}), "
        "selecting examples by their position in the batch", lattice.POSITION_ADVICE)


def strided_slice(scan, op, ins):
    value = only_data_input(op, ins, 0)
    x = op.inputs[0]
    rank = require_rank(x)
    begin, end, strides = (static.static_value(t) for t in op.inputs[1:4])
    if begin is None or end is None or strides is None:
        raise lattice.Lost("its bounds are not static")
    masks = {name: op.get_attr(name) for name in
             ("begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask", "shrink_axis_mask")}
    a = value.lead
    dim = tf.compat.dimension_value(x.shape[a])
    in_dim, out_dim, n = 0, 0, len(begin)
    for i in range(n):
        if _bit(masks["ellipsis_mask"], i):
            remaining = sum(1 for j in range(i + 1, n) if not _bit(masks["new_axis_mask"], j))
            stop = rank - remaining
            if in_dim <= a < stop:
                return [out_dim + a - in_dim]
            out_dim += stop - in_dim
            in_dim = stop
        elif _bit(masks["new_axis_mask"], i):
            out_dim += 1
        else:
            shrink = _bit(masks["shrink_axis_mask"], i)
            if in_dim == a:
                stride = int(strides[i])
                starts_at_first = _bit(masks["begin_mask"], i) or int(begin[i]) == 0
                ends_at_last = _bit(masks["end_mask"], i) or int(end[i]) >= _INT32_MAX or (
                    dim is not None and int(end[i]) >= dim)
                if not shrink and stride == 1 and starts_at_first and ends_at_last:
                    return [out_dim]
                what = ("takes one example" if shrink else
                        "reverses the order of the examples" if stride == -1 and
                        _bit(masks["begin_mask"], i) and _bit(masks["end_mask"], i)
                        else "selects examples by their position in the batch")
                raise lattice.Coupled(
                    f"indexes {batch_axis_words(x, a)} (begin {int(begin[i])}, "
                    f"end {int(end[i])}, stride {stride}): it {what}", lattice.POSITION_ADVICE)
            if not shrink:
                out_dim += 1
            in_dim += 1
    return [out_dim + a - in_dim]


def gather(scan, op, ins):
    params, indices = op.inputs[0], op.inputs[1]
    p_value, i_value = ins[0], ins[1]
    if UNKNOWN in (p_value, i_value):
        raise lattice.Lost("its input's batch axis was already lost")
    if op.type == "GatherV2":
        if lattice.depends_on_values(ins[2]):
            raise lattice.Lost("its axis depends on the batch's values")
        along = static.static_value(op.inputs[2])
        batch_dims = op.get_attr("batch_dims")
    else:
        along = 0
        batch_dims = op.get_attr("batch_dims") if op.type == "ResourceGather" else 0
    p_rank = None if op.type == "ResourceGather" else params.shape.rank
    i_rank = require_rank(indices)
    if along is None:
        raise lattice.Lost("its axis is not static")
    if op.type != "ResourceGather":
        if p_rank is None:
            raise lattice.Lost("the rank of its params is not static")
        along = normalize(along, p_rank)
    batch_dims = normalize(batch_dims, i_rank) if batch_dims < 0 else batch_dims
    if isinstance(p_value, Rows):
        a = p_value.lead
        if a < batch_dims:
            if not isinstance(i_value, Rows) or i_value.lead == a:
                return [a]
            raise lattice.Lost("params and indices have different batch axes")
        if a == along:
            raise lattice.Coupled(
                f"gathers along {batch_axis_words(params, a)} with the indices "
                f"{lattice.describe(indices)}, picking examples by index",
                lattice.POSITION_ADVICE)
        if isinstance(i_value, Rows):
            raise lattice.Lost("both params and indices carry the batch")
        return [a if a < along else a + i_rank - 1 - batch_dims]
    if not isinstance(i_value, Rows):
        return [SIZE]
    q = i_value.lead
    if q < batch_dims:
        raise lattice.Lost("the indices' batch axis is a batch_dims axis")
    return [along + q - batch_dims]


def gather_nd(scan, op, ins):
    """Rows gathered from a weight by per-example indices keep the indices' batch axis;
    from a tensor that carries the batch (axis 0), only by the row index
    tf.stack([tf.range(n), ...], 1) (`size_uses.is_row_index`): any other index picks
    examples by index, a coupling (a fed permutation, fixed positions)."""
    if UNKNOWN in ins[:2]:
        raise lattice.Lost("its input's batch axis was already lost")
    params, indices = op.inputs[0], op.inputs[1]
    if not lattice.depends_on_values(ins[0]):
        if not isinstance(ins[1], Rows):
            raise lattice.Lost("it gathers from a tensor that carries the batch")
        rank = require_rank(indices)
        if ins[1].lead >= rank - 1:
            raise lattice.Lost("the indices' batch axis is their index axis")
        return [ins[1].lead]
    if not isinstance(ins[0], Rows) or ins[0].lead != 0:
        raise lattice.Lost("it gathers from a tensor whose batch axis is not its first")
    column = _first_column(indices)
    if (column is not None and (not isinstance(ins[1], Rows) or ins[1].lead == 0)
            and size_uses.is_row_index(scan.shape_value, column, ins[0])):
        return [0]   # [B, ...] by [[i, c_i], ...]: row i reads example i only
    raise lattice.Coupled(
        f"gathers along {batch_axis_words(params, 0)} with the indices "
        f"{lattice.describe(indices)}, whose first column is not tf.range over the "
        "batch's examples: it picks examples by index", lattice.POSITION_ADVICE)


def _first_column(indices):
    """Column 0 of the [B, m] `indices`, c0 or its [B, 1] column, when they are built as
    tf.stack([c0, ...], 1) or tf.concat([c0[:, None], ...], 1), or are that column;
    else None."""
    if indices.shape.rank != 2:
        return None
    op = indices.op
    if op.type == "Pack" and op.get_attr("axis") in (1, -1):
        return op.inputs[0]
    if op.type == "ConcatV2":
        axis = static.static_value(op.inputs[-1])
        return op.inputs[0] if axis is not None and int(axis) in (1, -1) else None
    return indices


def one_hot(scan, op, ins):
    value = only_data_input(op, ins, 0)
    rank = require_rank(op.inputs[0])
    along = op.get_attr("axis")
    along = rank if along == -1 else along
    return [value.lead if value.lead < along else value.lead + 1]


TRANSFERS = {
    "Slice": slice_, "StridedSlice": strided_slice,
    "Gather": gather, "GatherV2": gather, "ResourceGather": gather,
    "GatherNd": gather_nd, "ResourceGatherNd": gather_nd, "OneHot": one_hot,
}

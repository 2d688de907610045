"""Transfer functions of ops that move, copy or combine entries without mixing them:
elementwise ops with broadcasting, reshapes, transposes, concatenation, stacking, tiling
and padding, and values shaped by the batch (fills, random draws).

The contract of every transfer function (here and in the other `transfer_*` modules and
`functions`): `f(scan, op, ins)` gets the lattice values of op's inputs and returns one
value per output: a lattice value, or an int (the batch axis of that output, with the
inputs' common k). It raises `lattice.Coupled` when the op couples examples (reduces,
contracts, picks, orders or shifts them along the batch axis) and `lattice.Lost` when
it cannot follow the batch axis (with why).
"""

import numpy as np
import tensorflow as tf

from pertower import _op_types as op_types
from pertower._batch_axis import lattice
from pertower._batch_axis import size_uses
from pertower._batch_axis import static
from pertower._batch_axis.lattice import INDEPENDENT, SIZE, UNKNOWN, Rows

__all__ = ["TRANSFERS", "normalize", "batch_axis_words", "only_data_input", "require_rank",
           "outputs_all"]


def normalize(axis, rank):
    axis = int(axis)
    return axis + rank if axis < 0 else axis


def batch_axis_words(tensor, axis):
    return f"axis {axis}, the batch axis of its input {lattice.describe(tensor)}"


def only_data_input(op, ins, data_index):
    """The value of input `data_index`; raises Lost when another input carries the
    batch's values (e.g. an axis computed from the data)."""
    if any(lattice.depends_on_values(v) for j, v in enumerate(ins) if j != data_index):
        raise lattice.Lost("an axis, shape or index argument depends on the batch's values")
    value = ins[data_index]
    if value is UNKNOWN:
        raise lattice.Lost("its input's batch axis was already lost")
    return value


def outputs_all(op, value):
    """`value` for every output of `op`."""
    return [value] * len(op.outputs)


def require_rank(tensor):
    """The static rank of `tensor`; raises Lost when it is not static."""
    rank = tensor.shape.rank
    if rank is None:
        raise lattice.Lost(f"the rank of {lattice.describe(tensor)} is not static")
    return rank


def elementwise(scan, op, ins):
    """Broadcasting aligns shapes on the right: the inputs carrying the batch must put
    their batch axes on one output axis (two pair every example with every other)."""
    out = op.outputs[0]
    out_rank = require_rank(out)
    if op.type == "BroadcastTo":   # input 1 is the target shape
        if lattice.depends_on_values(ins[1]):
            raise lattice.Lost("its target shape depends on the batch's values")
        ins = ins[:1]
    placed = {}
    for j, value in enumerate(ins):
        if not isinstance(value, Rows):
            continue
        tensor = op.inputs[j]
        rank = require_rank(tensor)
        placed.setdefault(value.lead + out_rank - rank, (tensor, value))
    if not placed:
        if op.type == "BroadcastTo":   # a weight or size spread over the batch's shape
            return _rows_of_shape(scan, op.inputs[1]) or [SIZE]
        return outputs_all(op, SIZE)
    if len(placed) > 1:
        (p, (first, _)), (q, (second, _)) = sorted(placed.items(), key=lambda i: i[0])[:2]
        raise lattice.Coupled(
            f"combines the batch axis of {lattice.describe(first)} (output axis {p}) with "
            f"the batch axis of {lattice.describe(second)} (output axis {q}), pairing "
            "every example with every other by broadcasting", lattice.CONTRACTION_ADVICE)
    (index, _), = placed.items()
    if op.type == "BroadcastTo":   # it must keep the batch axis, not stretch it
        dim = tf.compat.dimension_value(out.shape[index])
        src_dim = tf.compat.dimension_value(op.inputs[0].shape[ins[0].lead])
        if src_dim == 1 and dim != 1:
            raise lattice.Lost("it stretches the batch axis")
    rows = [(op.inputs[j], v) for j, v in enumerate(ins) if isinstance(v, Rows)]
    if all(t.shape == out.shape and v == rows[0][1] for t, v in rows):
        return outputs_all(op, rows[0][1])   # pointwise on equal shapes: the layout is unchanged
    return outputs_all(op, index)


def select_v1(scan, op, ins):
    """v1 Select: a vector condition picks rows (axis 0) of higher-rank operands;
    otherwise the shapes match."""
    condition, rank = op.inputs[0], op.inputs[1].shape.rank
    if ins[0] in (INDEPENDENT, SIZE) or condition.shape.rank != 1 or rank in (None, 1):
        return elementwise(scan, op, ins)
    leads = {v.lead for v in ins if isinstance(v, Rows)}
    if leads != {0} or UNKNOWN in ins:
        raise lattice.Lost("a row condition picks between operands with other batch axes")
    return [0]


def identity_n(scan, op, ins):
    return list(ins)


def reshape(scan, op, ins):
    """Followed two ways: the shape argument evaluated symbolically (a batch-major input
    stays batch-major when the target's only B-multiple entry is preceded by 1s), else
    the flat layout (contiguous example blocks of E elements, E a multiple of the output's
    row size: k = E / row size). A static B folds tf.shape(x)[0] into a constant, so a
    target the symbolic way cannot follow may still be proven the flat way."""
    value = ins[0]
    if value is UNKNOWN:
        raise lattice.Lost("its input's batch axis was already lost")
    if not isinstance(value, Rows):
        return [SIZE]
    x, out = op.inputs[0], op.outputs[0]
    rank = require_rank(x)
    a = value.lead
    in_shape = x.shape.as_list()
    after = in_shape[a + 1:]
    N = value.E   # entries per example
    if N is None and value.k is not None and None not in after:
        N = value.k * int(np.prod(after, dtype=np.int64))
    batch_major = all(s == 1 for s in in_shape[:a])
    target = static.resolve_minus_one(
        None if ins[1] is UNKNOWN else scan.shape_value(op.inputs[1]))
    batched = [k for k, (_, power) in enumerate(target or ()) if power == 1]
    if len(batched) == 1:
        k = batched[0]
        if batch_major and all(d == (1, 0) for d in target[:k]):
            rows = _per_example(N, target[k + 1:], k)
            if rows is not None and rows.k is None and target[k][0] is not None:
                # axis k is c * B long over contiguous example blocks: c rows per
                # example ([B, ...] -> [n, -1], n = tf.shape(x)[0])
                rows = Rows(k, target[k][0], N)
            if rows is not None and target[k][0] in (None, rows.k):
                return [rows]
        elif not batch_major and target[:a] == [(s, 0) for s in in_shape[:a]] and k == a:
            return [Rows(a, None, None)]
    if batch_major:
        rows = lattice.complete(value, x.shape)
        if rows is not None and rows.E is not None:
            shape = _refined_shape(op, scan.shape_value(op.inputs[1]))
            if shape.rank:
                dims = shape.as_list()
                lead = 0
                if scan.static_batch_size != 1:
                    while lead < len(dims) - 1 and dims[lead] == 1:
                        lead += 1
                flat = lattice.complete(Rows(lead, None, rows.E), shape)
                if flat is not None and flat.k is not None:
                    return [flat]
    out_shape = out.shape.as_list() if out.shape.rank is not None else None
    if (out_shape is not None and len(out_shape) > a and None not in in_shape[:a + 1]
            and in_shape[:a + 1] == out_shape[:a + 1] and rank > a):
        return [Rows(a, value.k, None)]
    raise lattice.Lost("rows move across examples, or the target shape could not be "
                       "followed")


def _refined_shape(op, target):
    """The static output shape of a Reshape op with what its shape argument's shape value
    `target` tells (Keras' Flatten, Tensordot and LayerNormalization compute it)."""
    shape = op.outputs[0].shape
    if target is not None and shape.rank == len(target):
        shape = tf.TensorShape([d if d is not None else (
            c if power == 0 and c is not None and c >= 0 else None)
            for d, (c, power) in zip(shape.as_list(), target)])
    return shape


def _per_example(N, after_dims, k):
    """The batch axis k of a reshape's output; None when rows would straddle examples."""
    if N is None or any(c is None for c, _ in after_dims):
        return Rows(k, None, None)
    row = int(np.prod([c for c, _ in after_dims], dtype=np.int64))
    if row == 0 or N % row:
        return None
    return Rows(k, N // row, N)


def transpose(scan, op, ins):
    value = only_data_input(op, ins, 0)
    perm = static.static_value(op.inputs[1])
    if perm is None:
        raise lattice.Lost("its permutation is not static")
    return [Rows(list(perm.tolist()).index(value.lead), value.k, None)]


def expand_dims(scan, op, ins):
    value = only_data_input(op, ins, 0)
    dim, rank = static.static_value(op.inputs[1]), require_rank(op.inputs[0])
    if dim is None:
        raise lattice.Lost("its axis is not static")
    dim = normalize(np.reshape(dim, [-1])[0], rank + 1)
    return [Rows(value.lead if value.lead < dim else value.lead + 1, value.k, None)]


def squeeze(scan, op, ins):
    value = only_data_input(op, ins, 0)
    rank = require_rank(op.inputs[0])
    dims = [normalize(d, rank) for d in op.get_attr("squeeze_dims")]
    if not dims:
        shape = op.inputs[0].shape.as_list()
        dims = [i for i, size in enumerate(shape) if size == 1]
        if op.outputs[0].shape.rank != rank - len(dims):
            raise lattice.Lost("which axes it squeezes is not static")
    if value.lead in dims:
        raise lattice.Lost("it squeezes the batch axis")
    return [Rows(value.lead - sum(1 for d in dims if d < value.lead), value.k, None)]


def concat(scan, op, ins):
    if op.type == "ConcatV2":
        data, axis_index = list(range(len(op.inputs) - 1)), len(op.inputs) - 1
    else:
        data, axis_index = list(range(1, len(op.inputs))), 0
    along = static.static_value(op.inputs[axis_index])
    if along is None or lattice.depends_on_values(ins[axis_index]):
        raise lattice.Lost("its axis is not static")
    leads, ks = set(), set()
    for j in data:
        value = _row_index(scan, op.inputs[j], ins[j], ins)
        if value is UNKNOWN:
            raise lattice.Lost("an input's batch axis was already lost")
        if not isinstance(value, Rows):
            if value is SIZE:
                raise lattice.Lost("it joins values shaped by the batch size")
            leads.add(None)   # a batch-independent part
            continue
        rank = require_rank(op.inputs[j])
        if normalize(along, rank) == value.lead:
            # several batches joined along the batch axis: the rows of s1, then of s2
            joined = scan.batches.join_along_batch(op, [op.inputs[i] for i in data],
                                                   [ins[i] for i in data])
            if joined is None:
                raise lattice.Lost("it joins tensors along the batch axis")
            return [joined]
        leads.add(value.lead)
        ks.add(value.k)
    if None in leads:
        # row i of a batch-independent part would be joined to example i by position
        raise lattice.Lost("it joins a batch-independent part to the examples")
    return _one_batch_axis(leads, ks)


def pack(scan, op, ins):
    rank = require_rank(op.inputs[0])
    along = normalize(op.get_attr("axis"), rank + 1)
    leads, ks = set(), set()
    for tensor, value in zip(op.inputs, ins):
        value = _row_index(scan, tensor, value, ins)
        if not isinstance(value, Rows):
            raise lattice.Lost("it stacks tensors with and without the batch axis")
        leads.add(value.lead if value.lead < along else value.lead + 1)
        ks.add(value.k)
    return _one_batch_axis(leads, ks)


def _row_index(scan, tensor, value, ins):
    """Rows(0, 1) for tf.range(n) (or its column) beside tensors with one row per
    example: entry i is example i's row index (`size_uses.is_row_index`); else `value`."""
    rows = [v for v in ins if isinstance(v, Rows)]
    if value is SIZE and rows and size_uses.is_row_index(scan.shape_value, tensor, rows[0]):
        return Rows(0, 1, None)
    return value


def _one_batch_axis(leads, ks):
    if len(leads) != 1:
        raise lattice.Lost("its inputs have different batch axes")
    return [Rows(leads.pop(), ks.pop() if len(ks) == 1 else None, None)]


def unpack(scan, op, ins):
    value = only_data_input(op, ins, 0)
    rank = require_rank(op.inputs[0])
    along = normalize(op.get_attr("axis"), rank)
    if along == value.lead:
        raise lattice.Lost("it unstacks the batch axis into one tensor per example")
    return outputs_all(op, value.lead if value.lead < along else value.lead - 1)


def split(scan, op, ins):
    data, axis_index = (1, 0) if op.type == "Split" else (0, 2)
    value = only_data_input(op, ins, data)
    along, rank = static.static_value(op.inputs[axis_index]), require_rank(op.inputs[data])
    if along is None:
        raise lattice.Lost("its axis is not static")
    if normalize(along, rank) == value.lead:
        raise lattice.Lost("it splits the batch axis")
    return outputs_all(op, value.lead)


def tile_or_pad(scan, op, ins):
    """Tile (multiples) and Pad (paddings) must leave the batch axis alone."""
    value = only_data_input(op, ins, 0)
    spec = static.static_value(op.inputs[1])
    if op.type == "Tile" and (spec is None or spec[value.lead] != 1):
        raise lattice.Lost("it may repeat the batch axis")
    if op.type != "Tile" and (spec is None or np.any(spec[value.lead] != 0)):
        raise lattice.Lost("it may pad the batch axis")
    return [value.lead]


def shaped_like(scan, op, ins):
    """Fill, zeros and random draws whose shape argument follows the batch (tf.zeros(
    [tf.shape(x)[0], 3]), tf.random.uniform(tf.shape(x)), dropout): one entry (or draw)
    per entry of the shape, so each example owns its rows; values batch-independent."""
    if any(lattice.depends_on_values(v) for j, v in enumerate(ins) if j != 0):
        raise lattice.Lost("its value argument depends on the batch's values")
    rows = _rows_of_shape(scan, op.inputs[0])
    if rows is not None:
        return rows
    if ins[0] is UNKNOWN:
        raise lattice.Lost("its shape argument depends on the batch's values")
    return [SIZE]


def _rows_of_shape(scan, shape):
    """[Rows] of a tensor made in the shape `shape` when exactly one of its entries
    follows the batch (that axis, k the entry's factor), else None."""
    target = scan.shape_value(shape)
    if target is not None:
        batched = [k for k, (_, power) in enumerate(target) if power == 1]
        if len(batched) == 1:
            return [Rows(batched[0], target[batched[0]][0], None)]
    return None


TRANSFERS = {op_type: elementwise
             for op_type in op_types.ELEMENTWISE_OP_TYPES | {"ZerosLike", "OnesLike"}}
TRANSFERS.update({op_type: shaped_like for op_type in op_types.SHAPED_BY_SIZE_OP_TYPES})
TRANSFERS.update({
    "Select": select_v1, "IdentityN": identity_n, "Reshape": reshape,
    "Transpose": transpose, "ConjugateTranspose": transpose, "ExpandDims": expand_dims,
    "Squeeze": squeeze, "ConcatV2": concat, "Concat": concat, "Pack": pack,
    "Unpack": unpack, "Split": split, "SplitV": split, "Tile": tile_or_pad,
    "Pad": tile_or_pad, "PadV2": tile_or_pad, "MirrorPad": tile_or_pad,
})

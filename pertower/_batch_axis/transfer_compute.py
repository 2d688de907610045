"""Transfer functions of ops that compute along axes: reductions, ops along one axis
(sorts, scans, softmax), products (matmul, einsum), convolutions, pools, normalizations
and losses (the contract: `transfer_layout`).
"""

import collections

import numpy as np

from pertower import _op_types as op_types
from pertower._batch_axis import lattice
from pertower._batch_axis import size_uses
from pertower._batch_axis import static
from pertower._batch_axis.lattice import SIZE, UNKNOWN, Rows
from pertower._batch_axis.transfer_layout import (batch_axis_words, normalize,
                                                  only_data_input, require_rank)

__all__ = ["TRANSFERS", "READS_UNKNOWN"]

_CONVOLUTION_OP_TYPES = {  # op type -> index of the data input
    "Conv2D": 0, "Conv3D": 0, "DepthwiseConv2dNative": 0, "Conv2DBackpropInput": 2,
    "Conv3DBackpropInputV2": 2, "Dilation2D": 0, "ExtractImagePatches": 0,
    "DepthwiseConv2dNativeBackpropInput": 2,
    "ResizeBilinear": 0, "ResizeNearestNeighbor": 0, "ResizeBicubic": 0, "ResizeArea": 0,
    "ScaleAndTranslate": 0, "DepthToSpace": 0, "SpaceToDepth": 0, "Conv": 0, "Conv1D": 0,
}
# Elementwise arithmetic that keeps constant rows constant (`_constant_rows`).
_CONSTANT_ARITHMETIC = frozenset({"Add", "AddV2", "Sub", "Mul", "RealDiv", "Neg"})


def _decode(value):
    return value.decode() if isinstance(value, bytes) else value


def reduction(scan, op, ins):
    """A reduction over the batch axis couples the examples, unless its result only
    sizes shapes or bounds loops (`size_uses.only_bounds`). Over *every* axis of a tensor
    whose batch axis was lost it reduces the batch axis wherever it is."""
    if lattice.depends_on_values(ins[1]):
        raise lattice.Lost("its axes depend on the batch's values")
    x, value = op.inputs[0], ins[0]
    reduced, rank = static.static_value(op.inputs[1]), x.shape.rank
    if reduced is None or rank is None:
        raise lattice.Lost("its axes are not static")
    reduced = sorted({normalize(r, rank) for r in np.reshape(reduced, [-1])})
    if value is UNKNOWN:
        if _sizes_only(x):
            raise lattice.Lost("it reduces sizes of a tensor whose batch axis was already "
                               "lost")
        if rank > 0 and reduced == list(range(rank)):
            return _reduced_batch(scan, op, (
                f"reduces ({op.type}) over every axis of {lattice.describe(x)}, which is "
                "computed from the batch, so over its batch axis too"))
        raise lattice.Lost("its input's batch axis was already lost")
    if value.lead in reduced:
        return _reduced_batch(scan, op, (
            f"reduces ({op.type}) over {batch_axis_words(x, value.lead)}"))
    keep = op.get_attr("keep_dims")
    return [value.lead if keep else value.lead - sum(1 for r in reduced if r < value.lead)]


def _sizes_only(tensor):
    """Whether `tensor` is integer arithmetic on shapes and constants (Keras'
    `prod(tf.shape(x)[:1])`): its entries are sizes, not any example's values."""
    stack = [tensor]
    while stack:
        tensor = stack.pop()
        if tensor.op.type in op_types.SHAPE_OP_TYPES or static.static_value(tensor) is not None:
            continue
        if not tensor.dtype.is_integer or tensor.op.type not in static.SHAPE_ARITHMETIC:
            return False
        stack.extend(tensor.op.inputs)
    return True


def _constant_rows(tensor):
    """Whether every entry of `tensor` is one constant whatever the batch's values
    (tf.ones_like(cost), tf.ones(tf.shape(cost)), through identities and casts)."""
    while tensor.op.type in ("Identity", "Cast"):
        tensor = tensor.op.inputs[0]
    if tensor.op.type in _CONSTANT_ARITHMETIC:   # (tf.zeros_like(cost) + 1.0)
        return all(static.static_value(t) is not None or _constant_rows(t)
                   for t in tensor.op.inputs)
    return tensor.op.type in ("OnesLike", "ZerosLike") or _filled_with_constant(tensor)


_BOUND_DOUBTS = {
    "unmasked": "its result bounds a while loop that does not keep each example's state "
                "fixed past the example's own end (as dynamic_rnn's select on `time >= "
                "sequence_length` does), so in the batch an example may run more (or "
                "fewer) steps than alone",
    "unclear": "its result only sizes shapes or bounds loops, in a way the static "
               "analysis cannot follow to the end",
}


def _reduced_batch(scan, op, reason):
    """The result of a reduction over the batch axis: SIZE when it reduces constant
    rows (`tf.reduce_sum(tf.ones_like(cost))` is B: a size-data edge) or only sizes
    shapes or bounds loops (`size_uses.only_bounds`); a coupling otherwise."""
    if _constant_rows(op.inputs[0]):
        scan.size_data_edges.append((op, 0))
        return [SIZE]
    uses = size_uses.only_bounds(scan, op)
    if uses in _BOUND_DOUBTS:
        scan.lose(op, f"it {reason}; {_BOUND_DOUBTS[uses]}", doubt=True)
    if uses != "data":
        return [SIZE]
    raise lattice.Coupled(reason, lattice.advice_for(op, lattice.REDUCTION_ADVICE))


def l2_loss(scan, op, ins):
    raise lattice.Coupled(f"sums the squares of every entry of {lattice.describe(op.inputs[0])}, "
                          "whose rows are the examples", lattice.REDUCTION_ADVICE)


# op type -> (the input holding its axes, or None for the last axis; what it does along
# the batch axis; advice; whether its output drops the axes)
_ALONG_AXES = {
    "ArgMax": (1, "takes the {type} over {axis}", lattice.REDUCTION_ADVICE, True),
    "Cumsum": (1, "accumulates ({type}) along {axis}, so each example's entry holds the "
                  "examples before it", lattice.REDUCTION_ADVICE, False),
    "ReverseV2": (1, "works along {axis}: it reverses the order of the examples",
                  lattice.POSITION_ADVICE, False),
    "Roll": (2, "works along {axis}: it shifts examples to other positions",
             lattice.POSITION_ADVICE, False),
    "Softmax": (None, "normalizes ({type}) along its last axis, which is {axis}",
                lattice.REDUCTION_ADVICE, False),
    "TopKV2": (None, "sorts or ranks ({type}) along its last axis, which is {axis}",
               lattice.POSITION_ADVICE, False),
}
for _alias, _like in (("ArgMin", "ArgMax"), ("Cumprod", "Cumsum"),
                      ("CumulativeLogsumexp", "Cumsum"), ("LogSoftmax", "Softmax"),
                      ("NthElement", "TopKV2")):
    _ALONG_AXES[_alias] = _ALONG_AXES[_like]


def along_axes(scan, op, ins):
    """Ops along static axes of input 0 (`_ALONG_AXES`): a coupling when the batch axis
    is one of them."""
    axes_input, what, advice, drops = _ALONG_AXES[op.type]
    value = only_data_input(op, ins, 0)
    rank = require_rank(op.inputs[0])
    if axes_input is None:
        along = [rank - 1]
    else:
        along = static.static_value(op.inputs[axes_input])
        if along is None:
            raise lattice.Lost("its axis is not static")
        along = [normalize(a, rank) for a in np.reshape(along, [-1])]
    if value.lead in along:
        raise lattice.Coupled(what.format(type=op.type, axis=batch_axis_words(
            op.inputs[0], value.lead)), advice)
    lead = value.lead - sum(1 for a in along if a < value.lead) if drops else value.lead
    return [lead] * len(op.outputs)


def random_shuffle(scan, op, ins):
    if isinstance(ins[0], Rows) and ins[0].lead == 0:
        raise lattice.Coupled(f"shuffles {lattice.describe(op.inputs[0])} along axis 0, its "
                              "batch axis", lattice.POSITION_ADVICE)
    raise lattice.Lost("it shuffles a tensor that carries the batch")


def cross_entropy(scan, op, ins):
    ks = set()
    for j, value in enumerate(ins):
        if not isinstance(value, Rows):
            continue
        tensor = op.inputs[j]
        rank = tensor.shape.rank
        if rank is not None and rank >= 2 and value.lead == rank - 1:
            raise lattice.Coupled(
                "takes a softmax along the class axis, which is "
                f"{batch_axis_words(tensor, value.lead)}", lattice.REDUCTION_ADVICE)
        if value.lead != 0:
            raise lattice.Lost("the batch axis is not the loss' example axis")
        ks.add(value.k)
    # the op needs as many label rows as logit rows, so an unknown k (Keras' [None, None]
    # target placeholder, reshaped to [-1]) equals the other's
    known = ks - {None}
    if len(known) > 1:
        raise lattice.Lost("logits and labels have different rows per example")
    k = known.pop() if known else None
    return [Rows(0, k, None), Rows(0, k, None)]


def _product_axis(op, out):
    """The output of a product whose operands put the batch on the output axes `out`:
    one axis; SIZE when none does; a coupling when two operands each carry the batch."""
    if len(out) > 1:
        raise lattice.Coupled(
            f"multiplies two tensors from the batch, {lattice.describe(op.inputs[0])} and "
            f"{lattice.describe(op.inputs[1])}, across examples (e.g. x x^T): each "
            "example's row holds every other example", lattice.CONTRACTION_ADVICE)
    return [next(iter(out))] if out else [SIZE]


def matmul(scan, op, ins):
    """MatMul [m, n] x [n, p] and BatchMatMul [..., m, n] x [..., n, p]: a batch axis
    among the leading axes or on m (p) is kept, on n it is contracted."""
    batched = op.type in op_types.BATCH_MATMUL_OP_TYPES
    out_rank = require_rank(op.outputs[0]) if batched else 2
    adjoint = ("adj_x", "adj_y") if batched else ("transpose_a", "transpose_b")
    out = set()
    for i in (0, 1):
        value = ins[i]
        if not isinstance(value, Rows):
            continue
        tensor = op.inputs[i]
        rank = require_rank(tensor) if batched else 2
        a = value.lead
        if a < rank - 2:
            out.add(a + out_rank - rank)
            continue
        kept = (rank - 1 if op.get_attr(adjoint[i]) else rank - 2) if i == 0 else (
            rank - 2 if op.get_attr(adjoint[i]) else rank - 1)
        if a != kept:
            raise lattice.Coupled(f"contracts (sums over) {batch_axis_words(tensor, a)}, "
                                  "e.g. x^T x", lattice.CONTRACTION_ADVICE)
        out.add(out_rank - 2 if i == 0 else out_rank - 1)
    return _product_axis(op, out)


def einsum(scan, op, ins):
    equation = _decode(op.get_attr("equation")).replace(" ", "")
    ranks = [require_rank(t) for t in op.inputs]
    lhs, _, rhs = equation.partition("->")
    subscripts = lhs.split(",")
    if len(subscripts) != len(op.inputs):
        raise lattice.Lost("its equation could not be read")
    ellipsis = max((r - len(s.replace("...", "")) for s, r in zip(subscripts, ranks)
                    if "..." in s), default=0)

    def labels(subscript, rank):
        if "..." not in subscript:
            return list(subscript)
        before, after = subscript.split("...")
        n = rank - len(before) - len(after)
        return list(before) + [("...", ellipsis - n + j) for j in range(n)] + list(after)

    in_labels = [labels(s, r) for s, r in zip(subscripts, ranks)]
    if "->" in equation:
        out_labels = labels(rhs, len(rhs.replace("...", "")) + ellipsis)
    else:
        counts = collections.Counter(l for ls in in_labels for l in ls if isinstance(l, str))
        out_labels = [("...", j) for j in range(ellipsis)] + sorted(
            l for l, c in counts.items() if c == 1)
    out = {}
    for i, value in enumerate(ins):
        if not isinstance(value, Rows):
            continue
        tensor = op.inputs[i]
        label = in_labels[i][value.lead]
        if label not in out_labels:
            raise lattice.Coupled(
                f"sums over the einsum index {label!r} of {equation!r}, which is "
                f"{batch_axis_words(tensor, value.lead)}", lattice.CONTRACTION_ADVICE)
        out.setdefault(out_labels.index(label), tensor)
    return _product_axis(op, out)


def convolution(scan, op, ins):
    data = _CONVOLUTION_OP_TYPES[op.type]
    value = only_data_input(op, ins, data)
    if value.lead == 0:
        return [0] * len(op.outputs)
    raise lattice.Coupled(
        f"slides its window (or mixes channels) along "
        f"{batch_axis_words(op.inputs[data], value.lead)}; the batch axis of an "
        "image op must be axis 0", lattice.CONTRACTION_ADVICE)


def _channel_axis(op):
    try:
        data_format = _decode(op.get_attr("data_format"))
    except ValueError:  # LRN, MaxPoolWithArgmax: always NHWC
        data_format = "NHWC"
    return 1 if data_format.startswith("NC") else (op.inputs[0].shape.rank or 4) - 1


def pool(scan, op, ins):
    a, channel = only_data_input(op, ins, 0).lead, _channel_axis(op)
    if a == 0 or (a == channel and op.type != "LRN") or (op.type == "LRN" and a != channel):
        return [a] * len(op.outputs)
    raise lattice.Coupled(f"pools ({op.type}) along {batch_axis_words(op.inputs[0], a)}",
                          lattice.REDUCTION_ADVICE)


def _filled_with_constant(tensor):
    """A Fill (or BroadcastTo) whose value is a constant (its size may follow the batch),
    as Keras' LayerNormalization makes the unit scale and zero offset of its fused form."""
    value = {"Fill": 1, "BroadcastTo": 0}.get(tensor.op.type)
    return value is not None and static.static_value(tensor.op.inputs[value]) is not None


def fused_batch_norm(scan, op, ins):
    """Inference mode normalizes each entry with batch-independent statistics; training
    mode normalizes each channel over the other axes: a coupling unless the batch axis
    is the channel axis (Keras LayerNormalization's NCHW form [1, B*k, E/k, 1])."""
    for j in range(1, len(ins)):
        if lattice.depends_on_values(ins[j]) and not _filled_with_constant(op.inputs[j]):
            raise lattice.Lost("its statistics or scale depend on the batch's values")
    value = ins[0]
    if value is UNKNOWN:
        raise lattice.Lost("its input's batch axis was already lost")
    if not isinstance(value, Rows):
        raise lattice.Lost("it normalizes values shaped by the batch size")
    if op.get_attr("is_training") and value.lead != _channel_axis(op):
        raise lattice.Coupled(
            "normalizes each channel with the mean and variance over the whole batch "
            f"(is_training=True), reducing {batch_axis_words(op.inputs[0], value.lead)}",
            lattice.BATCH_NORM_ADVICE)
    return [value] + [UNKNOWN] * (len(op.outputs) - 1)


TRANSFERS = {op_type: reduction for op_type in op_types.REDUCTION_OP_TYPES}
TRANSFERS.update({op_type: convolution for op_type in _CONVOLUTION_OP_TYPES})
TRANSFERS.update({op_type: pool for op_type in op_types.POOL_OP_TYPES})
TRANSFERS.update({op_type: fused_batch_norm for op_type in op_types.BATCH_NORM_OP_TYPES})
TRANSFERS.update(dict.fromkeys(_ALONG_AXES, along_axes))
TRANSFERS.update({op_type: matmul for op_type in op_types.BATCH_MATMUL_OP_TYPES})
TRANSFERS.update({
    "RandomShuffle": random_shuffle,
    "MatMul": matmul, "SparseMatMul": matmul, "Einsum": einsum,
    "SoftmaxCrossEntropyWithLogits": cross_entropy,
    "SparseSoftmaxCrossEntropyWithLogits": cross_entropy, "L2Loss": l2_loss,
})
# Ops whose transfer functions read UNKNOWN inputs themselves.
READS_UNKNOWN = op_types.REDUCTION_OP_TYPES

"""The per-example loss behind a tf_keras training loss (graph mode), for the DP step.

Notation:
    B   examples in the batch       v   a loss function's unreduced losses, [B, ...]
    c   a constant factor (a loss weight)     R   a term that reads no example

tf_keras' v1 training loop (`Model.compile`) builds `model.total_loss` as

    total = sum_k c_k * reduce_k(v_k) + sum_j R_j

one term per output k, reduce_k being Keras' reduction of the loss function:
SUM_OVER_BATCH_SIZE (the default, also AUTO) is `DivNoNan(Sum(v), Cast(Size(v)))`, the
mean over all entries; NONE is v itself; SUM is `Sum(v)`. The R_j are
`model.losses`: weight regularizers (`kernel_regularizer`, ...) and `model.add_loss`.

`split_loss` reads that sum back from the graph: the per-example loss

    loss_i = sum_k c_k * mean over the entries of v_k,i                       [B]

(so the mean over i of loss_i is the total's data part for either reduction), and the
R_j. DP-SGD clips the gradient of loss_i for each example and adds the gradient of
R = sum_j R_j to the noised mean once, unclipped: R reads only the weights, so its
gradient is a function of the released weights (post-processing, no privacy cost; as
Opacus applies weight decay in the optimizer, after clipping and noise). TensorFlow
Privacy 0.9.0's Keras optimizers fail on a regularized model (Keras cannot add the
scalar R to a loss of reduction NONE in a v2 train step; tensorflow/privacy issue 149).

Refused (`ValueError`): reduction SUM (a sum over the batch: DP-SGD averages); a term
that reads the examples but is not one of the above (e.g. `add_loss` of an activity
term, whose gradient is not per example); anything else the reading does not recognize
is read as a term and follows the same rules.
"""

import tensorflow as tf

from pertower import _context
from pertower import _graph_walk
from pertower import _op_types as op_types

__all__ = ["SplitLoss", "split_loss"]

_ADDS = ("AddN", "Add", "AddV2")


class SplitLoss:
    """`per_example`: [B] (the per-example loss); `data_independent`: the scalar R, or
    None when the loss has no such term."""

    def __init__(self, per_example, data_independent):
        self.per_example = per_example
        self.data_independent = data_independent


def _constant(tensor):
    """The float value of a scalar constant, or None."""
    if tensor.shape.rank != 0 or tensor.op.type != "Const":
        return None
    return float(tf.get_static_value(tensor))


def _terms(tensor, factor, out):
    """Appends (c, term) for each summand of `tensor` (sums, identities and constant
    factors looked through)."""
    op = tensor.op
    # a sum of like shapes only: in [B] + scalar the scalar is a part of each example's
    # loss (and clipped with it), as DPOptimizer reads a [B] loss
    if op.type in _ADDS and all(t.shape == tensor.shape for t in op.inputs):
        for t in op.inputs:
            _terms(t, factor, out)
    elif op.type == "Identity":
        _terms(op.inputs[0], factor, out)
    elif op.type == "Mul" and any(_constant(t) is not None for t in op.inputs):
        constant, other = ((op.inputs[0], op.inputs[1]) if _constant(op.inputs[0]) is not None
                           else (op.inputs[1], op.inputs[0]))
        _terms(other, factor * _constant(constant), out)
    else:
        out.append((factor, tensor))


def _reduced_input(tensor):
    """v when `tensor` is Sum(...Sum(v)) over all of v's axes (rank(v) >= 1), else None."""
    while tensor.op.type == "Sum" and tensor.shape.rank == 0:
        below = tensor.op.inputs[0]
        if below.shape.rank is not None and below.shape.rank >= 1:
            return below
        tensor = below
    return None


def _mean_over_entries(tensor):
    """v when `tensor` is Keras' SUM_OVER_BATCH_SIZE reduction of v: DivNoNan (or
    RealDiv) of Sum(v) by Cast(Size(v)), or by the constant number of v's entries when
    its shape is fully defined; also tf.reduce_mean(v) over all axes."""
    op = tensor.op
    if op.type == "Mean" and op.inputs[0].shape.rank and tensor.shape.rank == 0:
        return op.inputs[0]
    if op.type not in ("DivNoNan", "RealDiv"):
        return None
    summed, count = op.inputs
    v = _reduced_input(summed)
    while count.op.type in ("Cast", "Identity"):
        count = count.op.inputs[0]
    if v is not None and count.op.type == "Size" and count.op.inputs[0] is v:
        return v
    # Size of a fully defined shape is folded into a constant (a static batch, as TF2's
    # fit traces a dataset of whole batches)
    if v is not None and v.shape.is_fully_defined() and \
            _constant(count) == v.shape.num_elements():
        return v
    return None


def _reads_examples(tensor):
    """Whether `tensor` depends on a placeholder or iterator output with a batch axis."""
    return any(op.type in op_types.BATCH_SOURCE_OP_TYPES and out.shape.rank != 0
               for op in _graph_walk.upstream_ops([tensor]) for out in op.outputs)


def _per_entry_mean(v):
    """[B, ...] -> [B]: the mean of an example's entries."""
    return v if v.shape.rank == 1 else tf.reduce_mean(v, axis=list(range(1, v.shape.rank)))


def _scaled(factor, tensor):
    return tensor if factor == 1.0 else tf.cast(factor, tensor.dtype) * tensor


def split_loss(loss, argument="loss"):
    """`SplitLoss` of a Keras training loss (the module docstring): a per-example loss
    [B, ...] (reduction NONE) is returned as it is (its entries averaged per example);
    a scalar is read back into its per-example mean and its data-independent terms.

    Raises:
      ValueError: a scalar term that sums over the batch (reduction SUM), or that reads
        the examples without being a per-example mean; a scalar loss without any
        per-example part.
    """
    terms = []
    _terms(loss, 1.0, terms)
    per_example, independent = [], []
    for factor, term in terms:
        rank = term.shape.rank
        v = None if rank != 0 else _mean_over_entries(term)
        if rank is not None and rank >= 1:
            per_example.append(_scaled(factor, _per_entry_mean(term)))
        elif v is not None:
            per_example.append(_scaled(factor, _per_entry_mean(v)))
        elif not _reads_examples(term):
            independent.append(_scaled(factor, term))
        elif _reduced_input(term) is not None:
            raise _context.error(
                ValueError, f"`{argument}` ({loss.name}) sums the examples' losses "
                f"({term.name}: Keras' reduction SUM): DP-SGD averages the clipped "
                "per-example gradients. Compile with the loss's default reduction "
                "(SUM_OVER_BATCH_SIZE) or reduction=NONE.")
        else:
            raise _context.error(
                ValueError, f"`{argument}` ({loss.name}) has a term ({term.name}, "
                f"{term.op.type}) that reads the examples but is not a mean of per-example "
                "losses (e.g. model.add_loss of an activity regularizer or of a batch "
                "statistic), so its gradient cannot be clipped per example. Make it part "
                "of the loss function (one value per example), or leave it out.")
    if not per_example:
        raise _context.error(
            ValueError, f"`{argument}` ({loss.name}) reads no example's loss: DP-SGD needs "
            "one loss per example (a Keras loss with its default reduction or "
            "reduction=NONE).")
    per_example_loss = tf.add_n(per_example) if len(per_example) > 1 else per_example[0]
    regularization = (None if not independent else
                      tf.add_n(independent) if len(independent) > 1 else independent[0])
    return SplitLoss(per_example_loss, regularization)

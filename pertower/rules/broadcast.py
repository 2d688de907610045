"""One rule for a weight broadcast into an elementwise op whose other input carries the
batch (`OP_TYPES`: biases added by hand, LayerNormalization's beta and gamma, learned
scales, clipping bounds, exponents, a learned position table's rows).

Notation: Z the op's output [N, ...], N = B*k rows (k per example); w the weight, w_e w
reshaped to Z's rank with leading 1s; dZ the gradient at Z.

Identity: give each row r of Z a copy of w of its own, w_b = w_e broadcast to N rows
along axis 0, Z = op(..., w_b, ...) (the same values: the op is elementwise); the op's
registered gradient with respect to w_b sums over the other broadcast axes, and
    grad_i(w) = sum over example i's rows r of  d<dZ, op(..., w_b, ...)>/d w_b[r]
(for Mul: sum of dz * A over example i's rows and broadcast axes, Goodfellow 2015,
arXiv 1510.01799). For one group w is not broadcast.

BroadcastTo(w, S) whose target shape S follows the batch (TF-models' PositionEmbedding:
tf.broadcast_to(rows [T, d], tf.shape(inputs)) -> [B, T, d]) is the same identity with
no other input: Z's rows are the batch's (`_batch_axis` gives a tensor made in a shape
that follows the batch the rows of that shape, as for tf.zeros), so
    grad_i(w) = sum over example i's rows and the broadcast axes of dZ.

Covered: w's rank static and w not stretching axis 0 (rank below Z's, or a leading 1);
Z and the batch-side input (for BroadcastTo: Z) example-major on axis 0. w's other sizes
may be dynamic (a function of a weight: `_weight_functions` pulls the result back to the
weight's shape).
"""

import tensorflow as tf

from pertower import _tf
from pertower._layout import _rows
from pertower.rules import registry as registry_lib

__all__ = ["BroadcastRule", "OP_TYPES", "copy_op", "register"]

# Elementwise op types with broadcasting whose registered gradient covers every input
# (and BroadcastTo, registered apart: its second input is the target shape)
OP_TYPES = ("Add", "AddV2", "Sub", "Mul", "MulNoNan", "Div", "RealDiv", "DivNoNan",
            "Maximum", "Minimum", "SquaredDifference", "Pow", "SelectV2", "Atan2",
            "Xdivy", "Xlogy", "Xlog1py")


class BroadcastRule(registry_lib.Rule):
    """Per-example gradients of a broadcast weight from the op's own gradient, with the
    weight copied to every row of the batch."""

    dynamic_weight_shape = True

    def match(self, op, slot, analysis):
        out = op.outputs[0]
        w_shape = op.inputs[slot].shape
        if w_shape.rank is None or out.shape.rank is None:
            return "the broadcast weight or the output has no static rank"
        if w_shape.rank > out.shape.rank or (w_shape.rank == out.shape.rank and
                                             tf.compat.dimension_value(w_shape[0]) != 1):
            return f"the weight (shape {w_shape}) is broadcast along the batch axis"
        carriers = [t for j, t in enumerate(op.inputs)
                    if j != slot and analysis.rows(t) is not None]
        if op.type == "BroadcastTo":      # the rows of Z follow its target shape alone
            if analysis.rows(out) is None:
                return "its target shape does not follow the batch"
            carriers = [out]
        if not carriers:
            return "no other input carries the batch"
        rows = _rows.example_rows(analysis, carriers[0], out)
        if isinstance(rows, str):
            return rows
        return registry_lib.Use(op, slot, self, carriers[0], out, w_shape, rows)

    def per_group(self, use, dZ, G, inputs=None):
        """`inputs`: what the op is rebuilt on (default its own; in a loop, A_all and the
        weight's value before the loop: `pertower._loops.uses`)."""
        op, out_rank = use.op, use.op.outputs[0].shape.rank
        inputs = list(op.inputs if inputs is None else inputs)
        if op.type == "BroadcastTo":       # the target shape is Z's, dZ's (in a loop too)
            inputs[1] = tf.shape(dZ, out_type=op.inputs[1].dtype)
        w = inputs[use.slot]
        w_shape = [_rows.dim(w, axis) for axis in range(w.shape.rank)]
        w_dims = [1] * (out_rank - len(w_shape)) + w_shape       # w_e's shape
        w_e = tf.reshape(w, _rows.group_shape(1, w_dims[1:]))    # [1, *w_dims[1:]]
        if isinstance(G, int) and G == 1:
            w_b = w_e                       # the op's gradient sums over axis 0 too
        else:
            # [1, *w_dims[1:]] -> [N, *w_dims[1:]]: a copy of w per row of Z
            w_b = tf.broadcast_to(w_e, _rows.group_shape(_rows.dim(dZ, 0), w_dims[1:]))
        inputs[use.slot] = w_b
        rebuilt = copy_op(op, inputs, graph=w_b.graph)
        grad, = tf.gradients(rebuilt.outputs[0], [w_b], grad_ys=dZ)   # [N or 1, *w_dims[1:]]
        # [G*T, *w_dims[1:]] -> [G, T, *w_dims[1:]] -> [G, *w_dims[1:]]
        grouped = tf.reduce_sum(_rows.to_groups(grad, G, tail=out_rank - 1), axis=1)
        # [G, *w_dims[1:]] -> [G, *w.shape]
        return tf.reshape(grouped, _rows.group_shape(G, w_shape))

    # sum_i f_i grad_i(w): the one-group (batch) gradient of dZ scaled per example
    clipped_sum = registry_lib.batch_gradient_clipped_sum


def copy_op(op, inputs, graph=None):
    """A copy of `op` (its type and attributes) on `inputs`, in `graph` (default op's)."""
    return _tf.create_op(
        graph or op.graph, op.type, inputs, dtypes=[t.dtype for t in op.outputs],
        attrs={key: value for key, value in op.node_def.attr.items()
               if not key.startswith("_")},
        op_def=op.op_def, name=f"{op.name.split('/')[-1]}_per_example")


def register(registry):
    """Adds the broadcast rule to `registry` for every op type of `OP_TYPES` and
    BroadcastTo."""
    registry_lib.register_each(registry, OP_TYPES + ("BroadcastTo",), BroadcastRule())

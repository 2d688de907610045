"""Rules for a weight broadcast into Add, AddV2, Sub and Mul (biases added by hand,
LayerNormalization's beta and gamma, learned scales).

Identity: with Z = A ∘ W and W broadcast over some axes of Z (W reshaped to Z's rank
with leading 1s, W_e), dZ/dW sums the elementwise derivative over the broadcast axes:
    Add/AddV2:  grad_i(W) = sum over example i's rows and W_e's size-1 axes of dz
    Sub:        the same, negated when W is the subtrahend
    Mul:        the same of dz * A (A the other operand, broadcast as in the op)

Covered: the other operand depends on the batch with the output's rank (its axis 0 is
the batch axis); W's static shape is known and does not stretch axis 0 (rank below
Z's, or a leading 1).
"""

import tensorflow as tf

from pertower.rules import _rows
from pertower.rules import registry as registry_lib


class BroadcastRule(registry_lib.Rule):
    """Per-example sums of dZ (times the other operand for Mul) over broadcast axes."""

    def __init__(self, kind):
        self.kind = kind  # "add", "sub" or "mul"

    def match(self, op, slot, analysis):
        other = op.inputs[1 - slot]
        out = op.outputs[0]
        w_shape = op.inputs[slot].shape
        if not w_shape.is_fully_defined() or out.shape.rank is None:
            return "the broadcast weight or the output has no static rank/shape"
        if w_shape.rank > out.shape.rank or (w_shape.rank == out.shape.rank and
                                             w_shape[0] != 1):
            return f"the weight (shape {w_shape}) is broadcast along the batch axis"
        if other.shape.rank != out.shape.rank:
            return "the other operand does not have the output's rank"
        rows = _rows.example_rows(analysis, other, out)
        if isinstance(rows, str):
            return rows
        return registry_lib.Use(op, slot, self, other, out, w_shape, rows)

    def per_group(self, use, dZ, G):
        out_rank = use.output.shape.rank
        w_dims = [1] * (out_rank - use.weight_shape.rank) + use.weight_shape.as_list()
        grad = dZ
        if self.kind == "mul":
            grad = dZ * use.activation                  # [B*k, ...] (broadcast like Z)
        elif self.kind == "sub" and use.slot == 1:
            grad = -dZ
        axes = [j for j in range(1, out_rank) if w_dims[j] == 1]
        if axes:
            grad = tf.reduce_sum(grad, axis=axes, keepdims=True)   # [B*k, *w_dims[1:]]
        # [B*k, *w_dims[1:]] -> [G, rows, *w_dims[1:]] -> [G, *w_dims[1:]]
        grouped = tf.reduce_sum(_rows.to_groups(grad, G, out_rank - 1), axis=1)
        # [G, *w_dims[1:]] -> [G, *w.shape]
        return tf.reshape(grouped, _rows.group_shape(G, use.weight_shape.as_list()))

    def clipped_sum(self, use, dZ, factors):
        # sum_i f_i grad_i(w): the one-group (batch) gradient of dZ scaled per example
        return registry_lib.batch_gradient_clipped_sum(self, use, dZ, factors)


def register(registry):
    """Adds the broadcast rules to `registry`."""
    registry.register("Add", BroadcastRule("add"))
    registry.register("AddV2", BroadcastRule("add"))
    registry.register("Sub", BroadcastRule("sub"))
    registry.register("Mul", BroadcastRule("mul"))

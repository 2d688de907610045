"""Rule for Einsum dense layers, e.g. Keras EinsumDense: Z = einsum("btd,de->bte", A, W).

Identity (Goodfellow 2015, arXiv 1510.01799, in einsum form): when A's first index b is
the batch axis, first in the output and not in the weight, every other index of A and Z
is contracted with W or runs over positions that all use W, so with A and dZ as
[G, rows per group, ...]
    grad_g(W) = einsum("g{a},g{z}->g{w}")        (b runs over a group's rows, summed).
A weight index in neither A nor Z is summed over W alone: the gradient is formed
without it and broadcast along it.

Covered: two operands, the activation first, no ellipsis, no index repeated in an operand.
"""

import tensorflow as tf

from pertower import _batch_axis
from pertower._layout import _rows
from pertower.rules import registry as registry_lib


class EinsumRule(registry_lib.Rule):
    """Per-example weight gradients of a two-operand einsum."""

    def match(self, op, slot, analysis):
        parsed = _batch_axis.parse_einsum(op.get_attr("equation"))
        if parsed is None or len(parsed[0]) != 2:
            return "the einsum equation has an ellipsis or is not 'a,w->z'"
        (a, w), z = parsed
        if slot != 1:
            return "the weight is the first einsum operand"
        if not a or not z or a[0] != z[0] or a[0] in w:
            return "the einsum does not keep the activation's first axis as the batch axis"
        if any(len(set(term)) != len(term) for term in (a, w, z)):
            return "the einsum repeats an index within an operand"
        if not op.inputs[1].shape.is_fully_defined():
            return "the einsum weight's shape is not static"
        return self.example_use(op, slot, analysis)

    def per_group(self, use, dZ, G):
        (a, w), z = _batch_axis.parse_einsum(use.op.get_attr("equation"))
        letters = set(a + w + z)
        g = next(c for c in "gGhHqQ" + "abcdefijklmnoprstuvwxyz" if c not in letters)
        A_g = _rows.to_groups(use.activation, G, tail=use.activation.shape.rank - 1)  # [G, k, ...]
        dZ_g = _rows.to_groups(dZ, G, tail=dZ.shape.rank - 1)                        # [G, k, ...]
        kept = "".join(c for c in w if c in a or c in z)   # w without its weight-only indices
        grad = tf.einsum(f"{g}{a},{g}{z}->{g}{kept}", A_g, dZ_g)          # [G, kept sizes]
        if kept == w:
            return grad
        for axis, c in enumerate(w):
            if c not in kept:
                grad = tf.expand_dims(grad, axis + 1)                   # size 1 along c
        w_shape = use.weight_shape.as_list()
        return tf.broadcast_to(grad, tf.concat([tf.shape(grad)[:1], w_shape], 0))  # [G, *w]

    # sum_i f_i grad_i(w): the one-group (batch) gradient of dZ scaled per example
    clipped_sum = registry_lib.batch_gradient_clipped_sum


def register(registry):
    """Adds the Einsum rule to `registry`."""
    registry.register("Einsum", EinsumRule())

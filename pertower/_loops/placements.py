"""Placements: where a rule's result for a piece of a weight read in a loop body goes in
the weight's shape. A piece is an `Unpack` slice (`Slice`) or a function of the weights
alone (`Function`); `Placed` wraps the piece's rule (`pertower._loops.uses.LoopPlan`)."""

import tensorflow as tf

from pertower import _tf
from pertower.rules import _weight_functions as weight_functions
from pertower.rules import registry as registry_lib

__all__ = ["Function", "Placed", "Slice"]


class Slice:
    """Slice `index` along `axis` of a weight of static `shape` (an Unpack's output)."""

    def __init__(self, axis, index, shape):
        self.axis, self.index, self.shape = axis, index, shape.as_list()

    def place(self, piece, grouped):
        """The gradient of the slice, [G, *slice] (or [*slice] when not `grouped`),
        as the gradient of the whole weight: zeros elsewhere, [G, *shape]."""
        lead = 1 if grouped else 0
        inner = self.shape[:self.axis] + self.shape[self.axis + 1:]
        piece = tf.reshape(piece, ([-1] if grouped else []) + inner)
        piece = tf.expand_dims(piece, self.axis + lead)
        paddings = [[0, 0]] * (lead + self.axis) + [
            [self.index, self.shape[self.axis] - 1 - self.index]] + [[0, 0]] * (
                len(self.shape) - 1 - self.axis)
        return tf.pad(piece, paddings)


class Function:
    """`output`, a function of the weights alone in the body, of the weight's `source`
    (its value, or its handle for a gather of rows every example reads): the gradient
    with respect to it is pulled back to `source` by the VJP of `rules._weight_functions`
    (the inverse of a Cast or a gather, the VJP of a Split, a Tanh's batched VJP), on the
    op copied before the loop (its value is the same at every step)."""

    def __init__(self, loop, source, output):
        self.loop, self.source, self.output = loop, source, output
        self._rule = None

    def place(self, piece, grouped):
        """[G, *output] (or [*output] when not `grouped`) -> [G, *source] ([*source])."""
        if self._rule is None:
            u = self.loop.outside(self.output, build=True)
            x = self.loop.outside(self.source, build=True)
            shape = x.shape
            if x.dtype == tf.resource:   # a gather's handle: the variable's shape
                shape = tf.TensorShape(_tf.handle_data(x).shape_and_type[0].shape)
            self._rule = weight_functions.WeightFunctionRule(
                None, weight_functions.Exit(u.op, 0, (u.op,), (x,), False, shape), u=u)
        P = tf.reshape(piece, [-1] + self.output.shape.as_list())           # [G, *output]
        found = self._rule.pull_back(P)                                     # [G, *source]
        return found if grouped else found[0]


class Placed(registry_lib.Rule):
    """A rule whose weight input is a piece of the weight (`Slice`s and `Function`s,
    outermost last): its results are placed in the weight's shape; the other pieces'
    reads add theirs. A zero-padded gradient has the norm of the slice's; a function's
    does not (the norms are then formed)."""

    def __init__(self, rule, placements):
        self.rule, self.placements = rule, placements

    def _place(self, result, grouped):
        for placement in reversed(self.placements):
            result = placement.place(result, grouped)
        return result

    def per_group(self, use, dZ, G):
        return self._place(self.rule.per_group(use, dZ, G), True)

    def squared_norms(self, use, dZ, B):
        if any(isinstance(p, Function) for p in self.placements):
            return None
        return self.rule.squared_norms(use, dZ, B)

    def clipped_sum(self, use, dZ, factors):
        return self._place(self.rule.clipped_sum(use, dZ, factors), False)

"""The fallback protocol: what towers and row passes both offer the dispatch.

Notation:
    G   groups: B (per example) or M (microbatches)     x   one weight (entry of `xs`)

A builder of per-group gradients for the weights no rule computes (`Towers`,
`RowPasses`) has `xs` (the weights it computes) and `gradients(grad_ys=None,
unconnected_gradients="zero", name=None, sparse=False)`, one [G, *x.shape] entry per
x; this base adds the norms and the clipped sum from those gradients, formed once:

    squares_i = ||g_i(x)||^2 per x, [G]      clipped sum = sum_i f_i g_i(x), [*x.shape]

`stacked` is `ys` recomputed slice by slice, [B, ...], when the builder replays the
model (towers), else None; `checks_batch` says whether it checks the fed batch size
itself (the towers do where they split the batch); `scope` is the name scope of its
gradients inside the dispatch's.
"""

import tensorflow as tf

__all__ = ["PerGroupGradients"]


class PerGroupGradients:
    """Base of the fallback builders (see the module notes)."""

    stacked = None
    checks_batch = False
    scope = "fallback"

    def formed(self, name=None):
        """{i: [G, *xs[i].shape]}: the dense per-group gradients of this builder's
        weights (those without a gradient left out)."""
        grads = self.gradients(name=name)
        return {i: g for i, g in enumerate(grads) if g is not None}

    @staticmethod
    def squared_norms(formed):
        """{i: [G]}: the squared norm of each group's gradient of xs[i], from `formed`."""
        # [G, *x.shape] -> [G]
        return {i: tf.reduce_sum(tf.square(g), axis=list(range(1, g.shape.rank)))
                for i, g in formed.items()}

    @staticmethod
    def clipped_sum(formed, factors):
        """{i: [*xs[i].shape]}: sum_g f_g grad_g(xs[i]), from `formed` and the [G]
        factors f."""
        # [G] x [G, *x.shape] -> [*x.shape]
        return {i: tf.tensordot(tf.cast(factors, g.dtype), g, axes=1)
                for i, g in formed.items()}

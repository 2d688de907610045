"""The fallback builders: per-group gradients for the weights no rule computes.

Notation:
    B   examples in the batch          G   groups: B (per example) or M (microbatches)
    x   one weight (entry of `xs`)     ys  per-example values, [B, ...]
    w   grad_ys, [B, ...] (ones when not given)
    m_g the indicator of group g's rows, [B] (group g holds rows g*B/G ... (g+1)*B/G - 1)

A builder (`pertower.Towers`, `RowPasses`) has `xs` and `gradients(grad_ys=None,
unconnected_gradients="zero", name=None, sparse=False)`, one [G, *x.shape] entry per x;
`stacked` is `ys` recomputed slice by slice, [B, ...] (towers), or None; `checks_batch`
says whether it checks the fed batch size itself; `scope` names its gradients' scope.

Row passes serve the weights behind a TF1 (v1) while loop, which neither a rule nor the
towers (a replayed loop has no Python-side WhileContext) can compute. `tf.gradients`
through the ORIGINAL loop works, and by linearity

    d sum(w * m_g * ys) / dx  =  sum over the rows i of group g of  d sum(w_i * ys_i) / dx,

group g's gradient whenever row i of `ys` depends on example i alone (proven by
`pertower._batch_axis`, or checked at run time): one backward pass per group.
"""

import tensorflow as tf

from pertower._towers import sparse as sparse_lib

__all__ = ["PerGroupGradients", "RowPasses"]


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


class RowPasses(PerGroupGradients):
    """G backward passes of the original graph, one per group of rows of `ys` [B, ...]
    (B = `batch_size`, static; G = `num_groups`), for the weights `xs`."""

    scope = "row_passes"

    def __init__(self, ys, xs, batch_size, num_groups):
        self.ys = ys
        self.xs = list(xs)
        self.batch_size = batch_size
        self.num_groups = num_groups

    def gradients(self, grad_ys=None, unconnected_gradients="zero", name=None, sparse=False):
        """[G, *x.shape] per x: entry g is d sum(grad_ys * ys over group g's rows) / dx
        (the module docstring); `sparse` is ignored."""
        B, G = self.batch_size, self.num_groups
        ys = self.ys
        with tf.name_scope(name or "row_passes"):
            weights = tf.ones_like(ys) if grad_ys is None else tf.convert_to_tensor(
                grad_ys, dtype=ys.dtype)
            rank = ys.shape.rank
            group_of_row = tf.range(B) // (B // G)                       # [B]
            per_group = []   # G x (one entry per x)
            for g in range(G):
                with tf.name_scope(f"group_{g}"):
                    mask = tf.cast(tf.equal(group_of_row, g), ys.dtype)  # [B]
                    # [B] -> [B, 1, ..., 1] to broadcast over ys, [B, ...]
                    mask = tf.reshape(mask, [B] + [1] * (rank - 1) if rank is not None
                                      else tf.concat([[B], tf.ones(
                                          [tf.rank(ys) - 1], tf.int32)], axis=0))
                    grads = tf.gradients(ys, self.xs, grad_ys=weights * mask,
                                         unconnected_gradients=unconnected_gradients)
                    per_group.append([None if grad is None else sparse_lib.dense_rows(grad, x)
                                      for grad, x in zip(grads, self.xs)])
            results = []
            for k in range(len(self.xs)):
                entries = [row[k] for row in per_group]
                # G x [*x.shape] -> [G, *x.shape]
                results.append(None if any(e is None for e in entries)
                               else tf.stack(entries, axis=0))
            return results

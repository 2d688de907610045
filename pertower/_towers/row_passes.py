"""Row passes: per-group gradients from G backward passes of the original graph.

Notation:
    B   examples in the batch          G   groups: B (per example) or M (microbatches)
    x   one weight (entry of `xs`)     ys  per-example values, [B, ...]
    w   grad_ys, [B, ...] (ones when not given)
    m_g the indicator of group g's rows, [B] (group g holds rows g*B/G ... (g+1)*B/G - 1)

The fallback for weights that neither a rule nor the towers can compute: a TF1 (v1)
while loop (Enter/Exit/NextIteration/LoopCond, as built under
`tf.compat.v1.disable_v2_behavior()`, or restored from a meta graph) lies between the
batch and `ys`. `tf.gradients` cannot target a tensor inside such a loop from outside
(so the rules get no dZ there), and a replayed copy of the loop has no Python-side
WhileContext (so the towers' backward pass cannot be built). But `tf.gradients`
through the loop of the ORIGINAL graph works, and by linearity of the backward pass

    d sum(w * m_g * ys) / dx  =  sum over the rows i of group g of  d sum(w_i * ys_i) / dx,

which is group g's gradient whenever row i of `ys` depends on example i alone (proven
by `pertower._batch_axis`, or checked at run time by `validate`): the other rows
contribute nothing to group g's gradient because their weights in m_g are zero, and
row i computed on the whole batch equals row i computed on example i alone. Each group
costs one backward pass (G passes, as the towers cost G backward passes); no op of the
user's graph is copied or changed (each `tf.gradients` call only adds its own ops,
such as the loop's stacks of forward values, as any training op does).
"""

import tensorflow as tf

from pertower._towers import fallback
from pertower._towers import sparse

__all__ = ["RowPasses"]


class RowPasses(fallback.PerGroupGradients):
    """G backward passes of the original graph, one per group of rows of `ys`; a fallback
    builder (`pertower._towers.fallback`: the norms and clipped sum from `gradients`).

    Attributes:
      ys: the per-example values, [B, ...].
      xs: the weights these passes compute (a list).
      batch_size: B (static).
      num_groups: G.
    """

    scope = "row_passes"

    def __init__(self, ys, xs, batch_size, num_groups):
        self.ys = ys
        self.xs = list(xs)
        self.batch_size = batch_size
        self.num_groups = num_groups

    def gradients(self, grad_ys=None, unconnected_gradients="zero", name=None, sparse=False):
        """[G, *x.shape] per x: entry g is d sum(grad_ys * ys over group g's rows) / dx.

        Args:
          grad_ys: None (ones) or a tensor shaped like `ys`, [B, ...].
          unconnected_gradients: "zero" or "none", as in `tf.gradients`.
          name: name scope.
          sparse: ignored (the passes give dense gradients), for the fallback protocol.

        Returns:
          One entry per x: [G, *x.shape], or None for a weight `ys` does not reach
          with unconnected_gradients="none".
        """
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
                    per_group.append([_dense(grad, x) for grad, x in zip(grads, self.xs)])
            results = []
            for k in range(len(self.xs)):
                entries = [row[k] for row in per_group]
                if any(e is None for e in entries):
                    results.append(None)
                else:
                    # G x [*x.shape] -> [G, *x.shape]
                    results.append(tf.stack(entries, axis=0))
            return results


def _dense(gradient, x):
    """A pass's gradient as a dense tensor of x's shape (None stays None)."""
    if gradient is None:
        return None
    return sparse.dense_rows(gradient, x)

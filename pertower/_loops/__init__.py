"""Weights read inside loops: a TF2 `While` (Keras GRU/LSTM, `tf.while_loop`) or a TF1
frame (`dynamic_rnn`), on the rules with per-step A and dZ.

Notation:
    B   examples in the batch          k   rows per example of one step's A and Z
    T   iterations the loop ran        W   a weight read in the body by an op with a rule
    ε   zeros [T, B*k, *z] added to a covered op's output: Z_t + ε[t]

A rule needs, for every read of W, the op's batch-side input A and dZ, the gradient of
sum(ys) at its output; inside a loop both exist once per step, out of `tf.gradients`'
reach. Example i's rows of step t are its own (proven while planning), so

    grad_i(W) = sum over t of rule(A_t, dZ_t) for example i = rule(A_all, dZ_all),

with the steps laid out example-major ([T, B*k, ...] -> [B*k*T, ...]): the op's own rule,
unchanged (a dense read is Goodfellow's sum of outer products over its k*T rows, arXiv
1510.01799; its norm the ghost norm of Li et al. 2022, arXiv 2110.05679; a clipped sum
the reweighted batch gradient, Bu et al. 2023, arXiv 2210.00038). No per-example pass,
and the lists are sized by the fed batch, so no batch_size is needed.

One plan for both kinds (`uses.LoopPlan`: which reads of W the body has, through which
layout ops, slices and functions of W, each read's rule and k; a rule that reads more
than A and dZ, a broadcast op's or a convolution's, is given an op rebuilt on A_all,
`step_rules`; A_t and Z_t of a product with W on the left carry the batch on axis 1,
stacked along it) and one mechanism per kind that builds A_all and dZ_all:
- TF2 `While` (`while_v2.WhileLoop`): the loop's own backward (`backward.OwnBackward`,
  while_v2's `_WhileGrad` rebuilt, each covered read's dZ_t and A_t pushed to lists);
  fallback (way `loop_backward` of `pertower._tf`): the copy below.
- TF1 frame (`frames.Frame`), and the TF2 fallback: the loop's copy (`copy.BuiltCopy`),
  a control flow v2 loop replaying the body's ops with Z_t + ε[t] and A_t pushed; since
  ε = 0 it computes what the loop computes, and d sum(ys) / dε[t] = dZ_t, all steps from
  one backward pass of the copy. Fallback (way `loop_copy`): the weights stay on
  pertower's fallback method (towers or row passes).
Either pass also gives the gradients at the tensors before the loop along the paths
through it (`uses.output_gradients`). The user's loop is only read (a TF2 one gets the
edit any `tf.gradients` through it makes, `pertower._towers.later_gradients`).
"""

from pertower._loops.uses import LoopUse, concrete_uses, differentiated, output_gradients
from pertower._loops.weights import Loops

__all__ = ["LoopUse", "Loops", "concrete_uses", "differentiated", "output_gradients"]

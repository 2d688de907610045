"""Gradient analytics on per-example gradients: influence, similarity, Fisher, noise, NTK.

Notation (of every module here):
    B   examples              g_i  example i's gradient over all weights, flattened [P]
    x   one weight            ḡ    the batch mean (1/B) sum_i g_i
    G   the true (expected) gradient, Σ the covariance of one example's gradient

Every function is a graph op on a per-example gradient (one [B, *x.shape] tensor per
weight, as `pertower.per_example_gradients` returns) or on per-example Jacobians; the
pairwise products are `pertower._reductions`'.
"""

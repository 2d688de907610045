"""Per-example gradient norms: the L2 norm of each example's whole gradient.

Notation:
    B   examples in the batch       x   one weight (entry of `xs`)
    g_i the gradient of example i's value with respect to all of xs, flattened
    A   a layer's input             dZ  the gradient at its output (one batched pass)

    norms[i] = ||g_i||_2 = sqrt(sum_x ||d sum(ys[i]) / d x||^2)

A weight covered by a rule with a cheap form never has its per-example gradients
formed: a dense layer gives ||a_i||^2 ||dz_i||^2 (Goodfellow 2015, arXiv 1510.01799), a
dense layer on sequences the ghost norm sum_{t,s} (a_it·a_is)(dz_it·dz_is) (Li et al.
2021, arXiv 2110.05679), an embedding the ghost norm with the indicator [id_t = id_s].
Other weights are formed ([B, *x.shape], by their rule or the towers) and reduced.
"""

import tensorflow as tf

from pertower import _checks
from pertower import _docs
from pertower import _dispatch
from pertower import _request
from pertower import _context

__all__ = ["per_example_norms"]


@_context.public("per_example_norms")
@_docs.documented
def per_example_norms(ys, xs, batch=None, batch_size=None, name=None, method="auto",
                      validate=None, memory_limit=None, devices=None, rules=None,
                      batch_axis=None, per_weight=False):
    """The L2 norm of each example's gradient over all of `xs`, [B] (or [B, len(xs)]).

    Args:
      ys, xs: as in `pertower.per_example_gradients`; a weight `ys` does not reach adds
        0, and a UserWarning names such weights.
      {options: batch, batch_size, name, method, validate, devices, rules, batch_axis}
      memory_limit: as in `pertower.per_example_gradients`, for the per-example
        gradients the norms need to hold: those of the weights left to towers.
      per_weight: False (default) for one norm per example over all of `xs`; True for
        one norm per example and weight, from the same squares (per-layer clipping).
        A PartitionedVariable counts as its parts.

    Returns:
      A [B] tensor of ys's dtype: entry i is the L2 norm of the concatenation of
      `tf.gradients(tf.reduce_sum(ys[i]), x)` over every x, for example i alone. With
      per_weight, [B, len(xs)]: entry [i, k] the norm over xs[k] alone (0 where ys does
      not reach xs[k]).

    Example (per-example clipping factors for DP-SGD):
      norms = pertower.per_example_norms(loss, model.trainable_weights)   # [B]
      factors = tf.minimum(1.0, clip / (norms + 1e-12))                  # [B]
      per_layer = pertower.per_example_norms(loss, weights, per_weight=True)  # [B, K]
    """
    if not isinstance(per_weight, bool):
        raise _context.error(TypeError, "`per_weight` must be True or False, but received "
                             f"{type(per_weight).__name__} ({per_weight!r:.80}).")
    devices, partitions, plan = _dispatch.plan_call(
        ys, xs, devices, _request.Examples(batch, batch_size, None, batch_axis),
        _dispatch.options(method, rules, validate=validate, memory_limit=memory_limit,
                          forms_gradients=False))
    xs = partitions.flat   # a PartitionedVariable's parts
    with plan.request.graph.as_default(), tf.name_scope(name or _context.name()):
        built = _dispatch.build(plan, devices)
        # [B], or [B, K] per weight
        norms = tf.sqrt(built.squared_norms(name="gradients", per_weight=per_weight))
        _checks.warn_unconnected(ys, xs, _checks.UNCONNECTED_DEFAULT,
                                 outcome="they add 0 to the norms",
                                 reads=plan.request.reads)
        return built.validated([norms])[0]

"""Per-example gradients, per-example Jacobians and microbatch gradients.

Notation: B examples, M microbatches (groups of B/M examples), K output entries per
example (prod(ys.shape[1:])), x one weight. Each plans and builds through the one
dispatch (`pertower._dispatch`).
"""

import numpy as np
import tensorflow as tf

from pertower import _checks
from pertower import _docs
from pertower import _dispatch
from pertower import _request
from pertower import _context

__all__ = ["per_example_gradients", "per_example_jacobians", "microbatch_gradients"]

# The methods every gradient function takes (described in `pertower._docs`).
METHODS = _request.METHODS


@_context.public("per_example_gradients")
@_docs.documented
def per_example_gradients(ys, xs, batch=None, batch_size=None,
                          unconnected_gradients=_checks.UNCONNECTED_DEFAULT, name=None,
                          method="auto", validate=None, memory_limit=None, sparse=False,
                          devices=None, rules=None, batch_axis=None):
    """The gradient of each example's value with respect to each weight.

    Args:
      ys: per-example values, [B, ...]; each example's entries are summed.
      xs: a variable or tensor, or a list of them (e.g. `model.trainable_weights`).
      {options: batch, batch_size, unconnected_gradients, name, method, validate,
                memory_limit, sparse, devices, rules, batch_axis}

    Returns:
      A list with one tensor per entry of `xs`, [B, *x.shape], x's dtype: entry i is
      `tf.gradients(tf.reduce_sum(ys[i]), x)` computed for example i alone.

    Example:
      cost = (net(x) - y) ** 2                                   # [B, 1]
      grads = pertower.per_example_gradients(cost, net.trainable_weights,
                                             batch_size=32)      # [32, *w.shape] each
      sess.run(grads, {x: X[:32], y: Y[:32]})
    """
    return _group_gradients(ys, xs, batch, batch_size, None, unconnected_gradients, name,
                            method, validate, memory_limit, sparse, devices, rules,
                            batch_axis)


def _group_gradients(ys, xs, batch, batch_size, num_groups, unconnected_gradients, name,
                     method, validate, memory_limit, sparse, devices, rules, batch_axis,
                     K=None):
    """The three public functions: [G, *x.shape] per x (G = B or M), or with the K
    outputs per example of Jacobians, [B, *out, *x.shape]."""
    _checks.unconnected_gradients_value(unconnected_gradients)
    devices, partitions, plan = _dispatch.plan_call(
        ys, xs, devices, _request.Examples(batch, batch_size, num_groups, batch_axis),
        _dispatch.options(method, rules, sparse=sparse, validate=validate,
                          memory_limit=memory_limit, outputs_per_example=K or 1))
    with plan.request.graph.as_default(), tf.name_scope(name or _context.name()):
        built = _dispatch.build(plan, devices)
        results = (_jacobian_rows(built, ys, unconnected_gradients) if K is not None else
                   built.gradients(unconnected_gradients=unconnected_gradients,
                                   name="gradients", sparse=sparse))
        _checks.warn_unconnected(ys, partitions.flat, unconnected_gradients,
                                 reads=plan.request.reads)
        # [G, *out, *partition.shape] each -> [G, *out, *x.shape] per PartitionedVariable
        return partitions.join(built.validated(results),
                               lead=1 if K is None else max(ys.shape.rank, 1))


@_context.public("microbatch_gradients")
@_docs.documented
def microbatch_gradients(ys, xs, batch=None, batch_size=None, num_microbatches=None,
                         unconnected_gradients=_checks.UNCONNECTED_DEFAULT, name=None,
                         method="auto", validate=None, memory_limit=None, sparse=False,
                         devices=None, rules=None, batch_axis=None):
    """The gradient of the sum of `ys` over each of M contiguous, equal microbatches.

    Args:
      ys, xs: as in `per_example_gradients`.
      {options: batch, batch_size, unconnected_gradients, name, method, validate,
                memory_limit, sparse, devices, rules, batch_axis}
      num_microbatches: M, which must divide B; microbatch m holds examples
        m*B/M ... (m+1)*B/M - 1. None means one microbatch per example (M = B), as in
        TensorFlow Privacy. When `ys` joins several batches along axis 0, no
        microbatch may straddle two of them: with two batches of equal size, M = 2
        gives each batch's gradient; other sizes are refused naming the valid M.
        With sparse=True, `example_ids` are microbatch ids (tower m is microbatch m).

    Returns:
      A list with one tensor per entry of `xs`, [M, *x.shape].

    Example (two batches of the same network, and the cosine of their gradients):
      s = tf.concat([s1, s2], axis=0)                            # [2 * n, 3]
      g = pertower.microbatch_gradients(f(s), weights, batch=s, num_microbatches=2,
                                        batch_size=2 * n)
      cos = pertower.cosine_similarity([w[0] for w in g], [w[1] for w in g])
    """
    return _group_gradients(ys, xs, batch, batch_size, num_microbatches,
                            unconnected_gradients, name, method, validate, memory_limit,
                            sparse, devices, rules, batch_axis)


@_context.public("per_example_jacobians")
@_docs.documented
def per_example_jacobians(ys, xs, batch=None, batch_size=None,
                          unconnected_gradients=_checks.UNCONNECTED_DEFAULT, name=None,
                          method="auto", validate=None, memory_limit=None, devices=None,
                          rules=None, batch_axis=None):
    """The Jacobian of each example's outputs with respect to each weight (dy/dθ).

    Args:
      ys: per-example outputs, [B, *out]; `out` must be static (K = prod(out)).
      xs: as in `per_example_gradients`.
      {options: batch, batch_size, unconnected_gradients, name, method, validate,
                memory_limit, devices, rules, batch_axis}

    Returns:
      A list with one tensor per entry of `xs`, [B, *out, *x.shape]: entry
      [i, k..., :] is d ys[i, k...] / d x computed for example i alone. For ys of
      shape [B] this is the per-example gradient.

    Example:
      jac = pertower.per_example_jacobians(model(x), model.trainable_weights,
                                           batch_size=16)        # [16, 10, *w.shape]
    """
    _checks.require_graph_mode()
    if isinstance(ys, tf.Tensor) and (ys.shape.rank is None or (
            ys.shape.rank > 0 and not ys.shape[1:].is_fully_defined())):
        raise _context.error(
            ValueError, f"the output axes of `ys` ({ys.name}, shape {ys.shape}) must be "
            "static to build one gradient per output entry; give the model's output layer "
            "a fixed size, or reshape `ys` to a static shape.")
    K = int(np.prod(ys.shape[1:].as_list(), dtype=np.int64)) if isinstance(
        ys, tf.Tensor) and ys.shape.rank else 1
    return _group_gradients(ys, xs, batch, batch_size, None, unconnected_gradients, name,
                            method, validate, memory_limit, False, devices, rules,
                            batch_axis, K=K)


def _jacobian_rows(built, ys, unconnected_gradients):
    """One `built.gradients` call per output entry, stacked to [B, *out, *x.shape]."""
    out = ys.shape[1:].as_list()
    if not out:
        return built.gradients(unconnected_gradients=unconnected_gradients, name="gradients")
    K = int(np.prod(out, dtype=np.int64))
    B = built.batch_size
    with tf.name_scope("rows"):
        shape = [B] + out if B is not None else tf.stack([tf.shape(ys)[0]] + out)
        rows = []  # K x (list per x of [B, *x.shape])
        for k in range(K):
            # one-hot on output entry k for every example: [B, *out]
            one_hot = tf.broadcast_to(tf.reshape(tf.one_hot(k, K, dtype=ys.dtype), out),
                                      shape)
            rows.append(built.gradients(grad_ys=one_hot,
                                        unconnected_gradients=unconnected_gradients,
                                        name=f"row_{k}"))
        results = []
        for k_x, x in enumerate(built.xs):
            per_k = [row[k_x] for row in rows]
            if any(g is None for g in per_k):
                results.append(None)
                continue
            stacked = tf.stack(per_k, axis=1)  # K x [B, *x.shape] -> [B, K, *x.shape]
            if x.shape.is_fully_defined() and B is not None:
                new_shape = [B] + out + x.shape.as_list()
            else:
                new_shape = tf.concat([tf.shape(stacked)[:1], out, tf.shape(x)], axis=0)
            # [B, K, *x.shape] -> [B, *out, *x.shape]
            results.append(tf.reshape(stacked, new_shape))
        return results

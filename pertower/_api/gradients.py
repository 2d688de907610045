"""Per-example gradients, per-example Jacobians and microbatch gradients.

Notation:
    B   examples in the batch       M   microbatches (groups of B/M examples)
    K   output entries per example, prod(ys.shape[1:])
    x   one weight                  [B, *x.shape] one gradient of x per example

Each public function checks its arguments, plans and builds through the one dispatch
(`pertower._dispatch`: request -> plan -> guards -> rules and towers), under one name
scope (`name`, default the function's name) with `towers/` and `gradients/` inside.
"""

import contextlib

import numpy as np
import tensorflow as tf

from pertower import _checks
from pertower import _dispatch
from pertower import _request
from pertower import _context

__all__ = ["per_example_gradients", "per_example_jacobians", "microbatch_gradients"]

# The methods every gradient function takes (see `pertower._dispatch`).
METHODS = _dispatch.METHODS


def _graph_of(ys):
    """The graph of `ys` as the default graph (a no-op context for bad input, which
    the argument checks then refuse with their own message)."""
    graph = getattr(ys, "graph", None)
    if isinstance(ys, tf.Tensor) and isinstance(graph, tf.Graph):
        return graph.as_default()
    return contextlib.nullcontext()


@_context.public("per_example_gradients")
def per_example_gradients(ys, xs, batch=None, batch_size=None,
                          unconnected_gradients=_checks.UNCONNECTED_DEFAULT, name=None,
                          method="auto", validate=None, memory_limit=None, sparse=False,
                          devices=None, rules=None, batch_axis=None):
    """The gradient of each example's value with respect to each weight.

    Args:
      ys: per-example values, [B, ...]; each example's entries are summed.
      xs: a variable or tensor, or a list of them (e.g. `model.trainable_weights`).
      batch: the tensor(s) carrying the batch on axis 0 that `ys` depends on; when
        None they are found by walking back from `ys` to its placeholders and
        `tf.data` iterator outputs.
      batch_size: B. With a None batch axis it may be left out when no weight falls
        back to towers: the gradients then work for any fed batch size
        ([None, *x.shape]). When some weights fall back (see `pertower.explain`), the
        towers are built for exactly B examples and feeding another size fails in
        `sess.run`; without it the call is refused, listing those weights.
        When `ys` joins several batches along axis 0 (`tf.concat([f(s1), f(s2)], 0)`:
        its rows are the examples of s1, then those of s2, B = B1 + B2) it may be a
        list with one size per batch tensor, parallel to `batch` (an int gives every
        batch tensor that size); those weights are computed by towers.
      unconnected_gradients: "zero" (zeros for a weight `ys` does not reach) or
        "none" (None for it), as in `tf.gradients`. Left out, it is "zero" and a
        UserWarning names the weights `ys` does not reach (for example optimizer
        slots from `tf.compat.v1.global_variables()`); pass "zero" to keep the zeros
        without the warning.
      name: name scope for the new ops.
      method: "auto" (default: per-op rules where they are proven sound, towers for
        the other weights), "rules" (strict: refused, listing every weight no rule
        covers and why) or "towers" (replay the model once per example on weight
        copies).
      validate: None (default): where the static analysis cannot prove that row i of
        `ys` depends on example i alone, a run-time check is added (with a warning
        naming the op where the proof was lost): fetching the result first checks
        that `ys` recomputed slice by slice equals `ys` and fails naming the largest
        difference otherwise. True: always add the check. False: never.
      memory_limit: refuse when the estimated bytes (see `pertower.estimate_memory`)
        exceed this; None means half of the machine's physical memory,
        float("inf") switches the guard off.
      sparse: False (default) for dense results only; True to get, for each weight
        read only by gathers (an embedding), a `pertower.PerExampleIndexedSlices`
        holding just the looked-up rows (see `pertower.sparse`); other weights stay
        dense. Such weights are computed by towers.
      devices: None, or device strings: tower t (one per example) runs on
        devices[t % len(devices)] (see `build_towers`); rules run as one batched
        computation where TensorFlow places it.
      rules: a `pertower.rules.RuleRegistry` (default
        `pertower.rules.default_registry()`), to add rules for your own ops.
      batch_axis: None (default: the batch is axis 0 of every batch tensor), an int
        (the batch axis of every batch tensor, e.g. 1 for time-major [T, B, d] inputs
        of `tf.compat.v1.nn.static_rnn` or `time_major=True`), or a list with one axis
        per batch tensor, parallel to `batch`. `ys` always keeps the batch on axis 0:
        transpose a time-major `ys` first.

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
                     method, validate, memory_limit, sparse, devices, rules, batch_axis=None):
    """`per_example_gradients` (num_groups None) and `microbatch_gradients`: [G, *x.shape]
    per x, G = B or M."""
    _checks.require_graph_mode()
    devices = _checks.device_list(devices)
    _checks.unconnected_gradients_value(unconnected_gradients)
    partitions = _checks.Partitions(_checks.as_list(xs))   # PartitionedVariables split
    xs = partitions.flat
    plan = _dispatch.make_plan(_request.make_request(
        ys, xs, batch, batch_size, num_groups, method=method, rules=rules, sparse=sparse,
        validate=validate, memory_limit=memory_limit, batch_axis=batch_axis))
    with _graph_of(ys), tf.name_scope(name or _context.name()):
        built = _dispatch.build(plan, devices)
        results = built.gradients(unconnected_gradients=unconnected_gradients,
                                  name="gradients", sparse=sparse)
        _checks.warn_unconnected(ys, xs, unconnected_gradients, reads=plan.request.reads)
        # [G, *partition.shape] each -> [G, *x.shape] per PartitionedVariable
        return partitions.join(built.validated(results))


@_context.public("microbatch_gradients")
def microbatch_gradients(ys, xs, batch=None, batch_size=None, num_microbatches=None,
                         unconnected_gradients=_checks.UNCONNECTED_DEFAULT, name=None,
                         method="auto", validate=None, memory_limit=None, sparse=False,
                         devices=None, rules=None, batch_axis=None):
    """The gradient of the sum of `ys` over each of M contiguous, equal microbatches.

    Args:
      ys, xs, batch, batch_size, unconnected_gradients, name, method, validate,
        memory_limit, sparse, devices, rules, batch_axis: as in `per_example_gradients` (with
        sparse=True, `example_ids` are microbatch ids; tower m is microbatch m).
      num_microbatches: M, which must divide B; microbatch m holds examples
        m*B/M ... (m+1)*B/M - 1. None means one microbatch per example (M = B), as in
        TensorFlow Privacy. When `ys` joins several batches along axis 0, no
        microbatch may straddle two of them: with two batches of equal size, M = 2
        gives each batch's gradient; other sizes are refused naming the valid M.

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
def per_example_jacobians(ys, xs, batch=None, batch_size=None,
                          unconnected_gradients=_checks.UNCONNECTED_DEFAULT, name=None,
                          method="auto", validate=None, memory_limit=None, devices=None,
                          rules=None, batch_axis=None):
    """The Jacobian of each example's outputs with respect to each weight (dy/dθ).

    Args:
      ys: per-example outputs, [B, *out]; `out` must be static (K = prod(out)).
      xs, batch, batch_size, unconnected_gradients, name, method, validate,
        memory_limit, devices, rules, batch_axis: as in `per_example_gradients`.

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
    devices = _checks.device_list(devices)
    _checks.unconnected_gradients_value(unconnected_gradients)
    partitions = _checks.Partitions(_checks.as_list(xs))   # PartitionedVariables split
    xs = partitions.flat
    plan = _dispatch.make_plan(_request.make_request(
        ys, xs, batch, batch_size, None, method=method, rules=rules, validate=validate,
        memory_limit=memory_limit, outputs_per_example=K, batch_axis=batch_axis))
    with _graph_of(ys), tf.name_scope(name or _context.name()):
        built = _dispatch.build(plan, devices)
        results = _jacobian_rows(built, ys, unconnected_gradients)
        _checks.warn_unconnected(ys, xs, unconnected_gradients, reads=plan.request.reads)
        # [B, *out, *partition.shape] each -> [B, *out, *x.shape] per PartitionedVariable
        return partitions.join(built.validated(results), lead=max(ys.shape.rank, 1))


def _jacobian_rows(built, ys, unconnected_gradients):
    """One `built.gradients` call per output entry, stacked to [B, *out, *x.shape]."""
    out = ys.shape[1:].as_list()
    K = int(np.prod(out, dtype=np.int64))
    B = built.batch_size
    if not out:
        return built.gradients(unconnected_gradients=unconnected_gradients, name="gradients")
    with tf.name_scope("rows"):
        rows_B = B if B is not None else tf.shape(ys)[0]
        rows = []  # K x (list per x of [B, *x.shape])
        for k in range(K):
            # one-hot on output entry k for every example: [B, *out]
            one_hot = tf.broadcast_to(
                tf.reshape(tf.one_hot(k, K, dtype=ys.dtype), out),
                tf.stack([rows_B] + out) if B is None else [B] + out)
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

"""Per-example gradients, per-example Jacobians and microbatch gradients, from towers.

Notation:
    B   examples in the batch       M   microbatches (towers of B/M examples)
    K   output entries per example, prod(ys.shape[1:])
    x   one weight                  [B, *x.shape] one gradient of x per example

Each function builds towers (see `pertower.towers`) and takes one `tf.gradients` call
over all tower copies (one per output entry for Jacobians).
"""

import contextlib

import numpy as np
import tensorflow as tf

from pertower import _checks
from pertower import independence
from pertower import memory
from pertower import towers as towers_lib

__all__ = ["per_example_gradients", "per_example_jacobians", "microbatch_gradients"]

# The ways to compute per-example gradients; "auto" picks per weight.
METHODS = ("auto", "towers", "rules")


def check_method(method, function_name):
    """Validates the `method` argument; returns it."""
    if method not in METHODS:
        raise ValueError(
            f"pertower.{function_name}: `method` must be one of {METHODS}, got {method!r}.")
    if method == "rules":
        raise NotImplementedError(
            f"pertower.{function_name}: method='rules' is not built yet; use 'towers'.")
    return method


def per_example_gradients(ys, xs, batch=None, batch_size=None,
                          unconnected_gradients="zero", name=None, method="auto",
                          validate=False, memory_limit=None, sparse=False, devices=None):
    """The gradient of each example's value with respect to each weight.

    Args:
      ys: per-example values, [B, ...]; each example's entries are summed.
      xs: a variable or tensor, or a list of them (e.g. `model.trainable_weights`).
      batch: the tensor(s) carrying the batch on axis 0 that `ys` depends on; when
        None they are found by walking back from `ys` to its placeholders and
        `tf.data` iterator outputs.
      batch_size: B, needed when the batch axis is not static (then the towers are
        built for exactly B examples and feeding another size fails in `sess.run`).
      unconnected_gradients: "zero" (zeros for a weight `ys` does not reach) or
        "none" (None for it), as in `tf.gradients`.
      name: name scope for the new ops.
      method: "towers" (replay the model once per example on weight copies), "rules"
        (per-op rules from one batched backward pass) or "auto" (rules where they
        apply, towers elsewhere).
      validate: when True, fetching the result first checks at run time that `ys`
        recomputed slice by slice equals `ys` (see `pertower.check_independence`) and
        fails naming the largest difference otherwise.
      memory_limit: refuse when the estimated bytes (see `pertower.estimate_memory`)
        exceed this; None means half of the machine's physical memory,
        float("inf") switches the guard off.
      sparse: False (default) for dense results only; True to get, for each weight
        read only by gathers (an embedding), a `pertower.PerExampleIndexedSlices`
        holding just the looked-up rows (see `pertower.sparse`); other weights stay
        dense.
      devices: None, or device strings: tower t (one per example) runs on
        devices[t % len(devices)] (see `build_towers`).

    Returns:
      A list with one tensor per entry of `xs`, [B, *x.shape], x's dtype: entry i is
      `tf.gradients(tf.reduce_sum(ys[i]), x)` computed for example i alone (or a
      `PerExampleIndexedSlices` with dense_shape [B, *x.shape] when sparse=True).

    Example:
      cost = (net(x) - y) ** 2                                   # [B, 1]
      grads = pertower.per_example_gradients(cost, net.trainable_weights,
                                             batch_size=32)      # [32, *w.shape] each
      sess.run(grads, {x: X[:32], y: Y[:32]})
    """
    function_name = "per_example_gradients"
    check_method(method, function_name)
    _checks.require_graph_mode(function_name)
    memory.check_memory(ys, xs, batch, batch_size, None, 1, memory_limit, function_name)
    with _graph_of(ys), tf.name_scope(name or function_name):
        towers = towers_lib.build(ys, xs, batch, None, batch_size, "towers",
                                  function_name, "batch_size", devices)
        results = towers.gradients(unconnected_gradients=unconnected_gradients,
                                   name="gradients", sparse=sparse)
        return _validated(results, towers, validate, function_name)


def _graph_of(ys):
    """The graph of `ys` as the default graph (a no-op context for bad input, which
    `towers.build` then refuses with its own message)."""
    graph = getattr(ys, "graph", None)
    if isinstance(ys, tf.Tensor) and isinstance(graph, tf.Graph):
        return graph.as_default()
    return contextlib.nullcontext()


def microbatch_gradients(ys, xs, batch=None, num_microbatches=None, batch_size=None,
                         unconnected_gradients="zero", name=None, method="auto",
                         validate=False, memory_limit=None, sparse=False, devices=None):
    """The gradient of the sum of `ys` over each of M contiguous, equal microbatches.

    Args:
      ys, xs, batch, batch_size, unconnected_gradients, name, method, validate,
        memory_limit, sparse, devices: as in `per_example_gradients` (with sparse=True, `example_ids` are
        microbatch ids); tower m is microbatch m.
      num_microbatches: M, which must divide B; microbatch m holds examples
        m*B/M ... (m+1)*B/M - 1. None means one microbatch per example (M = B), as in
        TensorFlow Privacy.

    Returns:
      A list with one tensor per entry of `xs`, [M, *x.shape].

    Example (two batches of the same network, and the cosine of their gradients):
      s = tf.concat([s1, s2], axis=0)                            # [2 * n, 3]
      g = pertower.microbatch_gradients(f(s), weights, batch=s, num_microbatches=2,
                                        batch_size=2 * n)
      cos = pertower.cosine_similarity([w[0] for w in g], [w[1] for w in g])
    """
    function_name = "microbatch_gradients"
    check_method(method, function_name)
    _checks.require_graph_mode(function_name)
    memory.check_memory(ys, xs, batch, batch_size, num_microbatches, 1, memory_limit,
                        function_name)
    with _graph_of(ys), tf.name_scope(name or function_name):
        towers = towers_lib.build(ys, xs, batch, num_microbatches, batch_size, "towers",
                                  function_name, "num_microbatches", devices)
        results = towers.gradients(unconnected_gradients=unconnected_gradients,
                                   name="gradients", sparse=sparse)
        return _validated(results, towers, validate, function_name)


def per_example_jacobians(ys, xs, batch=None, batch_size=None,
                          unconnected_gradients="zero", name=None, method="auto",
                          validate=False, memory_limit=None, devices=None):
    """The Jacobian of each example's outputs with respect to each weight (dy/dθ).

    Args:
      ys: per-example outputs, [B, *out]; `out` must be static (K = prod(out)).
      xs, batch, batch_size, unconnected_gradients, name, method, validate,
        memory_limit, devices: as in `per_example_gradients`.

    Returns:
      A list with one tensor per entry of `xs`, [B, *out, *x.shape]: entry
      [i, k..., :] is d ys[i, k...] / d x computed for example i alone. For ys of
      shape [B] this is the per-example gradient.

    Example:
      jac = pertower.per_example_jacobians(model(x), model.trainable_weights,
                                           batch_size=16)        # [16, 10, *w.shape]
    """
    function_name = "per_example_jacobians"
    check_method(method, function_name)
    if isinstance(ys, tf.Tensor) and (ys.shape.rank is None or (
            ys.shape.rank > 0 and not ys.shape[1:].is_fully_defined())):
        raise ValueError(
            f"pertower.{function_name}: the output axes of `ys` ({ys.name}, shape "
            f"{ys.shape}) must be static to build one gradient per output entry; give "
            "the model's output layer a fixed size, or reshape `ys` to a static shape.")
    _checks.require_graph_mode(function_name)
    K = int(np.prod(ys.shape[1:].as_list(), dtype=np.int64)) if isinstance(
        ys, tf.Tensor) and ys.shape.rank else 1
    memory.check_memory(ys, xs, batch, batch_size, None, K, memory_limit, function_name)
    with _graph_of(ys), tf.name_scope(name or function_name):
        towers = towers_lib.build(ys, xs, batch, None, batch_size, "towers", function_name,
                                  "batch_size", devices)
        results = _jacobian_rows(towers, ys, unconnected_gradients)
        return _validated(results, towers, validate, function_name)


def _validated(results, towers, validate, function_name):
    """`results`, gated on the run-time check that the towers reproduce `ys` when
    `validate` (see `pertower.independence`)."""
    if not validate:
        return results
    return independence.validated(results, towers.ys, towers.stacked, function_name)


def _jacobian_rows(towers, ys, unconnected_gradients):
    """One `towers.gradients` call per output entry, stacked to [B, *out, *x.shape]."""
    out = towers.stacked.shape[1:].as_list()
    K = int(np.prod(out, dtype=np.int64))
    B = towers.batch_size
    if not out:
        return towers.gradients(unconnected_gradients=unconnected_gradients, name="gradients")
    with tf.name_scope("rows"):
        rows = []  # K x (list per x of [B, *x.shape])
        for k in range(K):
            # one-hot on output entry k for every example: [B, *out]
            one_hot = tf.broadcast_to(
                tf.reshape(tf.one_hot(k, K, dtype=ys.dtype), out), [B] + out)
            rows.append(towers.gradients(grad_ys=one_hot,
                                         unconnected_gradients=unconnected_gradients,
                                         name=f"row_{k}"))
        results = []
        for k_x, x in enumerate(towers.xs):
            per_k = [row[k_x] for row in rows]
            if any(g is None for g in per_k):
                results.append(None)
                continue
            stacked = tf.stack(per_k, axis=1)  # K x [B, *x.shape] -> [B, K, *x.shape]
            if x.shape.is_fully_defined():
                new_shape = [B] + out + x.shape.as_list()
            else:
                new_shape = tf.concat([[B] + out, tf.shape(x)], axis=0)
            # [B, K, *x.shape] -> [B, *out, *x.shape]
            results.append(tf.reshape(stacked, new_shape))
        return results

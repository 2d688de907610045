"""Per-example gradients, per-example Jacobians and microbatch gradients.

Notation:
    B   examples in the batch       M   microbatches (groups of B/M examples)
    K   output entries per example, prod(ys.shape[1:])
    x   one weight                  [B, *x.shape] one gradient of x per example

Three methods (`method=`):
    "towers"  replay the model once per example (or microbatch) on weight copies
              (`pertower.towers`) and take one `tf.gradients` over all copies.
    "rules"   one batched `tf.gradients` to the outputs of the weight-consuming ops and
              a per-op rule for each (`pertower.rule_gradients`, `pertower.rules`);
              weights no rule covers soundly fall back to towers. `batch_size` may be
              left out for a None batch axis when no weight falls back: then the
              gradients work for any fed batch size.
    "auto"    (default) the same computation as "rules", with the towers' contract
              for `batch_size` (needed for a None batch axis; the fed size is checked).

Every call puts its ops under one name scope (`name`, default the function's name),
with `towers/` and `gradients/` inside it. Before building, `pertower.memory` refuses
results that would not fit; `validate=True` adds the run-time check of
`pertower.independence`.
"""

import contextlib

import numpy as np
import tensorflow as tf

from pertower import _checks
from pertower._guards import independence
from pertower._guards import memory
from pertower.rules import _engine as rule_gradients
from pertower._towers import build as towers_lib

__all__ = ["per_example_gradients", "per_example_jacobians", "microbatch_gradients"]

# The ways to compute per-example gradients; "auto" picks per weight.
METHODS = ("auto", "towers", "rules")


def check_method(method, function_name, rules=None):
    """Validates `method` (and that `rules` is only given to a method that uses it);
    returns the method."""
    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(
            f"pertower.{function_name}: `method` must be one of {METHODS}, got {method!r}.")
    if rules is not None and method == "towers":
        raise ValueError(
            f"pertower.{function_name}: `rules` is used by method='rules' or 'auto', but "
            "method='towers' was given; drop `rules` or choose another method.")
    return method


def require_batch_size_for_fallback(plan, function_name):
    """Raises when some weights fall back to towers but B is unknown."""
    prepared = plan.prepared
    if prepared.batch_size is not None or not plan.fallback:
        return
    listing = "; ".join(f"{prepared.xs[k].name}: {plan.reasons[k]}" for k in plan.fallback)
    names = ", ".join(t.name for t in prepared.batch)
    raise ValueError(
        f"pertower.{function_name}: the batch axis is not static ({names}) and no "
        "`batch_size` was given, which method='rules' allows only when every weight has "
        "a rule; these weights fall back to towers, which are built for a fixed number "
        f"of examples ({listing}). Pass batch_size=B.")


class _RulesAndTowers:
    """Gradients of covered weights from the rules, of the others from towers built for
    those weights only. Same `gradients` interface as `pertower.Towers`."""

    def __init__(self, plan, num_groups, function_name, groups_argument, devices=None):
        prepared = plan.prepared
        self.plan = plan
        self.xs = tuple(prepared.xs)
        self.ys = prepared.ys
        self.batch_size = prepared.batch_size
        self.covered = [k for k in range(len(self.xs)) if plan.uses[k] is not None]
        self.fallback = plan.fallback
        self.groups = rule_gradients.group_count(prepared, num_groups)
        self.function_name = function_name
        self.groups_argument = groups_argument
        self.towers = None
        if self.fallback:
            require_batch_size_for_fallback(plan, function_name)
            self.towers = towers_lib.build(
                prepared.ys, [self.xs[k] for k in self.fallback], list(prepared.batch),
                num_groups, prepared.batch_size, "towers", function_name, groups_argument,
                devices, prepared=prepared.restricted(self.fallback))

    def gradients(self, grad_ys=None, unconnected_gradients="zero", name=None, sparse=False):
        """A list with one entry per x: [G, *x.shape] (G = B or M), or None; with
        `sparse`, as `Towers.gradients` for the weights the towers compute."""
        with tf.name_scope(name or "gradients"):
            # every rule op waits for the checks of the fed batch
            checks = rule_gradients.run_time_checks(self.plan.prepared, self.function_name)
            with tf.control_dependencies(checks):
                return self._gradients(grad_ys, unconnected_gradients, sparse)

    def _gradients(self, grad_ys, unconnected_gradients, sparse):
        results = [None] * len(self.xs)
        covered = rule_gradients.gradients(self.plan, self.covered, self.groups,
                                           grad_ys, unconnected_gradients, self.function_name)
        for k, g in covered.items():
            results[k] = g
        if self.towers is not None:
            for k, g in zip(self.fallback, self.towers.gradients(
                    grad_ys=grad_ys, unconnected_gradients=unconnected_gradients,
                    name="towers", sparse=sparse)):
                results[k] = g
        return [independence.gated(g) for g in results]

    def stacked(self, function_name):
        """`ys` recomputed slice by slice, [B, ...], for `validate=True`."""
        if self.towers is not None:
            return self.towers.stacked
        prepared = self.plan.prepared
        return independence.recomputed_by_slices(
            prepared.ys, list(prepared.batch), prepared.num_groups, prepared.batch_size,
            function_name, self.groups_argument)


def build_gradients(ys, xs, batch, num_groups, batch_size, method, rules, function_name,
                    groups_argument, devices=None, sparse=False):
    """The object whose `gradients(grad_ys=None, unconnected_gradients=..., sparse=...)`
    gives [G, *x.shape] per x by `method`: `Towers` for "towers", else rules with
    towers for the weights they do not cover. Towers go under the current name scope,
    in `towers/`; with `sparse`, weights read only by gathers are left to the towers,
    which keep their rows sparse."""
    check_method(method, function_name, rules)
    if method == "towers":
        return towers_lib.build(ys, xs, batch, num_groups, batch_size, "towers",
                                function_name, groups_argument, devices)
    plan = rule_gradients.prepare_and_plan(
        ys, xs, batch, num_groups, batch_size, function_name, groups_argument,
        batch_size_required=(method == "auto"), registry=rules)
    if sparse:
        plan = rule_gradients.leave_gather_only_weights_to_towers(
            plan, "sparse=True: the towers keep its per-example rows sparse")
    if plan.fallback and not any(plan.uses[k] for k in range(len(plan.uses))):
        # no weight is computed by a rule: exactly the towers
        require_batch_size_for_fallback(plan, function_name)
        return towers_lib.build(ys, xs, batch, num_groups, batch_size, "towers",
                                function_name, groups_argument, devices,
                                prepared=plan.prepared)
    return _RulesAndTowers(plan, num_groups, function_name, groups_argument, devices)


def _graph_of(ys):
    """The graph of `ys` as the default graph (a no-op context for bad input, which
    the argument checks then refuse with their own message)."""
    graph = getattr(ys, "graph", None)
    if isinstance(ys, tf.Tensor) and isinstance(graph, tf.Graph):
        return graph.as_default()
    return contextlib.nullcontext()


def _validated(results, built, validate, function_name):
    """`results`, gated on the run-time check that `ys` recomputed slice by slice
    equals `ys` when `validate` (see `pertower.independence`)."""
    if not validate:
        return results
    stacked = (built.stacked if isinstance(built, towers_lib.Towers)
               else built.stacked(function_name))
    return independence.validated(results, built.ys, stacked, function_name)


def per_example_gradients(ys, xs, batch=None, batch_size=None,
                          unconnected_gradients=_checks.UNCONNECTED_DEFAULT, name=None,
                          method="auto",
                          validate=False, memory_limit=None, sparse=False, devices=None,
                          rules=None):
    """The gradient of each example's value with respect to each weight.

    Args:
      ys: per-example values, [B, ...]; each example's entries are summed.
      xs: a variable or tensor, or a list of them (e.g. `model.trainable_weights`).
      batch: the tensor(s) carrying the batch on axis 0 that `ys` depends on; when
        None they are found by walking back from `ys` to its placeholders and
        `tf.data` iterator outputs.
      batch_size: B, needed when the batch axis is not static (then the gradients are
        built for exactly B examples and feeding another size fails in `sess.run`);
        with method="rules" it may be left out when every weight has a rule, and the
        gradients then work for any fed batch size ([None, *x.shape]).
      unconnected_gradients: "zero" (zeros for a weight `ys` does not reach) or
        "none" (None for it), as in `tf.gradients`. Left out, it is "zero" and a
        UserWarning names the weights `ys` does not reach (for example optimizer
        slots from `tf.compat.v1.global_variables()`); pass "zero" to keep the zeros
        without the warning.
      name: name scope for the new ops.
      method: "auto" (default: per-op rules where they provably apply, towers for the
        other weights), "rules" (the same, with `batch_size` optional when no weight
        falls back) or "towers" (replay the model once per example on weight copies).
      validate: when True, fetching the result first checks at run time that `ys`
        recomputed slice by slice equals `ys` (see `pertower.check_independence`) and
        fails naming the largest difference otherwise.
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

    Returns:
      A list with one tensor per entry of `xs`, [B, *x.shape], x's dtype: entry i is
      `tf.gradients(tf.reduce_sum(ys[i]), x)` computed for example i alone.

    Example:
      cost = (net(x) - y) ** 2                                   # [B, 1]
      grads = pertower.per_example_gradients(cost, net.trainable_weights,
                                             batch_size=32)      # [32, *w.shape] each
      sess.run(grads, {x: X[:32], y: Y[:32]})
    """
    return _group_gradients(ys, xs, batch, None, batch_size, unconnected_gradients, name,
                            method, validate, memory_limit, sparse, devices, rules,
                            "per_example_gradients", "batch_size")


def _group_gradients(ys, xs, batch, num_groups, batch_size, unconnected_gradients, name,
                     method, validate, memory_limit, sparse, devices, rules, function_name,
                     groups_argument):
    """`per_example_gradients` (num_groups None) and `microbatch_gradients`: [G, *x.shape]
    per x, G = B or M."""
    check_method(method, function_name, rules)
    _checks.require_graph_mode(function_name)
    devices = _checks.device_list(devices, function_name)
    memory.check_memory(ys, xs, batch, batch_size, num_groups, 1, memory_limit,
                        function_name)
    with _graph_of(ys), tf.name_scope(name or function_name):
        built = build_gradients(ys, xs, batch, num_groups, batch_size, method, rules,
                                function_name, groups_argument, devices, sparse)
        results = built.gradients(unconnected_gradients=unconnected_gradients,
                                  name="gradients", sparse=sparse)
        _checks.warn_unconnected(ys, xs, unconnected_gradients, function_name)
        return _validated(results, built, validate, function_name)


def microbatch_gradients(ys, xs, batch=None, num_microbatches=None, batch_size=None,
                         unconnected_gradients=_checks.UNCONNECTED_DEFAULT, name=None,
                         method="auto",
                         validate=False, memory_limit=None, sparse=False, devices=None,
                         rules=None):
    """The gradient of the sum of `ys` over each of M contiguous, equal microbatches.

    Args:
      ys, xs, batch, batch_size, unconnected_gradients, name, method, validate,
        memory_limit, sparse, devices, rules: as in `per_example_gradients` (with
        sparse=True, `example_ids` are microbatch ids; tower m is microbatch m).
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
    return _group_gradients(ys, xs, batch, num_microbatches, batch_size,
                            unconnected_gradients, name, method, validate, memory_limit,
                            sparse, devices, rules, "microbatch_gradients",
                            "num_microbatches")


def per_example_jacobians(ys, xs, batch=None, batch_size=None,
                          unconnected_gradients=_checks.UNCONNECTED_DEFAULT, name=None,
                         method="auto",
                          validate=False, memory_limit=None, devices=None, rules=None):
    """The Jacobian of each example's outputs with respect to each weight (dy/dθ).

    Args:
      ys: per-example outputs, [B, *out]; `out` must be static (K = prod(out)).
      xs, batch, batch_size, unconnected_gradients, name, method, validate,
        memory_limit, devices, rules: as in `per_example_gradients`.

    Returns:
      A list with one tensor per entry of `xs`, [B, *out, *x.shape]: entry
      [i, k..., :] is d ys[i, k...] / d x computed for example i alone. For ys of
      shape [B] this is the per-example gradient.

    Example:
      jac = pertower.per_example_jacobians(model(x), model.trainable_weights,
                                           batch_size=16)        # [16, 10, *w.shape]
    """
    function_name = "per_example_jacobians"
    check_method(method, function_name, rules)
    if isinstance(ys, tf.Tensor) and (ys.shape.rank is None or (
            ys.shape.rank > 0 and not ys.shape[1:].is_fully_defined())):
        raise ValueError(
            f"pertower.{function_name}: the output axes of `ys` ({ys.name}, shape "
            f"{ys.shape}) must be static to build one gradient per output entry; give "
            "the model's output layer a fixed size, or reshape `ys` to a static shape.")
    _checks.require_graph_mode(function_name)
    K = int(np.prod(ys.shape[1:].as_list(), dtype=np.int64)) if isinstance(
        ys, tf.Tensor) and ys.shape.rank else 1
    devices = _checks.device_list(devices, function_name)
    memory.check_memory(ys, xs, batch, batch_size, None, K, memory_limit, function_name)
    with _graph_of(ys), tf.name_scope(name or function_name):
        built = build_gradients(ys, xs, batch, None, batch_size, method, rules,
                                function_name, "batch_size", devices)
        results = _jacobian_rows(built, ys, unconnected_gradients)
        _checks.warn_unconnected(ys, xs, unconnected_gradients, function_name)
        return _validated(results, built, validate, function_name)


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

"""Per-example gradient norms: the L2 norm of each example's whole gradient.

Notation:
    B   examples in the batch       x   one weight (entry of `xs`)
    g_i the gradient of example i's value with respect to all of xs, flattened
    A   a layer's input             dZ  the gradient at its output (one batched pass)

    norms[i] = ||g_i||_2 = sqrt(sum_x ||d sum(ys[i]) / d x||^2)

With method "auto" or "rules", a weight covered by one rule with a cheap form never
has its per-example gradients formed: a dense layer (k = 1 row per example) gives
||a_i||^2 ||dz_i||^2 (Goodfellow 2015, arXiv 1510.01799), a dense layer on sequences
the ghost norm sum_{t,s} (a_it·a_is)(dz_it·dz_is) (Li et al. 2021, arXiv 2110.05679),
an embedding the ghost norm with the indicator [id_t = id_s]. Other covered weights
are formed per rule ([B, *x.shape]) and reduced; weights without a rule fall back to
towers and are formed and reduced. Method "towers" forms every gradient. The memory
guard (`pertower.memory`) counts the gradients the towers form.
"""

import math

import tensorflow as tf

from pertower import _checks
from pertower._api import gradients as gradients_lib
from pertower._guards import independence
from pertower._guards import memory
from pertower.rules import _engine as rule_gradients
from pertower._towers import build as towers_lib

__all__ = ["per_example_norms"]


def per_example_norms(ys, xs, batch=None, batch_size=None, name=None, method="auto",
                      validate=False, memory_limit=None, devices=None, rules=None):
    """The L2 norm of each example's gradient over all of `xs`, [B].

    Args:
      ys, xs, batch, batch_size, name, method, validate, devices, rules: as in
        `pertower.per_example_gradients`; a weight `ys` does not reach adds 0, and a
        UserWarning names such weights.
      memory_limit: as in `pertower.per_example_gradients`, for the per-example
        gradients the norms need to hold: every weight's with method="towers", the
        weights left to towers otherwise.

    Returns:
      A [B] tensor of ys's dtype: entry i is the L2 norm of the concatenation of
      `tf.gradients(tf.reduce_sum(ys[i]), x)` over every x, for example i alone.

    Example (per-example clipping factors for DP-SGD):
      norms = pertower.per_example_norms(loss, model.trainable_weights, batch_size=64)
      factors = tf.minimum(1.0, clip / (norms + 1e-12))          # [64]
    """
    function_name = "per_example_norms"
    gradients_lib.check_method(method, function_name, rules)
    devices = _checks.device_list(devices, function_name)
    scope = name or function_name
    _checks.warn_unconnected(ys, xs, _checks.UNCONNECTED_DEFAULT, function_name,
                             outcome="they add 0 to the norms")
    if method != "towers":
        plan = rule_gradients.prepare_and_plan(
            ys, xs, batch, None, batch_size, function_name, "batch_size",
            batch_size_required=(method == "auto"), registry=rules)
        if plan.fallback and not any(plan.uses[k] for k in range(len(plan.uses))):
            gradients_lib.require_batch_size_for_fallback(plan, function_name)
            method = "towers"   # no weight is computed by a rule: exactly the towers
    if method == "towers":
        memory.check_memory(ys, xs, batch, batch_size, None, 1, memory_limit, function_name)
        with tf.name_scope(scope):
            per_example = gradients_lib.per_example_gradients(
                ys, xs, batch=batch, batch_size=batch_size, name="gradients", method=method,
                validate=validate, memory_limit=math.inf, devices=devices,
                unconnected_gradients="zero")   # warned above
            return _norms_of([g for g in per_example if g is not None])
    prepared = plan.prepared
    towers = None
    if plan.fallback:
        gradients_lib.require_batch_size_for_fallback(plan, function_name)
        fallback = [prepared.xs[k] for k in plan.fallback]
        memory.check_memory(ys, fallback, batch, batch_size, None, 1, memory_limit,
                            function_name)
    with prepared.graph.as_default(), tf.name_scope(scope):
        if plan.fallback:
            towers = towers_lib.build(prepared.ys, fallback, list(prepared.batch), None,
                                      prepared.batch_size, "towers", function_name,
                                      "batch_size", devices,
                                      prepared=prepared.restricted(plan.fallback))
        B = rule_gradients.group_count(prepared, None)
        covered = [k for k in range(len(prepared.xs)) if plan.uses[k]]
        # every rule op waits for the checks of the fed batch
        with tf.control_dependencies(rule_gradients.run_time_checks(prepared, function_name)):
            squares = list(rule_gradients.squared_norms(plan, covered, B).values())  # [B]
        if towers is not None:
            squares.append(tf.square(_norms_of(towers.gradients(name="gradients"))))
        if not squares:   # no weight is reached
            squares = [tf.zeros(tf.reshape(B, [1]), dtype=ys.dtype)]
        total = tf.add_n([tf.cast(s, ys.dtype) for s in squares])        # [B]
        norms = tf.sqrt(total)                                            # [B]
        if not validate:
            return norms
        stacked = towers.stacked if towers is not None else independence.recomputed_by_slices(
            prepared.ys, list(prepared.batch), None, prepared.batch_size, function_name,
            "batch_size")
        return independence.validated([norms], prepared.ys, stacked, function_name)[0]


def _norms_of(per_example):
    """[B] L2 norms over a list of [B, *x.shape] tensors."""
    squares = []
    for g in per_example:                              # [B, *x.shape]
        axes = list(range(1, g.shape.rank))
        squares.append(tf.reduce_sum(tf.square(g), axis=axes))  # [B]
    return tf.sqrt(tf.add_n(squares))                  # [B]

"""Curvature: the sum of squared per-example gradients and the GGN (Fisher) diagonal.

Notation:
    B   examples in the batch       K   logits per example      M   columns of S
    x   one weight (entry of xs)    g_i the gradient of example i's value
    S   [M, B, K] a factor of the loss Hessian (`pertower._curvature.loss_hessian`)
    J_i = d logits_i / d x          H_i = the Hessian of l(logits_i) w.r.t. logits_i

    sum_grad_squared(ys, xs)   = sum_i g_i ⊙ g_i
    diag_ggn(logits, xs)       = diag(sum_i J_i^T H_i J_i) = sum_{i,m} (J_i^T S[m, i])^2

Both sum over the examples (no 1/B). For a loss averaged over N examples the
per-example gradients are g_i / N, so its sum of squares is sum_grad_squared / N^2,
and its GGN is diag_ggn / N (BackPACK's `SumGradSquared` and `DiagGGN*`, Dangel et al.
2020, arXiv 1912.10985, with reduction="sum"). The rules compute covered weights from
ONE backward pass (the M columns vectorized, `pertower._curvature.columns`); the other
weights come from the fallback (towers, or row passes past a TF1 loop), one pass per
column.
"""

import tensorflow as tf

from pertower import _checks
from pertower import _docs
from pertower import _context
from pertower import _dispatch
from pertower import _request
from pertower._guards import memory as memory_guard
from pertower import _loops
from pertower._curvature import columns as columns_lib
from pertower._curvature import loss_hessian
from pertower._curvature import memory as memory_lib
from pertower._curvature import squares as squares_lib

__all__ = ["sum_grad_squared", "diag_ggn"]


def _plan(ys, xs, devices, batch, batch_size, batch_axis, C, per_example, memory_limit,
          method, rules, validate, ys_argument, **keywords):
    """(devices, plan) of a curvature call, guarded for C columns (`_curvature.memory`)."""
    memory_guard.resolve_limit(memory_limit)
    devices, _, plan = _dispatch.plan_call(
        ys, xs, devices, _request.Examples(batch, batch_size, None, batch_axis),
        _dispatch.options(method, rules, validate=validate, memory_limit=float("inf"),
                          **keywords), ys_argument=ys_argument)
    return devices, memory_lib.guard(plan, C, per_example, memory_limit)


def _finish(built, plan, results, routes, columns=None):
    """The results gated on the run-time check, in a `CurvatureResult`."""
    request = plan.request
    _checks.warn_unconnected(request.ys, request.xs, _checks.UNCONNECTED_DEFAULT,
                             outcome="they get zeros", reads=request.reads)
    ordered = built.validated([results[k] for k in range(len(request.xs))])
    return squares_lib.CurvatureResult(
        ordered, plan, [routes[k] for k in range(len(request.xs))],
        None if columns is None else columns.vectorized,
        None if columns is None else columns.reason,
        None if columns is None else columns.method)


@_context.public("sum_grad_squared")
@_docs.documented
def sum_grad_squared(ys, xs, batch=None, batch_size=None, name=None, method="auto",
                     validate=None, memory_limit=None, devices=None, rules=None,
                     batch_axis=None):
    """The elementwise sum over examples of the squared per-example gradients.

    A dense layer with one row per example never forms its per-example gradients:
    sum_i (a_i ⊗ dz_i)^2 = (A⊙A)^T (dZ⊙dZ) (Dangel et al. 2020, arXiv 1912.10985);
    other weights are formed and squared. A sum over the B rows of ys, no 1/B (see
    the module for losses averaged over N examples); the unbiased variance of the
    gradients is (sum_grad_squared - B * mean^2) / (B - 1), mean = sum_i g_i / B.

    Args:
      ys, xs: as in `pertower.per_example_norms`.
      {options: batch, batch_size, name, method, validate, devices, rules, batch_axis}
      memory_limit: as in `pertower.diag_ggn`.

    Returns:
      A list (a `CurvatureResult`: `.routes` and `.plan` say how each weight was
      computed) with one tensor per entry of xs, [*x.shape]: sum_i g_i(x) ⊙ g_i(x),
      with g_i(x) = tf.gradients(tf.reduce_sum(ys[i]), x) for example i alone; zeros
      for a weight `ys` does not reach.

    Example:
      sgs = pertower.sum_grad_squared(per_example_loss, model.trainable_weights)
    """
    devices, plan = _plan(ys, xs, devices, batch, batch_size, batch_axis, 1, False,
                          memory_limit, method, rules, validate, "ys", forms_gradients=False)
    with plan.request.graph.as_default(), tf.name_scope(name or _context.name()):
        built = _dispatch.build(plan, devices)
        with tf.control_dependencies(built.rule_checks()):
            d_outputs = squares_lib.output_gradients(plan, built.covered)
            results, routes = squares_lib.covered_squares(
                plan, built.covered, d_outputs, built.groups, per_example=False)
            more, more_routes = squares_lib.fallback_squares(built, None, False, "fallback")
        return _finish(built, plan, {**results, **more}, {**routes, **more_routes})


@_context.public("diag_ggn")
@_docs.documented
def diag_ggn(logits, xs, loss="softmax_cross_entropy", mc_samples=None,
             per_example=False, batch=None, batch_size=None, seed=None, name=None,
             method="auto", validate=None, memory_limit=None, devices=None, rules=None,
             batch_axis=None):
    """The diagonal of the generalized Gauss-Newton matrix (the Fisher) of sum_i l(logits_i).

    GGN = sum_i J_i^T H_i J_i with H_i the Hessian of the loss with respect to the
    logits, which does not depend on the labels for these losses (Martens 2014,
    arXiv 1412.1193); with S S^T = H_i (`mc_samples=None`: M = K exact columns, K - 1
    for the softmax, whose Hessian has rank K - 1) its diagonal is
    sum_{i,m} (J_i^T S[m, i])^2, the M columns backpropagated in one vectorized pass.
    With `mc_samples=M` the columns come from labels sampled from the model (softmax:
    (p - onehot(y~)) / sqrt(M)), an unbiased estimate of the true Fisher. A dense layer
    gives (A⊙A)^T sum_m (dZ_m⊙dZ_m) without per-example gradients. A sum over the B
    examples, no 1/B (see the module); BackPACK's `MSELoss(reduction="mean")` is this
    / (N K), Keras' mean squared error this / K.

    Args:
      logits: [B, K] network output the loss reads (K static); row i must depend on
        example i alone (as `ys` in `pertower.per_example_gradients`).
      xs: weights, as in `pertower.per_example_gradients`.
      loss: "softmax_cross_entropy", "sigmoid_cross_entropy" (independent binary labels
        per output) or "mse" (l = sum_k (f_k - y_k)^2, Hessian 2 I). Labels are not
        needed: H does not depend on them.
      mc_samples: None for the exact diagonal (K columns; K - 1 for the softmax), or
        M > 0 sampled columns.
      per_example: False for the sum over examples, [*x.shape]; True for each
        example's own diagonal J_i^T H_i J_i, [B, *x.shape].
      {options: batch, batch_size, batch_axis, method, validate, devices, rules}
      memory_limit: as in `pertower.per_example_gradients`, counting what each
        weight's route holds (`pertower._curvature.memory`) and the M columns of the
        rules' output gradients.
      seed: an int makes the Monte-Carlo labels reproducible (stateless sampling).
      name: name scope (default "diag_ggn").

    Returns:
      A list (a `CurvatureResult`, as in `sum_grad_squared`) with one tensor per entry
      of xs, [*x.shape] or [B, *x.shape], of x's dtype; zeros for a weight `logits`
      does not reach. `.routes` says per weight whether a rule's cheap form, a rule per
      column, or the fallback (one pass per column) computed it.

    Example (elastic weight consolidation's importance, a Fisher diagonal):
      fisher = pertower.diag_ggn(model(x), model.trainable_weights, mc_samples=1)
    """
    _checks.require_graph_mode()
    loss = loss_hessian.check_loss(loss)
    mc_samples = loss_hessian.check_mc_samples(mc_samples)
    if not isinstance(per_example, bool):
        raise _context.error(TypeError, "`per_example` must be True or False, but received "
                                        f"{per_example!r}.")
    logits = _checks.require_graph_tensor(logits, "logits")
    if logits.shape.rank != 2 or logits.shape[1] is None:
        raise _context.error(ValueError, "`logits` must be a [B, K] tensor with a static K "
                                         f"(one row of K outputs per example), but "
                                         f"{logits.name} has shape {logits.shape}; reshape "
                                         "it to [B, K] first.")
    K = int(logits.shape[1])
    M = loss_hessian.exact_columns(loss, K) if mc_samples is None else mc_samples
    devices, plan = _plan(logits, xs, devices, batch, batch_size, batch_axis, M, per_example,
                          memory_limit, method, rules, validate, "logits",
                          outputs_per_example=M)
    with plan.request.graph.as_default(), tf.name_scope(name or _context.name()):
        built = _dispatch.build(plan, devices)
        S = loss_hessian.hessian_factor(logits, loss, mc_samples, seed)   # [M, B, K]
        S.set_shape([M, None, K])
        with tf.control_dependencies(built.rule_checks()):
            outputs, seen, in_loops = [], set(), []
            for k in built.covered:
                for use in plan.uses[k]:
                    if isinstance(use, _loops.LoopUse):   # read inside a loop
                        in_loops.append(k)
                    elif id(use.output) not in seen:
                        seen.add(id(use.output))
                        outputs.append(use.output)
            columns = columns_lib.output_gradient_columns(logits, outputs, S)
            columns_of = {id(Z): c for Z, c in zip(outputs, columns)}  # [M, *Z.shape]
            columns_of.update(squares_lib.loop_columns(plan, sorted(set(in_loops)), S))
            results, routes = squares_lib.covered_squares(
                plan, built.covered, columns_of, built.groups, per_example)
            more, more_routes = squares_lib.fallback_squares(built, S, per_example,
                                                             "column")
        return _finish(built, plan, {**results, **more}, {**routes, **more_routes},
                       columns if outputs else None)

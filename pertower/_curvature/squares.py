"""Sums of squared gradients over examples and columns, from the rules or a fallback.

Notation:
    B   examples        C   columns (1 for the plain gradient, M for a loss Hessian's factor)
    x   one weight      A   a layer's input       dZ_c  the gradient at its output for column c
    g_{i,c}(x)  example i's gradient of x for column c (the output gradient dZ_c)

    squares(x) = sum_c g_{i,c}(x) ⊙ g_{i,c}(x)         [B, *x.shape] per example,
                                                        [*x.shape] summed over i

Per covered weight (one plan of `pertower._dispatch`), in order of preference:
  "rules, cheap form": one use whose rule's `sum_squared` serves (dense, one row per
      example: (A⊙A)^T sum_c (dZ_c⊙dZ_c); convolutions: `pertower._convolution.squares`);
  "rules, per column": each use's `per_group` for every column, the uses added,
      squared, summed over the columns.
A weight no rule covers comes from the plan's fallback (towers or row passes): its
per-example gradients formed for each column (grad_ys = the column), squared.
"""

import tensorflow as tf

from pertower import _engine
from pertower import _tf
from pertower import _loops
from pertower._layout import _rows

__all__ = ["CurvatureResult", "covered_squares", "fallback_squares", "output_gradients",
           "loop_columns"]

class CurvatureResult(list):
    """The list of results, one per entry of `xs`, with how each was computed.

    Attributes:
      plan: the `pertower.Plan` of the call.
      routes: per entry of xs, "rules, cheap form: OP (Type)", "rules, per column:
        OPS", the fallback's description, or "unreached (zeros)".
      columns_vectorized, columns_reason, columns_method: for `diag_ggn`, how the
        columns' output gradients came (`columns.Columns`); None without rules.
    """

    def __init__(self, tensors, plan, routes, columns_vectorized=None, columns_reason=None,
                 columns_method=None):
        super().__init__(tensors)
        self.plan = plan
        self.routes = tuple(routes)
        self.columns_vectorized = columns_vectorized
        self.columns_reason = columns_reason
        self.columns_method = columns_method

    def explain(self):
        """One line per weight: its name and route."""
        return "\n".join(f"{w.name}: {route}" for w, route in zip(self.plan.weights,
                                                                  self.routes))


def _ops(uses):
    return ", ".join(dict.fromkeys(f"{u.op.name} ({u.op.type})" for u in uses))


def _per_x(x, B, per_example):
    """The target shape of x's result: [B, *x.shape] or [*x.shape]."""
    dims = x.shape.as_list()
    return _rows.group_shape(B, dims) if per_example else dims


def covered_squares(plan, indices, columns_of, B, per_example):
    """{k: squares of xs[k]} and {k: route} for the covered weights `indices`, from
    `columns_of` {id(Z): [C, *Z.shape]}; [B, *x.shape] when `per_example`, else [*x]."""
    results, routes = {}, {}
    for k in indices:
        x = plan.request.xs[k]
        # reads inside a loop: the built copy's use (A_all, and the key of dZ_all)
        uses = _loops.concrete_uses(plan.uses[k])
        dtype = x.dtype.base_dtype
        if not uses:
            results[k], routes[k] = (tf.zeros(_per_x(x, B, per_example), dtype),
                                      "unreached (zeros)")
            continue
        if len(uses) == 1:
            use = uses[0]
            cheap = use.rule.sum_squared(use, columns_of[id(use.output)], B,
                                         per_example=per_example)
            if cheap is not None:
                results[k] = tf.reshape(cheap, _per_x(x, B, per_example))
                routes[k] = f"rules, cheap form: {_ops(uses)}"
                continue
        results[k] = _formed_squares(x, uses, columns_of, B, per_example)
        routes[k] = f"rules, per column: {_ops(uses)}"
    return results, routes


def _formed_squares(x, uses, columns_of, B, per_example):
    """sum_c (sum over uses of per_group(use, dZ_c))^2, [B, *x] or [*x]."""
    x_shape = _rows.group_shape(B, x.shape.as_list())

    def square_of_column(c):
        # each use's [B, *w.shape at the op] -> [B, *x.shape], added over the uses
        parts = [tf.reshape(u.rule.per_group(u, tf.gather(columns_of[id(u.output)], c), B),
                            x_shape) for u in uses]
        g = tf.add_n(parts) if len(parts) > 1 else parts[0]               # [B, *x.shape]
        return tf.square(g)

    C = _rows.dim(columns_of[id(uses[0].output)], 0)
    if isinstance(C, int):
        # one rule contraction per column (the rules' ops are small next to the backward
        # pass, which the columns share; pfor's conversion of a rule's ops costs seconds
        # of graph building for a convolution)
        squares = tf.add_n([square_of_column(c) for c in range(C)])      # [B, *x.shape]
    else:
        # vectorized over a run-time number of columns
        squares = tf.reduce_sum(_tf.pfor(square_of_column, C), axis=0)  # [B, *x.shape]
    return squares if per_example else tf.reduce_sum(squares, axis=0)


def fallback_squares(built, S, per_example, name):
    """{k: squares of xs[k]} and {k: route} for the weights of `built.fallback`; S None
    (one column) or [M, B, K]: column m's per-example gradients are the fallback's with
    grad_ys = S[m] (J_i^T S[m, i] without forming J_i)."""
    fallback = built.fallback
    if fallback is None:
        return {}, {}
    at = built.fallback_indices
    kind = built.plan.fallback_method
    totals = [None] * len(at)
    columns = [None] if S is None else [S[m] for m in range(S.shape[0])]
    for m, grad_ys in enumerate(columns):
        grads = fallback.gradients(grad_ys=grad_ys, name=f"{name}_{m}")  # [B, *x] each
        for i, g in enumerate(grads):
            if g is not None:
                totals[i] = tf.square(g) if totals[i] is None else totals[i] + tf.square(g)
    results, routes = {}, {}
    how = (f"{kind}: per-example gradients formed" if S is None else
           f"{kind}: per-example Jacobians contracted with the columns (one pass per column)")
    for i, k in enumerate(at):
        x = built.xs[k]
        if totals[i] is None:
            totals[i] = tf.zeros(_per_x(x, built.groups, True), x.dtype.base_dtype)
        results[k] = totals[i] if per_example else tf.reduce_sum(totals[i], axis=0)
        routes[k] = f"{how} ({built.plan.reasons[k]})"
    return results, routes


def output_gradients(plan, indices):
    """{id(Z): [1, *Z.shape]}: dZ of sum(ys) at every use's output, one tf.gradients
    (a read inside a loop: at the key of its copy's dZ_all, `pertower._loops`)."""
    d_outputs = _engine.output_gradients(plan, indices)
    return {key: dZ[None] for key, dZ in d_outputs.items()}


def loop_columns(plan, indices, S):
    """{id(key): [M, *dZ_all]} for the reads inside loops of the weights `indices`: the
    engine's backward pass with grad_ys = S[m] per column m (pfor does not convert a
    loop's backward pass), stacked over m."""
    keys = [id(use.concrete().output) for k in indices for use in plan.uses[k]
            if isinstance(use, _loops.LoopUse)]
    if not keys:
        return {}
    per_key = {key: [] for key in keys}
    for m in range(S.shape[0]):
        found = _engine.output_gradients(plan, indices, grad_ys=S[m])
        for key in keys:
            per_key[key].append(found[key])
    return {key: tf.stack(columns) for key, columns in per_key.items()}

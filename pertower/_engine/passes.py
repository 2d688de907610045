"""The rules' batched backward pass, and what the rules compute from its dZ: per-group
gradients, squared norms, clipped sums (notation: `pertower._engine`)."""

import tensorflow as tf

from pertower import _checks
from pertower.rules import _input_gradients
from pertower import _loops
from pertower._layout import _shapes
from pertower.rules import _weight_functions
from pertower.rules import registry as registry_lib

__all__ = ["output_gradients", "gradients", "norm_parts", "clipped_sums"]


def _output_gradients(plan, indices, grad_ys, unconnected):
    """{id(Z): dZ} from one tf.gradients call over every use's output (a read inside a
    while loop: from one backward pass of the loop's copy, `pertower._loops`)."""
    outputs, loop_uses = {}, []   # id(Z) -> Z, in order
    for k in indices:
        for use in plan.uses[k]:
            loop_uses += [use] if isinstance(use, _loops.LoopUse) else []
            outputs.update((id(z), z) for z in _loops.differentiated(use))
    if not outputs:
        return {}
    # the ops between the Z's build their batch side's gradient only (rules._input_gradients)
    with _input_gradients.input_side_only(plan, indices, loop_uses):
        return _loops.output_gradients(plan.request.ys, list(outputs.values()), loop_uses,
                                       grad_ys, unconnected)


def output_gradients(plan, indices, grad_ys=None, unconnected=tf.UnconnectedGradients.ZERO):
    """`_output_gradients`, for the curvature functions (`pertower._curvature`)."""
    with _shapes.ShapeCache(None).active():   # the pass's constants shared
        return _output_gradients(plan, indices, grad_ys, unconnected)


def _zeros(x, G):
    """[G, *x.shape] zeros."""
    if isinstance(G, int) and x.shape.is_fully_defined():
        return tf.zeros([G] + x.shape.as_list(), dtype=x.dtype.base_dtype)
    dims = (tf.constant(x.shape.as_list(), tf.int32) if x.shape.is_fully_defined()
            else tf.shape(x))
    return tf.zeros(tf.concat([tf.reshape(tf.cast(G, tf.int32), [1]), dims], 0),
                    dtype=x.dtype.base_dtype)


def _same_static_shape(a, b):
    return (a.shape.rank is not None and b.shape.rank is not None
            and a.shape.as_list() == b.shape.as_list())


def _per_x_parts(uses, x, G, cache):
    """[[G, *x.shape]]: each (use, dZ)'s rule result as x's gradient. Uses through one
    function of the weights (the same u) are summed and pulled back to x ONCE."""
    parts, pooled = [], {}   # u -> (rule, [[G, *u.shape]])
    for use, dZ in uses:
        rule = use.rule
        if isinstance(rule, _weight_functions.WeightFunctionRule):
            inner = rule.inner_per_group(dZ, G)                        # [G, *u.shape]
            entry = pooled.setdefault(rule.u.ref(), (rule, []))
            if not entry[1] or _same_static_shape(inner, entry[1][0]):
                entry[1].append(inner)
                continue
            parts.append(_shapes.as_per_x(rule.pull_back(inner), x, G, cache))
            continue
        parts.append(_shapes.as_per_x(rule.per_group(use, dZ, G), x, G, cache))
    for rule, inner in pooled.values():
        summed = tf.add_n(inner)
        parts.append(_shapes.as_per_x(rule.pull_back(summed), x, G, cache))
    return parts


def gradients(plan, indices, G, grad_ys=None, unconnected_gradients="zero"):
    """{k: [G, *xs[k].shape]} for the covered weights `indices` (None for a weight that
    gets no gradient, with unconnected_gradients="none")."""
    unconnected = _checks.unconnected_gradients_value(unconnected_gradients)
    grad_ys = _checks.grad_ys_like(plan.request.ys, grad_ys)
    results, cache = {}, _shapes.ShapeCache(G)
    # one Const per value for the whole build (`_shapes.constant`), the backward pass's
    # included (the forward forms of `_input_gradients` turn every filter alike)
    with cache.active():
        d_outputs = _output_gradients(plan, indices, grad_ys, unconnected)
        for k in indices:
            x = plan.request.xs[k]
            uses = [(use, d_outputs[id(use.output)]) for use in
                    _loops.concrete_uses(plan.uses[k]) if d_outputs[id(use.output)] is not None]
            parts = _per_x_parts(uses, x, G, cache)
            if not parts and unconnected == tf.UnconnectedGradients.NONE:
                results[k] = None
                continue
            total = tf.add_n(parts or [_zeros(x, G)])                    # [G, *x.shape]
            total.set_shape(tf.TensorShape([G if isinstance(G, int) else None]).concatenate(
                x.shape))
            results[k] = total
    return results


def norm_parts(plan, indices, B):
    """(d_outputs, squares, formed): {id(Z): dZ} from ONE tf.gradients of sum(ys); {k:
    [B] squared norms of example i's gradient with respect to xs[k]} (a rule's cheap
    form when x has one use and the rule has one); {k: [B, *xs[k].shape] or a
    `FormedNorms`} for the weights whose norms needed the gradients formed."""
    squares, formed, cache = {}, {}, _shapes.ShapeCache(B)
    with cache.active():   # shared constants (`_shapes.constant`), the backward's too
        d_outputs = _output_gradients(plan, indices, None, tf.UnconnectedGradients.ZERO)
        for k in indices:
            uses = _loops.concrete_uses(plan.uses[k])
            if not uses:
                continue
            if len(uses) == 1:
                use, dZ = uses[0], d_outputs[id(uses[0].output)]
                cheap = use.rule.squared_norms(use, dZ, B)
                if cheap is not None:
                    squares[k] = cheap
                    continue
                found = use.rule.formed_norms(use, dZ, B)
                if found is not None:   # a `registry.FormedNorms`, kept for the clipped sum
                    squares[k], formed[k] = found.squares, found
                    continue
            # each use's [B, *w.shape at the op] -> [B, *x.shape]
            parts = _per_x_parts([(use, d_outputs[id(use.output)]) for use in uses],
                                 plan.request.xs[k], B, cache)
            total = tf.add_n(parts)                                         # [B, *x.shape]
            formed[k] = total
            flat = tf.reshape(total, cache.group_shape([-1]))               # [B, P_x]
            squares[k] = tf.reduce_sum(tf.square(flat), axis=1)             # [B]
    return d_outputs, squares, formed


def clipped_sums(plan, indices, d_outputs, formed, factors):
    """{k: [*xs[k].shape] sum_i factors_i grad_i(xs[k])} from the parts of `norm_parts`.

    Gradients are linear in dZ, so with f the [B] factors (held constant) this is the
    gradient of sum_i f_i ys_i, which every rule gets from the SAME dZ with example i's
    rows scaled by f_i (`Rule.clipped_sum`; Bu et al. 2023, arXiv 2210.00038): no second
    backward pass. Gradients formed for the norms are contracted with f instead.
    """
    results = {}
    for k in indices:
        x = plan.request.xs[k]
        dtype = x.dtype.base_dtype
        if k in formed:
            g = formed[k]
            results[k] = (_shapes.as_weight_shape(g.clipped_sum(factors), x)
                          if isinstance(g, registry_lib.FormedNorms) else
                          tf.tensordot(tf.cast(factors, g.dtype), g, axes=1))   # [*x.shape]
            continue
        parts = []
        for use in _loops.concrete_uses(plan.uses[k]):
            part = use.rule.clipped_sum(use, d_outputs[id(use.output)], factors)
            parts.append(_shapes.as_weight_shape(part, x))               # [*x.shape]
        if not parts:
            parts = [tf.zeros(x.shape, dtype) if isinstance(x, tf.Variable) else
                     tf.zeros_like(x)]
        results[k] = tf.add_n(parts)
    return results

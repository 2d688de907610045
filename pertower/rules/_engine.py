"""method="rules": per-example gradients from one batched backward pass and per-op rules.

Notation:
    B   examples in the batch          G   groups: B (per example) or M (microbatches)
    x   one weight (entry of `xs`)     A   a weight-consuming op's batch-side input
    Z   that op's output               dZ  d sum(grad_ys * ys) / dZ, from ONE tf.gradients

For every weight x, every read of x that `ys` depends on must reach an op that has a
rule (`pertower.rules`), possibly through layout-only ops on the weight side
(Identity, ExpandDims, Squeeze, Reshape: Conv1D's filter is ExpandDims(W)) or through
functions of the weights alone (a Cast, g·v/||v||, a non-fused batch norm's scale and
shift: `rules._weight_functions`, which pulls the rule's result back to x); and
`pertower._batch_axis` must prove that the op's A and Z rows belong to examples and that
row i of `ys` depends on example i alone. Then

    grad_i(x) = sum over the uses u of x of  rule_u(A_u, dZ_u) for example i,

the chain rule summed over every use (a shared layer adds its contributions). A weight
for which anything is unproven is reported with the reason and left to the towers.

The proof that dZ's rows belong to examples (and that the weight side only re-lays-out
x) holds for TensorFlow's registered gradients of the ops between x and `ys`. An op
whose gradient the user replaced (`gradient_override_map`, `tf.custom_gradient`: its
`_gradient_op_type` attribute) or whose gradient is Python code (`tf.py_func`,
`tf.numpy_function`, `tf.py_function`), on any path from a read of x to `ys` (inside
called functions too), may mix the examples in the backward pass; such a weight is
left to the towers, where each tower's backward pass sees its own examples only,
unless the op is in the graph itself and its backward, built once on dy placeholders,
is proven row-wise by the batch-axis analysis (`pertower._overrides`: swish's is).
"""

import dataclasses

import tensorflow as tf

from pertower import _batch_axis
from pertower import _checks
from pertower import _context
from pertower import _plan
from pertower import _tf
from pertower.rules import _input_gradients
from pertower.rules import _loops
from pertower.rules import _shapes
from pertower.rules._unassumed import UnassumedGradients
from pertower.rules import _weight_functions
from pertower.rules import registry as registry_lib

def build_plan(request, registry):
    """Decides, for every weight, whether the rules cover it. Builds no ops.

    Returns:
      (uses, reasons): per entry of xs, a tuple of `rules.Use` (empty when `ys` does
      not reach x) or None when x falls back to the towers; and why it falls back
      (str) or None.
    """
    ys, batch = request.ys, request.batch
    analysis = request.analysis
    if analysis is None or analysis.registry is not registry:
        analysis = _batch_axis.analyze(ys, batch, request.ys_upstream, request.batch_size,
                                       request.num_groups, registry)
    if analysis.verdict != "independent":
        lost = analysis.lost_at
        where = (f"; the proof was lost at {lost[0].name!r} ({lost[0].type}): {lost[1]}"
                 if lost is not None else "")
        reason = (f"the rows of `ys` ({ys.name}) could not be traced to the examples of "
                  f"the batch{where}")
        return (tuple(None if r.reached else () for r in request.reads),
                tuple(reason if r.reached else None for r in request.reads))
    if analysis.segments is not None:
        # the rows of `ys` are those of s1, then of s2: a weight-consuming op's A rows
        # belong to one batch, so a rule's [B_s] result would have to be placed at its
        # batch's rows; the towers, which feed one example of the joined order each, do it
        joined = ", then ".join(" and ".join(batch[j].name for j in segment)
                                for segment in analysis.segments)
        reason = (f"`ys` ({ys.name}) joins several batches along axis 0 ({joined}); the "
                  "towers compute it example by example in that order")
        return (tuple(None if r.reached else () for r in request.reads),
                tuple(reason if r.reached else None for r in request.reads))
    uses, reasons = [], []
    unassumed = UnassumedGradients(request)
    loops = _loops.Loops(request, analysis, registry)
    for k, (x, reads) in enumerate(zip(request.xs, request.reads)):
        found = _weight_uses(x, reads, request.ys_upstream, analysis, registry, loops)
        if not isinstance(found, str) and found:   # (x's region walked only when needed)
            region = lambda k=k: request.weight_regions[k]
            found = unassumed.reason(reads, request.ys_upstream, region) or found
        if isinstance(found, str):
            uses.append(None)
            reasons.append(found)
        else:
            uses.append(tuple(found))
            reasons.append(None)
    return tuple(uses), tuple(reasons)


def _weight_uses(x, reads, ys_upstream, analysis, registry, loops):
    """The `Use`s of x, or a string saying why x is not covered (reads inside TF2 while
    loops: `pertower.rules._loops`)."""
    if not reads.reached:
        return []
    found = loops.uses(reads, _in_v1_loop)   # TF2 loops and TF1 frames: rules._loops
    if isinstance(found, str):
        return found
    walked = _weight_functions.exits(reads, ys_upstream, analysis)
    if isinstance(walked, str):
        return walked
    terminals = [_weight_functions.Exit(op, 0, (), (), True) for op in reads.gather_ops]
    terminals.extend(walked)
    terminals.sort(key=lambda e: (_tf.op_id(e.op), e.slot))
    for exit_ in terminals:
        op, slot = exit_.op, exit_.slot
        inside = loops.inner_uses(exit_, _in_v1_loop)   # passed to a loop: rules._loops
        if inside is not None:
            if isinstance(inside, str):
                return inside
            found.extend(inside)
            continue
        where = f"{op.name!r} ({op.type})" + (
            "" if exit_.reorder_only else
            " through " + ", ".join(f"{o.name!r} ({o.type})" for o in exit_.through))
        rule = registry.lookup(op.type)
        if rule is None:
            return f"it is read by {where}, which has no rule"
        use = rule.match(op, slot, analysis)
        if isinstance(use, str):
            return f"it is read by {where}: {use}"
        if use.rule is not rule:   # the registered rule computes what it matched
            use = dataclasses.replace(use, rule=rule)
        if use.weight_shape is None:   # read through a resource handle
            if not isinstance(x, tf.Variable):
                return f"it is read through a resource handle at {op.name!r} ({op.type})"
            use = dataclasses.replace(use, weight_shape=x.shape)
        if not use.weight_shape.is_fully_defined():
            return f"its shape at {op.name!r} ({use.weight_shape}) is not static"
        if not exit_.reorder_only:   # a function of the weights: pulled back to x
            use = _weight_functions.wrap(use, exit_)
        found.append(use)
    return found


def _in_v1_loop(enter):
    return (f"it is read inside the TF1 (v1) while loop that {enter.name!r} ({enter.type}) "
            "enters, where tf.gradients cannot reach the dZ a rule needs")


def group_count(request, num_groups):
    """G: M, or B (an int when known, else a scalar tensor read from the batch)."""
    if num_groups is not None:
        return num_groups
    if request.batch_size is not None:
        return request.batch_size
    return tf.shape(request.batch[0])[request.batch_axes[0]]


def run_time_checks(request, plan=None):
    """Assertions on the fed batch: its size equals `batch_size` (B, or B_s for each
    batch `ys` joins) when one was given for a None batch axis; M divides it when B is
    left to run time. `plan` (when given) chooses the advice of the message: leaving
    out batch_size helps only when the rules compute every weight."""
    checks = []
    B, M = request.batch_size, request.num_groups
    own_size = {}
    if request.segments is not None:
        own_size = {j: size for indices, size in request.segments for j in indices}
    for j, (b, axis, size) in enumerate(zip(request.batch, request.batch_axes,
                                            request.static_sizes)):
        if size is not None:
            continue
        if B is not None:
            given = (f"batch_size[{j}]={own_size[j]}" if j in own_size else None)
            checks.append(_checks.fed_batch_size_check(
                b, axis, own_size.get(j, B), "the gradients", _size_advice(request, plan),
                name=f"check_batch_size_{j}", given=given))
        elif M is not None:
            fed = tf.shape(b)[axis]   # the batch axis (1 for a time-major [T, B, ...])
            message = tf.strings.join([
                _context.prefixed(f"`num_microbatches` ({M}) must divide the batch size, "
                                  f"but the batch fed to {b.name} has "),
                tf.strings.as_string(fed), f" examples. Feed a multiple of {M} examples."])
            checks.append(tf.debugging.Assert(
                tf.equal(tf.math.floormod(fed, M), 0), [message],
                name=f"check_microbatches_{j}"))
    return checks


def _size_advice(request, plan):
    """The end of the fed-batch-size message: what else works for this plan."""
    again = "build the gradients again for the new batch size"
    if request.segments is not None:
        return (f"{again} (batch_size=[B_1, B_2, ...], one size per batch tensor): `ys` "
                "joins several batches, whose sizes are fixed when the gradients are built.")
    static = [(b, size) for b, size in zip(request.batch, request.static_sizes)
              if size is not None]
    if static:
        b, size = static[0]
        return (f"{again}: batch_size cannot be left out, since the batch tensor "
                f"{b.name} has a static batch size of {size}.")
    fallback = plan.fallback if plan is not None else []
    if fallback:
        names = ", ".join(_plan.weight_name(request.xs[k]) for k in fallback)
        by = ("row passes" if plan.fallback_method == "passes" else "towers")
        return (f"{again} (batch_size=B): batch_size cannot be left out, since no rule "
                f"computes {names}, whose gradients come from {by} built for a fixed "
                "number of examples.")
    return f"{again}, or leave out batch_size (then the rules work for any fed batch size)."


def _output_gradients(plan, indices, grad_ys, unconnected):
    """{id(Z): dZ} from one tf.gradients call over every use's output; a read inside a
    while loop gets its dZ from one backward pass of the loop's copy, given the
    gradients at the loop's outputs from the same call, which stops there (the copy's
    pass adds the paths through the loop: `pertower.rules._loops`)."""
    outputs, loop_uses = {}, []   # id(Z) -> Z, in order
    for k in indices:
        for use in plan.uses[k]:
            loop_uses += [use] if isinstance(use, _loops.LoopUse) else []
            outputs.update((id(z), z) for z in _loops.differentiated(use))
    if not outputs:
        return {}
    # the ops between the Z's build their batch side's gradient only (rules._input_gradients)
    with _input_gradients.input_side_only(plan, indices):
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
    """[[G, *x.shape]]: each (use, dZ)'s rule result as x's gradient. Uses through a
    function of the weights with the same exit tensor u (a shared layer reading one
    Cast of x, say) share its Jacobian du/dx, so their [G, *u.shape] results are summed
    and pulled back to x ONCE (linearity of the VJP; `rules._weight_functions`)."""
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
        summed = tf.add_n(inner) if len(inner) > 1 else inner[0]
        parts.append(_shapes.as_per_x(rule.pull_back(summed), x, G, cache))
    return parts


def gradients(plan, indices, G, grad_ys=None, unconnected_gradients="zero"):
    """{k: [G, *xs[k].shape]} for the covered weights `indices` (or None for a weight
    that `ys` does not reach, or whose outputs get no gradient, with
    unconnected_gradients="none")."""
    unconnected = _checks.unconnected_gradients_value(unconnected_gradients)
    grad_ys = _checks.grad_ys_like(plan.request.ys, grad_ys)
    results, cache = {}, _shapes.ShapeCache(G)
    # one Const per value for the whole build (`_shapes.constant`), the backward pass's
    # included (the forward forms of `_input_gradients` turn every filter alike)
    with cache.active():
        d_outputs = _output_gradients(plan, indices, grad_ys, unconnected)
        for k in indices:
            results[k] = _weight_gradient(plan, k, d_outputs, G, cache, unconnected)
    return results


def _weight_gradient(plan, k, d_outputs, G, cache, unconnected):
    """[G, *xs[k].shape]: the sum of the rules' results of every use of xs[k] (None
    when it gets no gradient and unconnected is NONE)."""
    x = plan.request.xs[k]
    parts = []
    for use in _loops.concrete_uses(plan.uses[k]):
        dZ = d_outputs[id(use.output)]
        if dZ is not None:
            parts.append((use, dZ))
    parts = _per_x_parts(parts, x, G, cache)
    if not parts:
        if unconnected == tf.UnconnectedGradients.NONE:
            return None
        parts = [_zeros(x, G)]
    total = tf.add_n(parts) if len(parts) > 1 else parts[0]
    total.set_shape(tf.TensorShape([G if isinstance(G, int) else None]).concatenate(x.shape))
    return total


def squared_norms(plan, indices, B):
    """{k: [B] squared norms of example i's gradient with respect to xs[k]}; a rule's
    cheap form when x has one use and the rule has one, else formed and reduced."""
    _, squares, _ = norm_parts(plan, indices, B)
    return squares


def norm_parts(plan, indices, B):
    """The squared norms of the covered weights and what a clipped sum reuses.

    Returns:
      (d_outputs, squares, formed): {id(Z): dZ} from ONE tf.gradients of sum(ys);
      {k: [B] squared norms of example i's gradient with respect to xs[k]} (a rule's
      cheap form when x has one use and the rule has one); {k: [B, *xs[k].shape]} the
      per-example gradients of the weights whose norms needed them formed (or a FormedNorms).
    """
    squares, formed, cache = {}, {}, _shapes.ShapeCache(B)
    with cache.active():   # shared constants (`_shapes.constant`), the backward's too
        d_outputs = _output_gradients(plan, indices, None, tf.UnconnectedGradients.ZERO)
        for k in indices:
            uses = _loops.concrete_uses(plan.uses[k])
            if not uses:
                continue
            if len(uses) == 1:
                use, dZ = uses[0], d_outputs[id(uses[0].output)]
                cheap = getattr(use.rule, "squared_norms", lambda *_: None)(use, dZ, B)
                if cheap is not None:
                    squares[k] = cheap
                    continue
                found = getattr(use.rule, "formed_norms", lambda *_: None)(use, dZ, B)
                if found is not None:   # a `registry.FormedNorms`, kept for the clipped sum
                    squares[k], formed[k] = found.squares, found
                    continue
            # each use's [B, *w.shape at the op] -> [B, *x.shape]
            parts = _per_x_parts([(use, d_outputs[id(use.output)]) for use in uses],
                                 plan.request.xs[k], B, cache)
            total = tf.add_n(parts) if len(parts) > 1 else parts[0]         # [B, *x.shape]
            formed[k] = total
            flat = tf.reshape(total, cache.group_shape([-1]))               # [B, P_x]
            squares[k] = tf.reduce_sum(tf.square(flat), axis=1)             # [B]
    return d_outputs, squares, formed


def clipped_sums(plan, indices, d_outputs, formed, factors):
    """{k: [*xs[k].shape] sum_i factors_i grad_i(xs[k])} from the parts of `norm_parts`.

    Gradients are linear in the output gradient, so with f the [B] factors (held
    constant) sum_i f_i grad_i(x) is the gradient of sum_i f_i ys_i, which every rule
    gets from the SAME dZ with example i's rows scaled by f_i (`Rule.clipped_sum`: e.g.
    A^T (f ⊙ dZ) for a dense layer; the book-keeping of Bu et al. 2023, "Differentially
    private optimization on large model at small cost", arXiv 2210.00038): no second
    backward pass through the network. A weight whose per-example gradients were formed
    for its norms is contracted with f instead ([B] x [B, *x.shape] -> [*x.shape]).
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
            dZ = d_outputs[id(use.output)]
            own = getattr(use.rule, "clipped_sum", None)
            part = (own(use, dZ, factors) if callable(own) else
                    registry_lib.default_clipped_sum(use.rule, use, dZ, factors))
            parts.append(_shapes.as_weight_shape(part, x))               # [*x.shape]
        if not parts:
            results[k] = tf.zeros_like(x) if not isinstance(x, tf.Variable) else tf.zeros(
                x.shape, dtype)
            continue
        results[k] = tf.add_n(parts) if len(parts) > 1 else parts[0]
    return results

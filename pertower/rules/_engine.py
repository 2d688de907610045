"""method="rules": per-example gradients from one batched backward pass and per-op rules.

Notation:
    B   examples in the batch          G   groups: B (per example) or M (microbatches)
    x   one weight (entry of `xs`)     A   a weight-consuming op's batch-side input
    Z   that op's output               dZ  d sum(grad_ys * ys) / dZ, from ONE tf.gradients

For every weight x, every read of x that `ys` depends on must reach an op that has a
rule (`pertower.rules`), possibly through layout-only ops on the weight side
(Identity, ExpandDims, Squeeze, Reshape: Conv1D's filter is ExpandDims(W)); and
`pertower._batch_axis` must prove that the op's A and Z rows belong to examples and that
row i of `ys` depends on example i alone. Then

    grad_i(x) = sum over the uses u of x of  rule_u(A_u, dZ_u) for example i,

the chain rule summed over every use (a shared layer adds its contributions). A weight
for which anything is unproven is reported with the reason and left to the towers.
"""

import dataclasses

import tensorflow as tf

from pertower import _checks
from pertower import _batch_axis
from pertower.rules import _rows

# Ops that only re-lay-out the weight's value (same elements, same order).
_WEIGHT_LAYOUT_OPS = frozenset({"Identity", "Snapshot", "ExpandDims", "Squeeze", "Reshape"})
# Ops that take a value into a TF1 (v1) while loop's frame.
_V1_LOOP_ENTER_TYPES = frozenset({"Enter", "RefEnter"})


def build_plan(prepared, registry):
    """Decides, for every weight, whether the rules cover it. Builds no ops.

    Returns:
      (uses, reasons): per entry of xs, a tuple of `rules.Use` (empty when `ys` does
      not reach x) or None when x falls back to the towers; and why it falls back
      (str) or None.
    """
    ys, batch = prepared.ys, prepared.batch
    analysis = prepared.analysis
    if analysis is None or analysis.registry is not registry:
        analysis = _batch_axis.analyze(ys, batch, prepared.ys_upstream, prepared.batch_size,
                                       prepared.num_groups, registry)
    if analysis.verdict != "independent":
        lost = analysis.lost_at
        where = (f"; the proof was lost at {lost[0].name!r} ({lost[0].type}): {lost[1]}"
                 if lost is not None else "")
        reason = (f"the rows of `ys` ({ys.name}) could not be traced to the examples of "
                  f"the batch{where}")
        return (tuple(None if r.reached else () for r in prepared.reads),
                tuple(reason if r.reached else None for r in prepared.reads))
    uses, reasons = [], []
    for x, reads in zip(prepared.xs, prepared.reads):
        found = _weight_uses(x, reads, prepared.ys_upstream, analysis, registry)
        if isinstance(found, str):
            uses.append(None)
            reasons.append(found)
        else:
            uses.append(tuple(found))
            reasons.append(None)
    return tuple(uses), tuple(reasons)


def _weight_uses(x, reads, ys_upstream, analysis, registry):
    """The `Use`s of x, or a string saying why x is not covered."""
    if not reads.reached:
        return []
    if reads.call_inputs:
        op, _ = reads.call_inputs[0]
        return (f"it is read inside the function body of {op.name!r} ({op.type}), where "
                "no rule looks")
    if reads.loop_inputs:
        return _in_v1_loop(reads.loop_inputs[0])
    terminals = [(op, 0) for op in reads.gather_ops]
    stack = list(reads.read_tensors)
    while stack:
        tensor = stack.pop()
        for op in tensor.consumers():
            if op not in ys_upstream:
                continue
            slots = [j for j, t in enumerate(op.inputs) if t is tensor]
            if (op.type in _WEIGHT_LAYOUT_OPS and slots == [0] and
                    op.outputs[0].shape.is_fully_defined() and
                    all(_batch_axis.static_value(t) is not None for t in op.inputs[1:])):
                stack.append(op.outputs[0])
                continue
            terminals.extend((op, j) for j in slots)
    found = []
    terminals.sort(key=lambda pair: (pair[0]._id, pair[1]))  # pylint: disable=protected-access
    for op, slot in terminals:
        if op.type in _V1_LOOP_ENTER_TYPES:
            return _in_v1_loop(op)
        rule = registry.lookup(op.type)
        if rule is None:
            return f"it is read by {op.name!r} ({op.type}), which has no rule"
        use = rule.match(op, slot, analysis)
        if isinstance(use, str):
            return f"it is read by {op.name!r} ({op.type}): {use}"
        if use.rule is not rule:   # the registered rule computes what it matched
            use = dataclasses.replace(use, rule=rule)
        if use.weight_shape is None:   # read through a resource handle
            if not isinstance(x, tf.Variable):
                return f"it is read through a resource handle at {op.name!r} ({op.type})"
            use = dataclasses.replace(use, weight_shape=x.shape)
        if not use.weight_shape.is_fully_defined():
            return f"its shape at {op.name!r} ({use.weight_shape}) is not static"
        found.append(use)
    return found


def _in_v1_loop(enter):
    return (f"it is read inside the TF1 (v1) while loop that {enter.name!r} ({enter.type}) "
            "enters, where tf.gradients cannot reach the dZ a rule needs")


def group_count(prepared, num_groups):
    """G: M, or B (an int when known, else a scalar tensor read from the batch)."""
    if num_groups is not None:
        return num_groups
    if prepared.batch_size is not None:
        return prepared.batch_size
    return tf.shape(prepared.batch[0])[0]


def run_time_checks(prepared, function_name):
    """Assertions on the fed batch: its size equals `batch_size` when one was given
    for a None batch axis; M divides it when B is left to run time."""
    checks = []
    B, M = prepared.batch_size, prepared.num_groups
    for j, b in enumerate(prepared.batch):
        if _checks.static_batch_size(b) is not None:
            continue
        fed = tf.shape(b)[0]
        if B is not None:
            # One string tensor, so the error reads as one sentence (a data list would
            # print each piece in its own brackets).
            message = tf.strings.join([
                f"pertower: the gradients were built for a batch of {B} examples "
                f"(batch_size={B}), but the batch fed to {b.name} has ",
                tf.strings.as_string(fed),
                f" examples. Feed batches of {B} examples, build the gradients again for "
                "the new batch size, or use method='rules' without batch_size."])
            checks.append(tf.debugging.Assert(tf.equal(fed, B), [message],
                                              name=f"check_batch_size_{j}"))
        elif M is not None:
            message = tf.strings.join([
                f"pertower.{function_name}: `num_microbatches` ({M}) must divide the "
                f"batch size, but the batch fed to {b.name} has ",
                tf.strings.as_string(fed), f" examples. Feed a multiple of {M} examples."])
            checks.append(tf.debugging.Assert(
                tf.equal(tf.math.floormod(fed, M), 0), [message],
                name=f"check_microbatches_{j}"))
    return checks


def _output_gradients(plan, indices, grad_ys, unconnected):
    """{id(Z): dZ} from one tf.gradients call over every use's output."""
    ys = plan.prepared.ys
    outputs, seen = [], set()
    for k in indices:
        for use in plan.uses[k]:
            if id(use.output) not in seen:
                seen.add(id(use.output))
                outputs.append(use.output)
    if not outputs:
        return {}
    grads = tf.gradients(ys, outputs, grad_ys=grad_ys, unconnected_gradients=unconnected)
    return {id(z): g for z, g in zip(outputs, grads)}


def check_grad_ys(ys, grad_ys):
    """grad_ys as a tensor of ys's dtype and shape (None stays None)."""
    if grad_ys is None:
        return None
    grad_ys = tf.convert_to_tensor(grad_ys, dtype=ys.dtype)
    if not ys.shape.is_compatible_with(grad_ys.shape):
        raise ValueError("pertower: `grad_ys` must have the shape of `ys`, "
                         f"{ys.shape}, but has shape {grad_ys.shape}.")
    return grad_ys


def _per_x_shape(x, G):
    """[G, *x.shape] as a reshape target."""
    if x.shape.is_fully_defined():
        return _rows.group_shape(G, x.shape.as_list())
    return tf.concat([[G], tf.shape(x)], axis=0)


def _zeros(x, G):
    return tf.zeros(_per_x_shape(x, G), dtype=x.dtype.base_dtype)


def gradients(plan, indices, G, grad_ys=None, unconnected_gradients="zero",
              function_name="gradients"):
    """{k: [G, *xs[k].shape]} for the covered weights `indices` (or None for a weight
    that `ys` does not reach, or whose outputs get no gradient, with
    unconnected_gradients="none")."""
    unconnected = _checks.unconnected_gradients_value(unconnected_gradients, function_name)
    grad_ys = check_grad_ys(plan.prepared.ys, grad_ys)
    d_outputs = _output_gradients(plan, indices, grad_ys, unconnected)
    results = {}
    for k in indices:
        x = plan.prepared.xs[k]
        parts = []
        for use in plan.uses[k]:
            dZ = d_outputs[id(use.output)]
            if dZ is None:
                continue
            # the rule's [G, *w.shape at the op] -> [G, *x.shape]
            parts.append(tf.reshape(use.rule.per_group(use, dZ, G), _per_x_shape(x, G)))
        if not parts:
            if unconnected == tf.UnconnectedGradients.NONE:
                results[k] = None
                continue
            parts = [_zeros(x, G)]
        total = tf.add_n(parts) if len(parts) > 1 else parts[0]
        total.set_shape(tf.TensorShape([G if isinstance(G, int) else None])
                        .concatenate(x.shape))
        results[k] = total
    return results


def squared_norms(plan, indices, B):
    """{k: [B] squared norms of example i's gradient with respect to xs[k]}; a rule's
    cheap form when x has one use and the rule has one, else formed and reduced."""
    d_outputs = _output_gradients(plan, indices, None, tf.UnconnectedGradients.ZERO)
    results = {}
    for k in indices:
        uses = plan.uses[k]
        if not uses:
            continue
        if len(uses) == 1:
            use = uses[0]
            cheap = use.rule.squared_norms(use, d_outputs[id(use.output)], B)
            if cheap is not None:
                results[k] = cheap
                continue
        parts = [use.rule.per_group(use, d_outputs[id(use.output)], B) for use in uses]
        parts = [tf.reshape(p, [tf.shape(p)[0], -1]) for p in parts]   # [B, P_use]
        total = tf.add_n(parts) if len(parts) > 1 else parts[0]
        results[k] = tf.reduce_sum(tf.square(total), axis=1)           # [B]
    return results

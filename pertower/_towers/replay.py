"""The towers' replay: S copied once per tower with one import, on slices and copies.

Notation:
    B   examples in the batch            T   towers; each takes B/T examples
    x   one weight (entry of `xs`)       c_t tower t's copy of x
    S   the replayed ops (`Request.replay_region`)

Tower t's copy of S reads its slices of the batch tensors instead of the batch, and
c_t instead of every read of x (`Replay.copies`); gathers from a weight's handle become
gathers from the copy, and ops that call functions reading a weight inside get the
copy as an input and rewritten functions (`pertower._towers.functions`). Values
computed from the batch's size that feed a computation are read from the whole
batch's graph (the analysis' `size_data_edges`). An op whose gradient the user wrote in
Python gets, in each tower, a gradient that runs it on the tower's own tensors
(`pertower._towers.python_gradients`). A replay without copies (every entry of `copies`
None) recomputes `ys` slice by slice, forward only.
"""

import dataclasses

import tensorflow as tf

from pertower import _context
from pertower import _graph_walk as graph_walk
from pertower import _op_types as op_types
from pertower import _tf
from pertower._towers import functions as control_flow
from pertower._towers import python_gradients
from pertower._towers import replicate as replicate_lib

__all__ = ["Replay", "replay", "derived_entries", "call_positions", "node_def",
           "value_specs", "where"]

_BAKED = ("This happens when the graph bakes its batch size into constants; build the "
          "model on placeholders whose batch axis is None.")
# Ops that open a TF1 (v1) while loop's frame, named by their `frame_name` attribute.


@dataclasses.dataclass(frozen=True)
class Replay:
    """What one replay of S for T towers reads.

    Attributes:
      request: the `pertower._request.Request` (ys, the batch tensors, the weights'
        reads, the graph and the analysis' size-data edges).
      copies: copies[k][t] is tower t's copy of xs[k], or None (not copied).
      unique: the indices k mapped (the first of a repeated weight; derived entries
        left out).
      call_positions: {call op: {input index: k}} (see `call_positions`).
      rewriter: the `FunctionRewriter` of the towers' function copies.
      slices: slices[j][t], tower t's slice of batch[j].
      replayed: the ops S.
      num_towers: T.
      devices: device strings (tower t on devices[t % len(devices)]), or None.
      also: tensors of S whose tower versions are returned after the output.
      shared_rows: (tensor, its T slices) pairs: per-example values made outside S
        that tower t reads its slice of (a shared sampler's true_expected_count,
        `pertower._towers.shared_draws`).
    """

    request: object
    copies: list
    unique: list
    call_positions: dict
    rewriter: object
    slices: list
    replayed: frozenset
    num_towers: int
    devices: object = None
    also: tuple = ()
    shared_rows: tuple = ()


def derived_entries(reads, replayed):
    """The entries of xs computed from other entries.

    Returns:
      (derived, aliases): `derived`, the indices k (first of a repeated entry) of the
      tensor entries whose op the towers replay (computed from another entry's read);
      `aliases`, {k: j} for a tensor entry xs[k] that is itself a read tensor of the
      variable xs[j] (its copies are made from xs[j]'s).
    """
    derived, aliases, first_index = [], {}, {}
    for k, r in enumerate(reads):
        if first_index.setdefault(id(r.x), k) != k or not r.reached:
            continue
        if not isinstance(r.x, tf.Tensor) or r.x.dtype == tf.resource:
            continue
        if r.x.op in replayed:
            derived.append(k)
            continue
        for j, other in enumerate(reads):
            if (j != k and other.reached and first_index.get(id(other.x), j) == j
                    and not isinstance(other.x, tf.Tensor)
                    and any(t is r.x for t in other.read_tensors)):
                aliases[k] = j
                break
    return derived, aliases


def call_positions(reads, xs):
    """{call op: {input index: k}}: the function-calling ops that get the handle of
    xs[k] as an input (the first k of a weight listed twice)."""
    positions = {}
    first_index = {}
    for k, r in enumerate(reads):
        if first_index.setdefault(id(r.x), k) != k:
            continue
        for op, index in r.call_inputs:
            positions.setdefault(op, {})[index] = k
    return positions


def node_def(op):
    """A copy of op's NodeDef without the attributes a replay drops."""
    return replicate_lib.drop_name_attrs(op.node_def)


def value_specs(positions, reads):
    """{input index: (DataType enum, shape)} of the weight values replacing handles."""
    return {i: (reads[k].dtype.as_datatype_enum, _value_shape(reads[k]))
            for i, k in positions.items()}


def _value_shape(r):
    """The static shape of the weight value of `r` (a WeightReads)."""
    if isinstance(r.x, tf.Variable):
        return r.x.shape
    handle_data = _tf.handle_data(r.x)
    if handle_data is not None and handle_data.shape_and_type:
        return tf.TensorShape(handle_data.shape_and_type[0].shape)
    return tf.TensorShape(None)


def where(op, positions, reads):
    """Names the call op (and the weights it reads) in error messages."""
    if not positions:
        return f"op {op.name!r} ({op.type})"
    names = ", ".join(repr(reads[k].name) for k in positions.values())
    return f"the weight {names} read inside op {op.name!r} ({op.type})"


def _failure_cause(request):
    """What most likely makes a replay on slices fail: a batch size baked into the
    graph when some batch axis is static, else where the analysis lost the rows."""
    if request.any_static_size:
        return _BAKED
    analysis = request.analysis
    lost = analysis.lost_at if analysis is not None else None
    where = (f" (the analysis lost the examples' rows at {lost[0].name!r} "
             f"({lost[0].type}): {lost[1]})" if lost is not None else "")
    return ("The batch axis is None, so no batch size is baked in: an op between the batch "
            "and `ys` needs several examples together" + where + ", e.g. a reshape that "
            "pairs examples (tf.reshape(h, [-1, 2 * n])). Then row i of `ys` is not "
            "computed from example i alone and has no per-example gradient; keep each "
            "example in its own row (reshape only the non-batch axes), or use "
            "microbatch_gradients with microbatches that hold whole groups.")


def replay(spec):
    """Adds S once per tower with one import; returns, per tower, [its output
    [B/T, ...], then its versions of the tensors `spec.also`] (see `Replay`)."""
    request, copies, slices, T = spec.request, spec.copies, spec.slices, spec.num_towers
    ys, batch, reads, graph = request.ys, request.batch, request.reads, request.graph
    rewriter, replayed, call_positions = spec.rewriter, spec.replayed, spec.call_positions
    unique, devices = spec.unique, spec.devices
    per_tower_inputs = [{} for _ in range(T)]  # tower t: tensor name -> replacement
    for j, b in enumerate(batch):
        for t in range(T):
            per_tower_inputs[t][b.name] = slices[j][t]
    for tensor, parts in spec.shared_rows:
        for t in range(T):
            per_tower_inputs[t][tensor.name] = parts[t]
    for k in unique:
        for tensor in reads[k].read_tensors:
            for t in range(T):
                per_tower_inputs[t][tensor.name] = copies[k][t]
    for k in unique:  # an entry that is another's read replaces that read in its towers
        if isinstance(reads[k].x, tf.Tensor) and copies[k] is not None:
            for t in range(T):
                per_tower_inputs[t][reads[k].x.name] = copies[k][t]
    gathers = {op: k for k in unique for op in reads[k].gather_ops}
    axis_zero = tf.constant(0, name="gather_axis") if gathers else None
    whole_batch = {}  # op -> input indices that read the whole batch's size value
    for op, index in request.analysis.size_data_edges:   # (see `Replay`)
        if op in replayed:
            whole_batch.setdefault(op, []).append(index)
    true_constant = []  # the predicate of function calls turned into If ops, made once

    def counterpart(item, t):
        """Tower t's slice or copy in place of `item`; None for anything shared."""
        if isinstance(item, tf.Tensor):
            return per_tower_inputs[t].get(item.name)
        return None

    def edit_node(node, op, t, key_for):
        """Tower t's NodeDef of `op`: its slices, copies and whole-batch size values
        as inputs, gathers and function calls rewritten to read the copies."""
        mapping = per_tower_inputs[t]
        for i, tensor in enumerate(op.inputs):  # a batch tensor or read inside S
            if tensor.name in mapping:
                node.input[i] = key_for(mapping[tensor.name])
        for i in whole_batch.get(op, ()):  # the original graph's value, for the whole batch
            node.input[i] = key_for(op.inputs[i])
        if op in gathers:
            node.input[0] = key_for(copies[gathers[op]][t])
            control_flow.gather_from_value(node, reads[gathers[op]].dtype.as_datatype_enum,
                                           lambda: key_for(axis_zero))
        python.edit_node(node, op, t)   # an overridden gradient, on the tower's tensors
        if op.type in op_types.V1_ENTER_OP_TYPES:   # each tower runs its own copy of the loop frame
            frame = node.attr["frame_name"].s.decode()
            node.attr["frame_name"].s = f"{prefix}t{t}/{frame}".encode()
        if op.type in op_types.CALL_OP_TYPES:
            positions = call_positions.get(op, {})
            for i, k in positions.items():  # the handle becomes the copy
                node.input[i] = key_for(copies[k][t])

            def true_key():
                if not true_constant:
                    true_constant.append(tf.constant(True, name="call_predicate"))
                return key_for(true_constant[0])

            rewriter.rewrite_call(node, value_specs(positions, reads),
                                  where(op, positions, reads), t, true_key)

    with tf.name_scope("replay") as prefix:
        pass
    python = python_gradients.ReplayedGradients(graph, prefix)
    for t in range(T):
        python.register_tower(t, per_tower_inputs[t])
    # the overrides a weight's gradient flows through (downstream of its reads)
    starts = [t for k in unique for t in reads[k].read_tensors] + [
        t for k in unique for op in reads[k].gather_ops for t in op.outputs] + [
        t for op in call_positions for t in op.outputs]
    python.prepare(replayed, batch, graph_walk.downstream_ops(starts, replayed))
    try:
        outputs = replicate_lib.replicate(
            replayed, range(T), lambda op_name, t: f"{prefix}t{t}/{op_name}", counterpart,
            graph, [ys] + list(spec.also),
            device=(lambda t: devices[t % len(devices)]) if devices is not None else None,
            edit_node=edit_node, library=rewriter.library)
    except ValueError as error:
        raise _context.error(
            ValueError, "replaying the graph from the batch to `ys` on slices of "
            f"{graph_walk.static_batch_size(slices[0][0])} example(s) failed: {error}. "
            f"{_failure_cause(request)}") from error
    return outputs

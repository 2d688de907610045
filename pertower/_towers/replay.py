"""The towers' replay: S copied once per tower with one import, on slices and copies.

Notation as in `pertower._towers.build`.

Tower t's copy of S reads its slices of the batch tensors and c_t in place of every read
of x: gathers from x's handle become gathers from c_t, call ops get c_t and rewritten
functions (`pertower._towers.functions`), and ops whose gradient is written in Python get
one on the tower's own tensors (`pertower._towers.python_gradients`). Values computed
from the batch's size (`cost / tf.cast(tf.shape(x)[0], ...)`) are read from the whole
batch's graph (the analysis' `size_data_edges`).

An entry of `xs` computed from another entry (`w_eff = 2 * tf.identity(W)`, both in xs)
has no copy of its own: its tower-t version is the replay's copy of it, computed from
c_t of W, so that `tf.gradients` gives W the total derivative, as
`tf.gradients(ys, [W, w_eff])` does. An entry that *is* another entry's read
(`W.value()` next to W) gets tf.identity(c_t of W).
"""

import contextlib

import tensorflow as tf

from pertower import _context
from pertower import _graph_walk as graph_walk
from pertower import _op_types as op_types
from pertower import _tf
from pertower._towers import functions as control_flow
from pertower._towers import python_gradients
from pertower._towers import replicate as replicate_lib
from pertower._towers import slicing

__all__ = ["replay", "check_calls"]


def _first_indices(reads):
    """first[k]: the first index of the weight xs[k] in xs (a repeated entry, or another
    handle of the same variable, shares it: `WeightReads.key`)."""
    first_index = {}
    return [first_index.setdefault(r.key, k) for k, r in enumerate(reads)]


def _derived_entries(reads, replayed, first):
    """(derived, aliases): the indices k of the tensor entries whose op S holds
    (computed from another entry's read), and {k: j} for a tensor entry xs[k] that is
    itself a read tensor of the variable xs[j]."""
    derived, aliases = [], {}
    for k, r in enumerate(reads):
        if (first[k] != k or not r.reached or not isinstance(r.x, tf.Tensor)
                or r.x.dtype == tf.resource):
            continue
        if r.x.op in replayed:
            derived.append(k)
            continue
        for j, other in enumerate(reads):
            if (j != k and other.reached and first[j] == j
                    and not isinstance(other.x, tf.Tensor)
                    and any(t is r.x for t in other.read_tensors)):
                aliases[k] = j
                break
    return derived, aliases


def _call_positions(reads, first):
    """{call op: {input index: k}}: the function-calling ops that get the handle of
    xs[k] as an input."""
    positions = {}
    for k, r in enumerate(reads):
        if first[k] == k:
            for op, index in r.call_inputs:
                positions.setdefault(op, {})[index] = k
    return positions


def _value_specs(positions, reads):
    """{input index: (DataType enum, static shape)} of the weight values replacing handles."""
    specs = {}
    for i, k in positions.items():
        r = reads[k]
        shape = tf.TensorShape(None)
        if isinstance(r.x, tf.Variable):
            shape = r.x.shape
        elif _tf.handle_data(r.x) is not None and _tf.handle_data(r.x).shape_and_type:
            shape = tf.TensorShape(_tf.handle_data(r.x).shape_and_type[0].shape)
        specs[i] = (r.dtype.as_datatype_enum, shape)
    return specs


def _where(op, positions, reads):
    """Names the call op (and the weights it reads) in error messages."""
    if not positions:
        return f"op {op.name!r} ({op.type})"
    names = ", ".join(repr(reads[k].name) for k in positions.values())
    return f"the weight {names} read inside op {op.name!r} ({op.type})"


def check_calls(request, replayed):
    """Rewrites the functions of every call op of `replayed` once, for a trial tower,
    so that a refusal comes before any op is added (the towers get their own rewrites
    in `replay`)."""
    reads = request.reads
    positions_of = _call_positions(reads, _first_indices(reads))
    trial = control_flow.FunctionRewriter(request.graph, "trial")
    for op in sorted(replayed, key=_tf.op_order_key()):
        if op.type in op_types.FUNCTION_CALL_OP_TYPES and request.graph.building_function:
            # inside a tf.function, TensorFlow differentiates a tower's copy of a call
            # with the original call's backward, built for all B examples
            raise _context.error(control_flow.ControlFlowError, (
                f"`ys` is computed inside a tf.function, and towers would replay the "
                f"call {op.name!r} ({op.type}: a tf.function called in it, e.g. a Keras "
                "GRU or LSTM layer of TensorFlow 2) for each example; inside a "
                "tf.function TensorFlow differentiates such a copy with the backward of "
                "the whole batch, which fails. Build the model in graph mode "
                "(tf.compat.v1.disable_eager_execution()), or use "
                "keras.layers.RNN(keras.layers.LSTMCell(n)) (or GRUCell) in place of "
                "LSTM(n)/GRU(n), whose loop the rules cover in a tf.function, or call the "
                "inner function's Python without tf.function, or leave those weights out "
                "of `xs` (pertower.explain lists the weights that fall to towers)."))
        if op.type in op_types.CALL_OP_TYPES:
            positions = positions_of.get(op, {})
            trial.rewrite_call(replicate_lib.drop_name_attrs(op.node_def),
                               _value_specs(positions, reads), _where(op, positions, reads),
                               0, lambda: "trial")


def _copies(reads, first, derived, aliases, T, devices):
    """copies[k][t] = tf.identity of xs[k]'s value for tower t; None for an unreached
    entry, a repeated one and one made from another entry's copies (filled in later)."""

    place = slicing.device_function(devices)

    def per_tower(k, source_of):
        with tf.name_scope(f"copies_{k}"):
            tower_copies = []
            for t in range(T):
                with tf.device(place(t)) if place else contextlib.nullcontext():
                    tower_copies.append(tf.identity(source_of(t), name=f"tower_{t}"))
            return tuple(tower_copies)

    copies = [None if first[k] != k or not r.reached or k in derived or k in aliases
              else per_tower(k, lambda t, r=r: r.copy_source)
              for k, r in enumerate(reads)]
    for k, j in aliases.items():  # xs[k] is a read of xs[j]: c_t(k) = c_t(j)
        copies[k] = per_tower(k, lambda t, j=j: copies[j][t])
    return copies


def _failure_cause(request):
    """What most likely makes a replay on slices fail: a batch size baked into the
    graph when some batch axis is static, else where the analysis lost the rows."""
    if request.any_static_size:
        return ("This happens when the graph bakes its batch size into constants; build "
                "the model on placeholders whose batch axis is None.")
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


def replay(request, replayed, slices, shared_rows, T, devices):
    """Adds the weight copies, then S once per tower with one import.

    Args:
      request: the checked `pertower._request.Request`; replayed: the ops S.
      slices: slices[j][t], tower t's slice of batch[j], [B/T, ...].
      shared_rows: (tensor, its T slices) pairs made outside S (`slicing.shared_rows`).
      T: the number of towers; devices: device strings, or None.

    Returns:
      (outputs, copies): outputs[t], tower t's replay of `ys`, [B/T, ...]; copies[k][t],
      tower t's version of xs[k] (None when `ys` does not reach xs[k]).
    """
    ys, batch, reads, graph = request.ys, request.batch, request.reads, request.graph
    first = _first_indices(reads)
    derived, aliases = _derived_entries(reads, replayed, first)
    copies = _copies(reads, first, derived, aliases, T, devices)
    unique = [k for k in range(len(reads)) if first[k] == k and k not in derived]
    call_positions = _call_positions(reads, first)
    # a token unique in the graph names this build's function copies
    token = graph.unique_name("pertower", mark_as_used=True).replace("/", "_")
    rewriter = control_flow.FunctionRewriter(graph, token)
    per_tower_inputs = [{} for _ in range(T)]  # tower t: tensor name -> replacement
    for t in range(T):
        for j, b in enumerate(batch):
            per_tower_inputs[t][b.name] = slices[j][t]
        for tensor, parts in shared_rows:
            per_tower_inputs[t][tensor.name] = parts[t]
        for k in unique:
            for tensor in reads[k].read_tensors:
                per_tower_inputs[t][tensor.name] = copies[k][t]
        for k in unique:  # an entry that is another's read replaces that read
            if isinstance(reads[k].x, tf.Tensor) and copies[k] is not None:
                per_tower_inputs[t][reads[k].x.name] = copies[k][t]
    gathers = {op: k for k in unique for op in reads[k].gather_ops}
    axis_zero = tf.constant(0, name="gather_axis") if gathers else None
    whole_batch = {}  # op -> input indices that read the whole batch's size value
    for op, index in request.analysis.size_data_edges:
        if op in replayed:
            whole_batch.setdefault(op, []).append(index)
    true_constant = []  # the predicate of function calls turned into If ops, made once

    def true_key(key_for):
        if not true_constant:
            true_constant.append(tf.constant(True, name="call_predicate"))
        return key_for(true_constant[0])

    def counterpart(item, t):
        """Tower t's slice or copy in place of `item`; None for anything shared."""
        if isinstance(item, tf.Tensor):
            return per_tower_inputs[t].get(item.name)
        return None

    def edit_node(node, op, t, key_for):
        """Tower t's NodeDef of `op`: its slices, copies and whole-batch size values
        as inputs, gathers and function calls rewritten to read the copies."""
        for i, tensor in enumerate(op.inputs):  # a batch tensor or read inside S
            if tensor.name in per_tower_inputs[t]:
                node.input[i] = key_for(per_tower_inputs[t][tensor.name])
        for i in whole_batch.get(op, ()):
            node.input[i] = key_for(op.inputs[i])
        if op in gathers:
            node.input[0] = key_for(copies[gathers[op]][t])
            control_flow.gather_from_value(node, reads[gathers[op]].dtype.as_datatype_enum,
                                           lambda: key_for(axis_zero))
        python.edit_node(node, op, t)   # an overridden gradient, on the tower's tensors
        if op.type in op_types.V1_ENTER_OP_TYPES:   # each tower its own TF1 loop frame
            frame = node.attr["frame_name"].s.decode()
            node.attr["frame_name"].s = f"{prefix}t{t}/{frame}".encode()
        if op.type in op_types.CALL_OP_TYPES:
            positions = call_positions.get(op, {})
            for i, k in positions.items():  # the handle becomes the copy
                node.input[i] = key_for(copies[k][t])
            rewriter.rewrite_call(node, _value_specs(positions, reads),
                                  _where(op, positions, reads), t, lambda: true_key(key_for))

    with tf.name_scope("replay") as prefix:
        pass
    python = python_gradients.ReplayedGradients(graph, prefix, per_tower_inputs)
    # the overrides a weight's gradient flows through (downstream of its reads)
    starts = [t for k in unique for t in reads[k].read_tensors] + [
        t for k in unique for op in reads[k].gather_ops for t in op.outputs] + [
        t for op in call_positions for t in op.outputs]
    python.prepare(replayed, batch, graph_walk.downstream_ops(starts, replayed))
    try:
        versions = replicate_lib.replicate(
            replayed, range(T), lambda op_name, t: f"{prefix}t{t}/{op_name}", counterpart,
            graph, [ys] + [reads[k].x for k in derived],
            device=slicing.device_function(devices), edit_node=edit_node,
            library=rewriter.library)
    except ValueError as error:
        raise _context.error(
            ValueError, "replaying the graph from the batch to `ys` on slices of "
            f"{graph_walk.static_batch_size(slices[0][0])} example(s) failed: {error}. "
            f"{_failure_cause(request)}") from error
    for position, k in enumerate(derived):  # the replay's own copy of xs[k]
        copies[k] = tuple(tower[1 + position] for tower in versions)
    copies = [copies[first[k]] for k in range(len(reads))]
    return [tower[0] for tower in versions], copies

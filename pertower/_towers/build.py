"""Towers: replay the graph from the batch to `ys` once per slice, on weight copies.

Notation:
    B   examples in the batch            T   towers; each takes B/T examples
    x   one weight (entry of `xs`)       c_t tower t's `tf.identity` copy of x
    S   the replayed ops (see graph_walk)

The mechanism (Goodfellow's trick, "Efficient per-example gradient computations",
arXiv 1510.01799, in its simplest form): split every batch tensor on axis 0 into T
slices, give tower t its own copy c_t = tf.identity(x) of each weight, replay S on
slice t with c_t in place of every read of x, and stack the tower outputs, which then
equal `ys`. Because tower t's output depends on c_t and on no other tower's copy,

    d/d c_t  sum_t' sum(y_t')  =  d sum(y_t) / d x      (the gradient of tower t alone),

so a single `tf.gradients` call over all copies returns T separate gradients. With
T = B these are per-example gradients; with T = M < B, microbatch gradients. The
backward pass is built by `pertower._towers.backward`.

The replay copies S for the T towers with one `pertower._towers.replicate.replicate`
call (one GraphDef, one import), mapping the batch tensors to the tower's slices and
the weight reads to the tower's copies. Gathers from a weight's handle become gathers
from the copy, and ops that call functions reading a weight inside (while loops,
conds, `tf.function` calls) get the copy as an input and rewritten functions (see
`pertower._towers.functions`). Values computed from the batch's size that feed a
computation (`cost / tf.cast(tf.shape(x)[0], tf.float32)`) are read from the whole
batch's graph, so that the tower rows are the rows of `ys`; shape uses keep the
tower's own size (see `pertower._batch_axis.size_values`). With `devices`, tower t's
copies and replayed ops are placed on devices[t % len(devices)]. The user's ops,
variables and values are left untouched; only new ops are added, under one name scope.
"""

import contextlib
import dataclasses
import warnings

import tensorflow as tf

from pertower import _checks
from pertower import _request as _prepare
from pertower import _graph_walk as graph_walk
from pertower._batch_axis import size_values
from pertower._towers import backward
from pertower._towers import functions as control_flow
from pertower._towers import replicate as replicate_lib

__all__ = ["Towers", "build_towers"]

# Ops that open a TF1 (v1) while loop's frame, named by their `frame_name` attribute.
_V1_ENTER_TYPES = frozenset({"Enter", "RefEnter"})


@dataclasses.dataclass(frozen=True)
class Towers:
    """The tensors one `build_towers` call made. Immutable; all fields are graph tensors.

    Attributes:
      ys: the per-example tensor the towers replay, [B, ...].
      xs: the weights, as given (tuple).
      batch: the batch tensors that were split (tuple), each [B, ...].
      batch_size: B, the number of examples the towers were built for.
      num_towers: T; each tower takes B/T contiguous examples.
      slices: slices[t][j] is tower t's part of batch[j], [B/T, ...].
      copies: copies[k][t] is tower t's copy of xs[k], [*x.shape]; copies[k] is None
        when `ys` does not depend on xs[k].
      outputs: outputs[t] is tower t's replay of `ys`, [B/T, ...].
      stacked: the tower outputs concatenated, [B, ...]; equal to `ys`.
      devices: the device strings the towers were placed on round-robin (tower t on
        devices[t % len(devices)]), or None when they were not placed.
    """

    ys: tf.Tensor
    xs: tuple
    batch: tuple
    batch_size: int
    num_towers: int
    slices: tuple
    copies: tuple
    outputs: tuple
    stacked: tf.Tensor
    devices: tuple = None

    def gradients(self, grad_ys=None, unconnected_gradients="zero", name=None, sparse=False):
        """The gradient of each tower's output with respect to its own copies.

        Equal to one `tf.gradients` call over every tower's copies (built as described
        in `pertower._towers.backward`).

        Args:
          grad_ys: None (all ones: sum the outputs), or a tensor shaped like `ys`,
            [B, ...], weighting each output entry (split by tower like the batch).
          unconnected_gradients: "zero" or "none", as in `tf.gradients`.
          name: name scope for the ops.
          sparse: when True, a weight whose every tower gradient is a
            `tf.IndexedSlices` (a weight read only by gathers, e.g. an embedding) gets
            a `pertower.PerExampleIndexedSlices` (the looked-up rows, their ids and
            their towers) instead of the dense [T, *x.shape].

        Returns:
          A list with one entry per x: [T, *x.shape], entry t the gradient of
          sum(grad_ys_t * y_t) with respect to x, computed on tower t's slice alone;
          or None for a weight `ys` does not reach when unconnected_gradients="none".
        """
        return backward.gradients(self, grad_ys=grad_ys,
                                  unconnected_gradients=unconnected_gradients, name=name,
                                  sparse=sparse)


def build_towers(ys, xs, batch=None, batch_size=None, num_microbatches=None, name=None,
                 devices=None, num_towers=None):
    """Builds T towers that replay the graph from the batch to `ys`.

    Args:
      ys: a tensor whose axis 0 is the batch, [B, ...].
      xs: a variable or tensor, or a list of them (e.g. `model.trainable_weights`).
      batch: the tensor(s) carrying the batch on axis 0 that `ys` depends on; found
        by walking back from `ys` to its placeholders and iterator outputs when None.
      batch_size: B when the batch axis is not static; read from the graph otherwise.
      num_microbatches: T, the number of towers, which must divide B; None means one
        tower per example (T = B).
      name: name scope for the new ops (default "towers").
      devices: None, or a list of device strings ("/cpu:0", "/gpu:1",
        "/job:worker/task:1/device:CPU:0", ...): tower t, its weight copies and its
        replayed ops are placed on devices[t % len(devices)]; the gradient ops are
        colocated with them by `tf.gradients`.
      num_towers: deprecated name of `num_microbatches` (a DeprecationWarning; giving
        both is a TypeError).

    Returns:
      A `Towers` record.

    Example:
      towers = pertower.build_towers(cost, net.trainable_weights, batch_size=32)
      per_example = towers.gradients()   # list of [32, *w.shape]
    """
    T, towers_argument = _checks.renamed_argument(
        num_microbatches, num_towers, "num_microbatches", "num_towers", "build_towers")
    return build(ys, xs, batch, T, batch_size, name or "towers", "build_towers",
                 towers_argument, devices)


def build(ys, xs, batch, num_towers, batch_size, scope, function_name, towers_argument,
          devices=None, prepared=None):
    """`build_towers` for the public functions: errors name `function_name` and call
    the number of towers `towers_argument`. `prepared`: what `pertower._request.prepare`
    returned for these same arguments (with B known), when the caller has checked them
    already; they are then not walked and scanned a second time."""
    if prepared is None:
        prepared = _prepare.prepare(ys, xs, batch, num_towers, batch_size, function_name,
                                    towers_argument, batch_size_required=True)
    devices = _checks.device_list(devices, function_name)
    ys, xs, graph, ys_upstream, batch, B = prepared[:6]
    T = B if prepared.num_groups is None else prepared.num_groups

    with graph.as_default():
        reads = prepared.reads
        sources = list(batch) + [t for r in reads for t in r.read_tensors]
        gather_ops = {op for r in reads for op in r.gather_ops}
        call_ops = {op for r in reads for op, _ in r.call_inputs}
        replayed = graph_walk.downstream_ops(sources, ys_upstream) | gather_ops | call_ops
        for op in gather_ops | call_ops:
            replayed |= graph_walk.downstream_ops(op.outputs, ys_upstream)
        # without weight copies (the run-time check's replay of `ys`) no gradient is
        # built through the replay, so TF1 loops may be replayed: frame and all
        forward_only = not any(r.reached for r in reads)
        graph_walk.check_replayable(replayed, function_name, forward_only)
        if forward_only:
            replayed |= graph_walk.v1_loop_frames(replayed, ys_upstream)
        # Rewrite the control-flow functions once now, so that a refusal comes before
        # any op is added; the towers get their own rewrites in _replay.
        call_positions = _call_positions(reads, xs)
        trial = control_flow.FunctionRewriter(graph, function_name, "trial")
        for op in sorted(replayed, key=lambda op: op._id):  # pylint: disable=protected-access
            if op.type in control_flow.CALL_OP_TYPES:
                positions = call_positions.get(op, {})
                trial.rewrite_call(_node_def(op), _value_specs(positions, reads),
                                   _where(op, positions, reads), 0, lambda: "trial")
        noisy = graph_walk.random_ops(replayed)
        if noisy:
            warnings.warn(
                f"pertower.{function_name}: `ys` depends on the random op "
                f"{noisy[0].name!r} ({noisy[0].type}), e.g. dropout in training mode. Each "
                "tower draws its own random numbers, so the towers' outputs (and "
                "gradients) use other draws than `ys` does in the same run.",
                stacklevel=3)

        with tf.name_scope(scope):
            slices = _split_batch(batch, B, T)
            copies, first_index = [], {}
            for k, r in enumerate(reads):
                first = first_index.setdefault(id(r.x), k)
                if first != k:  # a repeated x shares its copies
                    copies.append(copies[first])
                    continue
                if not r.reached:  # `ys` does not reach x
                    copies.append(None)
                    continue
                with tf.name_scope(f"copies_{k}"):
                    source = r.copy_source
                    tower_copies = []
                    for t in range(T):
                        with _on_device(devices, t):
                            tower_copies.append(tf.identity(source, name=f"tower_{t}"))
                    copies.append(tuple(tower_copies))
            unique = sorted(set(first_index.values()))
            # a token unique in the graph names this build's function copies
            token = graph.unique_name("pertower", mark_as_used=True).replace("/", "_")
            rewriter = control_flow.FunctionRewriter(graph, function_name, token)
            outputs = _replay(ys, batch, reads, copies, unique, call_positions, rewriter,
                              slices, replayed, T, graph, function_name, devices)
            outputs = _check_tower_rows(outputs, ys, batch, B, T, function_name)
            # T x [B/T, ...] -> [B, ...]
            stacked = tf.concat(outputs, axis=0, name="stacked")
    return Towers(ys=ys, xs=tuple(xs), batch=tuple(batch), batch_size=B, num_towers=T,
                  slices=tuple(zip(*slices)), copies=tuple(copies), outputs=tuple(outputs),
                  stacked=stacked, devices=devices)


def _split_batch(batch, B, T):
    """Each batch tensor [B, ...] -> T slices [B/T, ...], checking B at run time."""
    slices = []
    for j, b in enumerate(batch):
        with tf.name_scope(f"slices_{j}"):
            if _checks.static_batch_size(b) is None:
                fed = tf.shape(b)[0]
                # One string tensor: the error reads as one sentence.
                message = tf.strings.join([
                    f"pertower: the towers were built for a batch of {B} examples "
                    f"(batch_size={B}), but the batch fed to {b.name} has ",
                    tf.strings.as_string(fed),
                    f" examples. Feed batches of {B} examples, or build the towers "
                    "again for the new batch size."])
                check = tf.debugging.Assert(tf.equal(fed, B), [message],
                                            name="check_batch_size")
                with tf.control_dependencies([check]):
                    b = tf.identity(b)
            # [B, ...] -> T x [B/T, ...]
            parts = tf.split(b, T, axis=0)
            for part in parts:
                part.set_shape(tf.TensorShape([B // T]).concatenate(b.shape[1:]))
            slices.append(parts)
    return slices


def _check_tower_rows(outputs, ys, batch, B, T, function_name):
    """Each tower output must have B/T rows, one per example of its slice; otherwise
    axis 0 of `ys` is not the batch axis of `batch` (e.g. `ys` is computed from a
    concatenation of several batch tensors) and the towers would mix examples up."""
    # The message around the number of rows a tower produced.
    before = (f"pertower.{function_name}: axis 0 of `ys` ({ys.name}) does not follow the "
              f"batch ({', '.join(b.name for b in batch)}): a tower given {B // T} "
              "example(s) produced ")
    after = (" row(s). This happens when `ys` is computed from several batch tensors "
             "joined along axis 0 (pass `batch=` the joined tensor and its `batch_size`) "
             "or when the graph mixes rows across the batch axis.")
    rows = _checks.static_batch_size(outputs[0])
    if rows is not None:
        if rows != B // T:
            raise ValueError(f"{before}{rows}{after}")
        return outputs
    checked = []
    with tf.name_scope("check_rows"):
        for t, output in enumerate(outputs):
            produced = tf.shape(output)[0]
            message = tf.strings.join([before, tf.strings.as_string(produced), after])
            check = tf.debugging.Assert(tf.equal(produced, B // T), [message],
                                        name=f"tower_{t}")
            with tf.control_dependencies([check]):
                checked.append(tf.identity(output))
    return checked


def _on_device(devices, t):
    """The device scope of tower t (none when `devices` is None)."""
    if devices is None:
        return contextlib.nullcontext()
    return tf.device(devices[t % len(devices)])


def _call_positions(reads, xs):
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


def _node_def(op):
    """A copy of op's NodeDef without the attributes a replay drops."""
    return replicate_lib.drop_name_attrs(op.node_def)


def _value_specs(positions, reads):
    """{input index: (DataType enum, shape)} of the weight values replacing handles."""
    return {i: (reads[k].dtype.as_datatype_enum, _value_shape(reads[k]))
            for i, k in positions.items()}


def _value_shape(r):
    """The static shape of the weight value of `r` (a WeightReads)."""
    if isinstance(r.x, tf.Variable):
        return r.x.shape
    handle_data = getattr(r.x, "_handle_data", None)
    if handle_data is not None and handle_data.shape_and_type:
        return tf.TensorShape(handle_data.shape_and_type[0].shape)
    return tf.TensorShape(None)


def _where(op, positions, reads):
    """Names the call op (and the weights it reads) in error messages."""
    if not positions:
        return f"op {op.name!r} ({op.type})"
    names = ", ".join(repr(reads[k].name) for k in positions.values())
    return f"the weight {names} read inside op {op.name!r} ({op.type})"


def _replay(ys, batch, reads, copies, unique, call_positions, rewriter, slices, replayed, T,
            graph, function_name, devices):
    """Adds S once per tower with one import; returns the tower outputs T x [B/T, ...].

    `reads[k]` and `copies[k]` belong to xs[k]; only the entries `unique` (the first of
    a repeated weight) are mapped. Gathers from a weight's handle read the tower's
    copy; call ops in `call_positions` get their weight inputs replaced by the copies
    and their functions by `rewriter`'s rewrites; the size-data edges of S read the
    whole batch's size values."""
    per_tower_inputs = [{} for _ in range(T)]  # tower t: tensor name -> replacement
    for j, b in enumerate(batch):
        for t in range(T):
            per_tower_inputs[t][b.name] = slices[j][t]
    for k in unique:
        for tensor in reads[k].read_tensors:
            for t in range(T):
                per_tower_inputs[t][tensor.name] = copies[k][t]
    gathers = {op: k for k in unique for op in reads[k].gather_ops}
    axis_zero = tf.constant(0, name="gather_axis") if gathers else None
    whole_batch = {}  # op -> input indices that read the whole batch's size value
    for op, index in size_values.size_data_edges(replayed, batch):
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
        if op.type in _V1_ENTER_TYPES:   # each tower runs its own copy of the loop frame
            frame = node.attr["frame_name"].s.decode()
            node.attr["frame_name"].s = f"{prefix}t{t}/{frame}".encode()
        if op.type in control_flow.CALL_OP_TYPES:
            positions = call_positions.get(op, {})
            for i, k in positions.items():  # the handle becomes the copy
                node.input[i] = key_for(copies[k][t])

            def true_key():
                if not true_constant:
                    true_constant.append(tf.constant(True, name="call_predicate"))
                return key_for(true_constant[0])

            rewriter.rewrite_call(node, _value_specs(positions, reads),
                                  _where(op, positions, reads), t, true_key)

    with tf.name_scope("replay") as prefix:
        pass
    try:
        outputs = replicate_lib.replicate(
            replayed, range(T), lambda op_name, t: f"{prefix}t{t}/{op_name}", counterpart,
            graph, [ys],
            device=(lambda t: devices[t % len(devices)]) if devices is not None else None,
            edit_node=edit_node, library=rewriter.library)
    except ValueError as error:
        raise ValueError(
            f"pertower.{function_name}: replaying the graph from the batch to `ys` on "
            f"slices of {_checks.static_batch_size(slices[0][0])} example(s) failed: "
            f"{error}. This happens when the graph bakes its batch size into constants; "
            "build the model on placeholders whose batch axis is None.") from error
    return [tower[0] for tower in outputs]

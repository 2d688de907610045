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
T = B these are per-example gradients; with T = M < B, microbatch gradients. Since the
towers are identical but for their inputs, `Towers.gradients` builds that call's ops
for tower 0 only and copies them for towers 1 ... T-1 with one import
(`pertower.replicate`): the same ops, for a fraction of the build time. Towers that
run graph functions (tf.cond, while loops) make the one joint call instead.

The replay copies the NodeDefs of S into one GraphDef holding all T towers and adds it
with one `tf.graph_util.import_graph_def` call, mapping the batch tensors to the
tower's slices and the weight reads to the tower's copies. Ops that call functions
reading a weight inside (while loops, conds, `tf.function` calls) get the copy as an
input and rewritten functions (see `pertower.control_flow`). With `devices`, tower t's
copies and replayed ops are placed on devices[t % len(devices)]. The user's ops,
variables and values are left untouched; only new ops are added, under one name scope.
"""

import contextlib
import collections
import dataclasses
import warnings

import tensorflow as tf
from tensorflow.core.framework import graph_pb2

from pertower import _checks
from pertower import _request as _prepare
from pertower._towers import functions as control_flow
from pertower import _graph_walk as graph_walk
from pertower._towers import replicate as replicate_lib
from pertower._towers import sparse as sparse_lib

__all__ = ["Towers", "build_towers"]


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

        Equal to one `tf.gradients` call over every tower's copies (see the module
        docstring for how it is built).

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
        unconnected = _checks.unconnected_gradients_value(unconnected_gradients,
                                                          "Towers.gradients")
        T = self.num_towers
        with tf.name_scope(name or "tower_gradients"):
            grad_outputs = [None] * T
            if grad_ys is not None:
                grad_ys = tf.convert_to_tensor(grad_ys, dtype=self.ys.dtype)
                if not self.stacked.shape.is_compatible_with(grad_ys.shape):
                    raise ValueError(
                        "pertower: `grad_ys` must have the shape of `ys`, "
                        f"{self.stacked.shape}, but has shape {grad_ys.shape}.")
                # [B, ...] -> T x [B/T, ...]
                grad_outputs = tf.split(grad_ys, T, axis=0)
            connected = [k for k, copies in enumerate(self.copies) if copies is not None]
            per_tower = self._replicated_gradients(connected, grad_outputs, unconnected,
                                                   sparse)
            if per_tower is None:
                per_tower = self._joint_gradients(connected, grad_outputs, unconnected)
            results = []
            for k, x in enumerate(self.xs):
                if k not in per_tower:
                    results.append(_zeros_per_tower(x, T)
                                   if unconnected == tf.UnconnectedGradients.ZERO else None)
                elif per_tower[k] is None:
                    results.append(None)
                elif isinstance(per_tower[k], _BatchedMatMul):
                    results.append(per_tower[k].stacked())
                elif sparse and all(isinstance(g, tf.IndexedSlices) for g in per_tower[k]):
                    results.append(sparse_lib.stack_tower_slices(per_tower[k],
                                                                 self.copies[k]))
                else:
                    dense = [_dense(g, c) for g, c in zip(per_tower[k], self.copies[k])]
                    # T x [*x.shape] -> [T, *x.shape]
                    results.append(tf.stack(dense, axis=0))
            return results

    def _joint_gradients(self, connected, grad_outputs, unconnected):
        """One `tf.gradients` call over every tower's copies.

        Returns {k: T gradients of xs[k] (tensors, IndexedSlices or None), or None when
        no tower reaches it}."""
        T = self.num_towers
        flat_copies = [c for k in connected for c in self.copies[k]]
        flat_grads = tf.gradients(
            list(self.outputs), flat_copies,
            grad_ys=None if grad_outputs[0] is None else list(grad_outputs),
            unconnected_gradients=unconnected) if flat_copies else []
        per_tower = {}
        for position, k in enumerate(connected):
            grads = flat_grads[position * T:(position + 1) * T]
            per_tower[k] = None if all(g is None for g in grads) else grads
        return per_tower

    def _replicated_gradients(self, connected, grad_outputs, unconnected, sparse=False):
        """Tower 0's backward pass built once by `tf.gradients`, then copied for towers
        1 ... T-1 with one import (see `pertower.replicate`).

        The copy is exact: tower t's forward ops are tower 0's with t's slices and
        copies in place of 0's, so the backward ops `tf.gradients` would build for
        tower t are tower 0's with t's tensors in place of 0's. Returns the same dict
        as `_joint_gradients`, or None when the towers run graph functions (control
        flow), whose gradients are built by rewriting the forward ops, so that only
        the joint call is sound. Gradients are made dense in tower 0 (and so in every
        copy) unless `sparse` keeps an IndexedSlices.
        """
        if not connected:
            return {}
        T = self.num_towers
        graph = self.ys.graph
        copies_0 = [self.copies[k][0] for k in connected]
        tower_0 = graph_walk.downstream_ops(
            list(self.slices[0]) + copies_0, graph_walk.upstream_ops([self.outputs[0]]))
        if replicate_lib.calls_functions(tower_0):
            return None
        # Tower 0's tensors that the backward pass may read, with every tower's.
        known = {}
        for t0, per_t in [(self.outputs[0], self.outputs), (grad_outputs[0], grad_outputs)]:
            if t0 is not None:
                known[t0.name] = per_t
        for j in range(len(self.batch)):
            known[self.slices[0][j].name] = [s[j] for s in self.slices]
        for k in connected:
            known[self.copies[k][0].name] = self.copies[k]
        replay_0 = _replay_prefix(self.stacked, 0)

        def counterpart(item, t):
            """Tower t's version of tower 0's `item` (a tensor or a control-input op)."""
            op = item if isinstance(item, tf.Operation) else item.op
            if op not in tower_0 and item.name not in known:
                return item  # shared by all towers
            if item.name in known:
                return known[item.name][t]
            if not item.name.startswith(replay_0):
                raise _NoCounterpart(item.name)
            name = _replay_prefix(self.stacked, t) + item.name[len(replay_0):]
            if isinstance(item, tf.Operation):
                return graph.get_operation_by_name(name)
            return graph.get_tensor_by_name(name)

        device_0 = self.devices[0] if self.devices else None
        with tf.name_scope("t0") as template_prefix, tf.device(device_0):
            first_new = len(graph.get_operations())
            grads = tf.gradients(
                [self.outputs[0]], copies_0,
                grad_ys=None if grad_outputs[0] is None else [grad_outputs[0]],
                unconnected_gradients=unconnected)
            grads_0 = [g if g is None or (sparse and isinstance(g, tf.IndexedSlices))
                       else _dense(g, c) for g, c in zip(grads, copies_0)]
            template = graph.get_operations()[first_new:]
        if replicate_lib.calls_functions(template):
            return None
        # A weight's gradient that is one MatMul (a dense kernel's a^T dz) is taken from
        # the towers' inputs to it by one batched matmul, rather than from T MatMuls
        # and a stack of their T results: the same numbers, with the [T, *x.shape]
        # result written once.
        batched = {g.op for g in grads_0 if _batchable_matmul(g, template)}
        template = [op for op in template if op not in batched]
        template_ops = set(template)
        # What each tower must return: IndexedSlices as (values, indices), a batched
        # MatMul as its two inputs.
        needed = []
        for g in grads_0:
            if g is None:
                continue
            if isinstance(g, tf.IndexedSlices):
                needed += [g.values, g.indices]
            elif g.op in batched:
                needed += list(g.op.inputs)
            else:
                needed.append(g)
        returned = [t for t in needed if t.op in template_ops]
        devices = self.devices
        try:
            replicas = replicate_lib.replicate(
                template, template_prefix, counterpart, range(1, T), returned, graph,
                device=(lambda t: devices[t % len(devices)]) if devices else None)
            in_replicas = {id(t): [replica[i] for replica in replicas]
                           for i, t in enumerate(returned)}

            def per_tower_versions(tensor):
                """T tensors: tower t's version of tower 0's `tensor`."""
                if id(tensor) in in_replicas:
                    return [tensor] + in_replicas[id(tensor)]
                return [tensor] + [counterpart(tensor, t) for t in range(1, T)]

            per_tower = {}
            for k, g_0 in zip(connected, grads_0):
                if g_0 is None:
                    per_tower[k] = None
                elif isinstance(g_0, tf.IndexedSlices):
                    per_tower[k] = [tf.IndexedSlices(values, indices, g_0.dense_shape)
                                    for values, indices in zip(
                                        per_tower_versions(g_0.values),
                                        per_tower_versions(g_0.indices))]
                elif g_0.op in batched:
                    per_tower[k] = _BatchedMatMul(
                        per_tower_versions(g_0.op.inputs[0]),
                        per_tower_versions(g_0.op.inputs[1]),
                        g_0.op.get_attr("transpose_a"), g_0.op.get_attr("transpose_b"))
                else:
                    per_tower[k] = per_tower_versions(g_0)
        except _NoCounterpart:
            return None
        return per_tower


class _BatchedMatMul(collections.namedtuple(
        "_BatchedMatMul", ["a", "b", "transpose_a", "transpose_b"])):
    """Tower t's gradient is matmul(a[t], b[t]) with the transposes given."""

    def stacked(self):
        """[T, *x.shape]: one batched matmul over the towers."""
        a, b = tf.stack(self.a), tf.stack(self.b)  # T x [.., ..] -> [T, .., ..]
        if self.transpose_a and not self.transpose_b and a.shape[1] == 1:
            # a^T b of one row each (one example per tower): an outer product,
            # [T, 1, k] x [T, 1, n] -> [T, k, 1] * [T, 1, n] -> [T, k, n]
            return tf.transpose(a, [0, 2, 1]) * b
        return tf.linalg.matmul(a, b, transpose_a=self.transpose_a,
                                transpose_b=self.transpose_b)  # -> [T, *x.shape]


def _batchable_matmul(gradient, template):
    """Whether `gradient` (tower 0's dense gradient of a weight) is the output of a
    MatMul built by tf.gradients that nothing else in the backward pass reads."""
    if gradient is None or isinstance(gradient, tf.IndexedSlices):
        return False
    op = gradient.op
    return (op.type == "MatMul" and op in template and not gradient.consumers()
            and gradient.shape.is_fully_defined()
            and all(t.shape.is_fully_defined() for t in op.inputs))


class _NoCounterpart(Exception):
    """A tensor of tower 0 whose tower-t version cannot be named."""


def _replay_prefix(stacked, t):
    """The name prefix of tower t's replayed ops: "<towers scope>replay/t<t>/"."""
    scope = stacked.op.name[:-len("stacked")]
    return f"{scope}replay/t{t}/"


def _zeros_per_tower(x, T):
    """[T, *x.shape] zeros of x's dtype."""
    dtype = x.dtype.base_dtype
    if x.shape.is_fully_defined():
        return tf.zeros([T] + x.shape.as_list(), dtype=dtype)
    return tf.zeros(tf.concat([[T], tf.shape(x)], axis=0), dtype=dtype)


def _dense(gradient, like):
    """A tower's gradient as a dense tensor shaped like its copy (None -> zeros)."""
    if gradient is None:
        return tf.zeros_like(like)
    if isinstance(gradient, tf.IndexedSlices):
        # Embedding rows: scatter the looked-up rows into [*x.shape].
        return tf.math.unsorted_segment_sum(gradient.values, gradient.indices,
                                            tf.shape(like, out_type=gradient.indices.dtype)[0])
    return gradient


def build_towers(ys, xs, batch=None, num_towers=None, batch_size=None, name=None,
                 devices=None):
    """Builds T towers that replay the graph from the batch to `ys`.

    Args:
      ys: a tensor whose axis 0 is the batch, [B, ...].
      xs: a variable or tensor, or a list of them (e.g. `model.trainable_weights`).
      batch: the tensor(s) carrying the batch on axis 0 that `ys` depends on; found
        by walking back from `ys` to its placeholders and iterator outputs when None.
      num_towers: T, which must divide B; None means one tower per example (T = B).
      batch_size: B when the batch axis is not static; read from the graph otherwise.
      name: name scope for the new ops (default "towers").
      devices: None, or a list of device strings ("/cpu:0", "/gpu:1",
        "/job:worker/task:1/device:CPU:0", ...): tower t, its weight copies and its
        replayed ops are placed on devices[t % len(devices)]; the gradient ops are
        colocated with them by `tf.gradients`.

    Returns:
      A `Towers` record.

    Example:
      towers = pertower.build_towers(cost, net.trainable_weights, batch_size=32)
      per_example = towers.gradients()   # list of [32, *w.shape]
    """
    return build(ys, xs, batch, num_towers, batch_size, name or "towers", "build_towers",
                 "num_towers", devices)


def build(ys, xs, batch, num_towers, batch_size, scope, function_name, towers_argument,
          devices=None, prepared=None):
    """`build_towers` for the public functions: errors name `function_name` and call
    the number of towers `towers_argument`. `prepared`: what `pertower._prepare.prepare`
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
        graph_walk.check_replayable(replayed, function_name)
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
    a repeated weight) are mapped. Call ops in `call_positions` get their weight inputs
    replaced by the copies and their functions by `rewriter`'s rewrites."""
    order = sorted(replayed, key=lambda op: op._id)  # pylint: disable=protected-access
    node_defs = {op: op.node_def for op in order}
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
    true_constant = []  # the predicate of function calls turned into If ops, made once

    def true_key():
        if not true_constant:
            true_constant.append(tf.constant(True, name="call_predicate"))
        return key_for(true_constant[0])

    graph_def = graph_pb2.GraphDef()
    graph_def.versions.CopyFrom(graph.graph_def_versions)
    inputs = replicate_lib.InputMap()
    input_map, key_for = inputs.input_map, inputs.key_for
    external_controls = []  # (tower node name, external op)

    replayed_names = {op.name for op in order}
    for t in range(T):
        mapping = per_tower_inputs[t]
        for op in order:
            node = graph_def.node.add()
            node.CopyFrom(node_defs[op])
            node.name = f"t{t}/{op.name}"
            if devices is not None:
                node.device = devices[t % len(devices)]
            replicate_lib.drop_name_attrs(node)
            inputs = list(node.input)
            del node.input[:]
            if op in gathers:
                inputs = _gather_inputs(node, op, copies[gathers[op]][t], axis_zero, key_for)
            if op.type in control_flow.CALL_OP_TYPES:
                for i, k in call_positions.get(op, {}).items():  # the handle becomes the copy
                    inputs[i] = key_for(copies[k][t])
            for name in inputs:
                if name.startswith("^"):
                    if name[1:] in replayed_names:
                        node.input.append(f"^t{t}/{name[1:]}")
                    else:
                        external_controls.append((node.name, graph.get_operation_by_name(name[1:])))
                    continue
                tensor_name = name if ":" in name else name + ":0"
                if tensor_name in mapping:
                    node.input.append(key_for(mapping[tensor_name]))
                elif tensor_name.split(":")[0] in replayed_names:
                    node.input.append(f"t{t}/{name}")
                elif name in input_map:  # already a key (the gather rewrite's copy)
                    node.input.append(name)
                else:
                    node.input.append(key_for(graph.get_tensor_by_name(tensor_name)))
            if op.type in control_flow.CALL_OP_TYPES:  # after the inputs are mapped
                positions = call_positions.get(op, {})
                rewriter.rewrite_call(node, _value_specs(positions, reads),
                                      _where(op, positions, reads), t, true_key)
    graph_def.library.CopyFrom(rewriter.library)  # the towers' control-flow functions
    return_names = [f"t{t}/{ys.op.name}:{ys.value_index}" for t in range(T)]
    try:
        outputs = tf.graph_util.import_graph_def(
            graph_def, input_map=input_map, return_elements=return_names, name="replay")
    except ValueError as error:
        raise ValueError(
            f"pertower.{function_name}: replaying the graph from the batch to `ys` on "
            f"slices of {_checks.static_batch_size(slices[0][0])} example(s) failed: "
            f"{error}. This happens when the graph bakes its batch size into constants; build the model on "
            "placeholders whose batch axis is None.") from error
    if external_controls:
        scope = outputs[0].name.split(f"t0/{ys.op.name}")[0]
        for node_name, control in external_controls:
            graph.get_operation_by_name(scope + node_name)._add_control_inputs([control])  # pylint: disable=protected-access
    return outputs


def _gather_inputs(node, op, copy, axis_zero, key_for):
    """Rewrites a ResourceGather(handle, indices) NodeDef into a gather from `copy`."""
    dtype = node.attr["dtype"].type
    batch_dims = node.attr["batch_dims"].i if "batch_dims" in node.attr else 0
    indices_type = node.attr["Tindices"].type
    for attr in list(node.attr):
        del node.attr[attr]
    node.attr["Tparams"].type = dtype
    node.attr["Tindices"].type = indices_type
    if op.type == "ResourceGather":
        node.op = "GatherV2"
        node.attr["Taxis"].type = tf.int32.as_datatype_enum
        node.attr["batch_dims"].i = batch_dims
        return [key_for(copy), op.inputs[1].name, key_for(axis_zero)] + [
            "^" + c.name for c in op.control_inputs]
    node.op = "GatherNd"
    return [key_for(copy), op.inputs[1].name] + ["^" + c.name for c in op.control_inputs]

"""Towers: replay the graph from the batch to `ys` once per slice, on weight copies.

Notation:
    B   examples in the batch            T   towers; each takes B/T examples
    x   one weight (entry of `xs`)       c_t tower t's `tf.identity` copy of x
    S   the replayed ops (see graph_walk)

The mechanism (Goodfellow's trick, "Efficient per-example gradient computations",
arXiv 1510.01799, in its simplest form): split every batch tensor on its batch axis (0,
or `batch_axis`) into T slices, give tower t its own copy c_t = tf.identity(x) of each
weight, replay S on slice t with c_t in place of every read of x, and stack the tower outputs, which then
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
tower's own size (the analysis' `size_data_edges`, `pertower._batch_axis`). With
`devices`, tower t's copies and replayed ops are placed on devices[t % len(devices)].
The user's ops, variables and values are left untouched; only new ops are added, under
one name scope. The one edit is TensorFlow's own: the user's loops, conds and function
calls between the weights and `ys` are made to output the intermediates their gradient
reads, as a `tf.gradients` through them would (`pertower._towers.later_gradients`), so
that a training op built after the first run reuses them.

An entry of `xs` computed from another entry (`w_eff = 2 * tf.identity(W)` with both W
and w_eff in xs) has no `tf.identity` copy of its own: its tower-t version is the
replay's own copy of it, computed from c_t of W, so that `tf.gradients` gives W the
total derivative (its direct uses plus the chain through w_eff) and w_eff the gradient
of its consumers, exactly as `tf.gradients(ys, [W, w_eff])` does. An entry that *is*
another entry's read (`W.value()` next to W) gets tf.identity(c_t of W) likewise.
"""

import contextlib
import dataclasses
import warnings

import tensorflow as tf

from pertower import _checks
from pertower import _request as _prepare
from pertower import _graph_walk as graph_walk
from pertower._towers import backward
from pertower._towers import functions as control_flow
from pertower._towers import later_gradients
from pertower._towers import replicate as replicate_lib
from pertower import _context

__all__ = ["Towers", "build_towers"]

_BAKED = ("This happens when the graph bakes its batch size into constants; build the "
          "model on placeholders whose batch axis is None.")
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
        when `ys` does not depend on xs[k]. For an entry computed from another entry
        it is the tower's replay of that computation (see the module notes).
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


@_context.public("build_towers")
def build_towers(ys, xs, batch=None, batch_size=None, num_microbatches=None, name=None,
                 devices=None, num_towers=None, batch_axis=None):
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
      batch_axis: None (the batch is axis 0 of every batch tensor), an int (the batch
        axis of every batch tensor, e.g. 1 for time-major [T, B, d] inputs), or a list
        with one axis per batch tensor. The slices are taken along it; `ys` keeps the
        batch on axis 0 (transpose a time-major `ys` first).

    Returns:
      A `Towers` record.

    Example:
      towers = pertower.build_towers(cost, net.trainable_weights, batch_size=32)
      per_example = towers.gradients()   # list of [32, *w.shape]
    """
    T, towers_argument = _checks.renamed_argument(
        num_microbatches, num_towers, "num_microbatches", "num_towers")
    return build(ys, xs, batch, T, batch_size, name or "towers", towers_argument, devices,
                 batch_axis=batch_axis)


def build(ys, xs, batch, num_towers, batch_size, scope, towers_argument,
          devices=None, prepared=None, batch_axis=None):
    """`build_towers` for the public functions: errors name the public function the
    call came through (`pertower._context`) and call the number of towers
    `towers_argument`. `prepared`: what `pertower._request.prepare`
    returned for these same arguments (with B known), when the caller has checked them
    already; they are then not walked and scanned a second time."""
    if prepared is None:
        prepared = _prepare.prepare(ys, xs, batch, num_towers, batch_size, towers_argument,
                                    batch_size_required=True, batch_axis=batch_axis)
    devices = _checks.device_list(devices)
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
        graph_walk.check_replayable(replayed, forward_only)
        if forward_only:
            replayed |= graph_walk.v1_loop_frames(replayed, ys_upstream)
        # Rewrite the control-flow functions once now, so that a refusal comes before
        # any op is added; the towers get their own rewrites in _replay.
        call_positions = _call_positions(reads, xs)
        trial = control_flow.FunctionRewriter(graph, "trial")
        for op in sorted(replayed, key=lambda op: op._id):  # pylint: disable=protected-access
            if op.type in control_flow.CALL_OP_TYPES:
                positions = call_positions.get(op, {})
                trial.rewrite_call(_node_def(op), _value_specs(positions, reads),
                                   _where(op, positions, reads), 0, lambda: "trial")
        noisy = graph_walk.random_ops(replayed)
        if noisy:
            warnings.warn(
                f"pertower.{_context.name()}: `ys` depends on the random op "
                f"{noisy[0].name!r} ({noisy[0].type}), e.g. dropout in training mode. Each "
                "tower draws its own random numbers, so the towers' outputs (and "
                "gradients) use other draws than `ys` does in the same run.",
                stacklevel=3)

        derived, aliases = _derived_entries(reads, replayed)
        with tf.name_scope(scope):
            if prepared.segments is None:
                slices = _split_batch(batch, B, T, prepared.batch_axes)
            else:
                slices = _split_segments(batch, prepared.segments, B, T,
                                         prepared.batch_axes)
            copies, first_index = [], {}
            for k, r in enumerate(reads):
                first = first_index.setdefault(id(r.x), k)
                if first != k:  # a repeated x shares its copies
                    copies.append(copies[first])
                    continue
                if not r.reached or k in derived or k in aliases:
                    copies.append(None)  # unreached, or made from another entry's copies
                    continue
                with tf.name_scope(f"copies_{k}"):
                    source = r.copy_source
                    tower_copies = []
                    for t in range(T):
                        with _on_device(devices, t):
                            tower_copies.append(tf.identity(source, name=f"tower_{t}"))
                    copies.append(tuple(tower_copies))
            for k, j in aliases.items():  # xs[k] is a read of xs[j]: c_t(k) = c_t(j)
                with tf.name_scope(f"copies_{k}"):
                    alias_copies = []
                    for t, c in enumerate(copies[j]):
                        with _on_device(devices, t):
                            alias_copies.append(tf.identity(c, name=f"tower_{t}"))
                    copies[k] = tuple(alias_copies)
            unique = sorted(k for k in set(first_index.values()) if k not in derived)
            # a token unique in the graph names this build's function copies
            token = graph.unique_name("pertower", mark_as_used=True).replace("/", "_")
            rewriter = control_flow.FunctionRewriter(graph, token)
            outputs = _replay(ys, batch, reads, copies, unique, call_positions, rewriter,
                              slices, replayed, T, graph, devices,
                              _replay_failure_cause(prepared), [reads[k].x for k in derived],
                              prepared.analysis.size_data_edges)
            outputs, derived_copies = [o[0] for o in outputs], [o[1:] for o in outputs]
            for position, k in enumerate(derived):  # the replay's own copy of xs[k]
                copies[k] = tuple(tower[position] for tower in derived_copies)
            for k, r in enumerate(reads):  # repeated entries share their first's copies
                first = first_index[id(r.x)]
                if first != k:
                    copies[k] = copies[first]
            outputs = _check_tower_rows(outputs, ys, batch, B, T)
            # T x [B/T, ...] -> [B, ...]
            stacked = tf.concat(outputs, axis=0, name="stacked")
        if not forward_only:
            # the towers differentiate copies: edit the user's loops, conds and calls
            # as a tf.gradients through them would, for a training op built later
            later_gradients.prepare_for_later_gradients(
                graph_walk.downstream_ops(
                    [t for r in reads for t in r.read_tensors]
                    + [t for op in gather_ops | call_ops for t in op.outputs], ys_upstream)
                | call_ops)
    return Towers(ys=ys, xs=tuple(xs), batch=tuple(batch), batch_size=B, num_towers=T,
                  slices=tuple(zip(*slices)), copies=tuple(copies), outputs=tuple(outputs),
                  stacked=stacked, devices=devices)


def _derived_entries(reads, replayed):
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


def _split_batch(batch, B, T, axes):
    """Each batch tensor [B, ...] -> T slices [B/T, ...] along its batch axis (axes[j];
    [T', B, ...] -> T x [T', B/T, ...] for a time-major one), checking B at run time."""
    slices = []
    for j, (b, axis) in enumerate(zip(batch, axes)):
        with tf.name_scope(f"slices_{j}"):
            if _checks.static_batch_size(b, axis) is None:
                check = _checks.fed_batch_size_check(
                    b, axis, B, "the towers",
                    "or build the towers again for the new batch size.")
                with tf.control_dependencies([check]):
                    b = tf.identity(b)
            # [..., B, ...] -> T x [..., B/T, ...] (the batch on axis `axis`)
            parts = tf.split(b, T, axis=axis)
            if b.shape.rank is not None:
                for part in parts:
                    part.set_shape(b.shape[:axis].concatenate([B // T])
                                   .concatenate(b.shape[axis + 1:]))
            slices.append(parts)
    return slices


def _split_segments(batch, segments, B, T, axes):
    """The slices when `ys` joins several batches along axis 0 (rows of s1, then of
    s2): tower t holds rows t*g ... (t+1)*g - 1 of that order (g = B/T), which lie in
    one batch s (`_request` checked it); it gets slice [i*g, (i+1)*g) of each batch
    tensor of s and an empty [0:0] slice of the others, so that f(empty) adds no row.

    Args:
      batch: the batch tensors.
      segments: ((batch indices, B_s), ...) in the order of the rows of `ys`.
      B: B_1 + B_2 + ... ; T: the number of towers.
      axes: the batch axis of each batch tensor.

    Returns:
      slices[j][t]: tower t's slice of batch[j], [g or 0, ...] on its batch axis.
    """
    g = B // T
    size_of = {j: size for indices, size in segments for j in indices}
    slices = []
    for j, (b, axis) in enumerate(zip(batch, axes)):
        with tf.name_scope(f"slices_{j}"):
            B_j = size_of[j]
            # [..., B_j, ...] -> B_j/g x [..., g, ...] (checked against the fed size)
            parts = _split_batch([b], B_j, B_j // g, [axis])[0]
            # [..., B_j, ...] -> [..., 0, ...]: the input of f for the other batches' towers
            empty = tf.gather(b, tf.zeros([0], tf.int32), axis=axis, name="empty")
            # Every tower gets a slice whose batch axis is not static (g rows or 0), so
            # that the backward pass built for tower 0 and copied for the others
            # (`backward.replicated_gradients`) bakes in neither size.
            slices.append(([_rows_not_static(p, axis) for p in parts],
                           _rows_not_static(empty, axis)))
    per_tower = [[] for _ in batch]   # per_tower[j][t]
    for indices, size in segments:
        for i in range(size // g):   # the next tower: rows i*g ... of this batch
            for j, (parts, empty) in enumerate(slices):
                per_tower[j].append(parts[i] if j in indices else empty)
    return per_tower


def _rows_not_static(tensor, axis):
    """`tensor` with its batch axis `axis` made not static: [..., None, ...]."""
    shape = tensor.shape
    if shape.rank is not None:
        shape = shape[:axis].concatenate([None]).concatenate(shape[axis + 1:])
    return tf.compat.v1.placeholder_with_default(tensor, shape)


def _check_tower_rows(outputs, ys, batch, B, T):
    """Each tower output must have B/T rows, one per example of its slice; otherwise
    axis 0 of `ys` is not the batch axis of `batch` (e.g. `ys` is computed from a
    concatenation of several batch tensors) and the towers would mix examples up."""
    # The message around the number of rows a tower produced.
    before = (f"pertower.{_context.name()}: axis 0 of `ys` ({ys.name}) does not follow the "
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


def _replay_failure_cause(prepared):
    """What most likely makes a replay on slices fail: a batch size baked into the
    graph when some batch axis is static, else where the analysis lost the rows."""
    if any(_checks.static_batch_size(b, a) is not None
           for b, a in zip(prepared.batch, prepared.batch_axes)):
        return ("This happens when the graph bakes its batch size into constants; build "
                "the model on placeholders whose batch axis is None.")
    analysis = prepared.analysis
    lost = analysis.lost_at if analysis is not None else None
    where = (f" (the analysis lost the examples' rows at {lost[0].name!r} "
             f"({lost[0].type}): {lost[1]})" if lost is not None else "")
    return ("The batch axis is None, so no batch size is baked in: an op between the batch "
            "and `ys` needs several examples together" + where + ", e.g. a reshape that "
            "pairs examples (tf.reshape(h, [-1, 2 * n])). Then row i of `ys` is not "
            "computed from example i alone and has no per-example gradient; keep each "
            "example in its own row (reshape only the non-batch axes), or use "
            "microbatch_gradients with microbatches that hold whole groups.")


def _replay(ys, batch, reads, copies, unique, call_positions, rewriter, slices, replayed, T,
            graph, devices, failure_cause=None, also=(), size_edges=()):
    """Adds S once per tower with one import; returns, per tower, [its output
    [B/T, ...], then its versions of the tensors `also`].

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
    for k in unique:  # an entry that is another's read replaces that read in its towers
        if isinstance(reads[k].x, tf.Tensor) and copies[k] is not None:
            for t in range(T):
                per_tower_inputs[t][reads[k].x.name] = copies[k][t]
    gathers = {op: k for k in unique for op in reads[k].gather_ops}
    axis_zero = tf.constant(0, name="gather_axis") if gathers else None
    whole_batch = {}  # op -> input indices that read the whole batch's size value
    for op, index in size_edges:   # the analysis' size-data edges (see the docstring)
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
            graph, [ys] + list(also),
            device=(lambda t: devices[t % len(devices)]) if devices is not None else None,
            edit_node=edit_node, library=rewriter.library)
    except ValueError as error:
        raise ValueError(
            f"pertower.{_context.name()}: replaying the graph from the batch to `ys` on "
            f"slices of {_checks.static_batch_size(slices[0][0])} example(s) failed: "
            f"{error}. {failure_cause or _BAKED}") from error
    return outputs

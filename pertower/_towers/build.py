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

The replay (`pertower._towers.replay`) copies S for the T towers with one
`pertower._towers.replicate.replicate` call (one GraphDef, one import), mapping the
batch tensors to the tower's slices (`pertower._towers.slicing`) and the weight reads
to the tower's copies. Gathers from a weight's handle become gathers from the copy, and
ops that call functions reading a weight inside (while loops, conds, `tf.function`
calls) get the copy as an input and rewritten functions (see
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

import dataclasses
import warnings

import tensorflow as tf

from pertower import _checks
from pertower import _context
from pertower import _graph_walk as graph_walk
from pertower import _op_types as op_types
from pertower import _request
from pertower import _tf
from pertower._towers import backward
from pertower._towers import fallback
from pertower._towers import functions as control_flow
from pertower._towers import later_gradients
from pertower._towers import replay as replay_lib
from pertower._towers import shared_draws
from pertower._towers import slicing

__all__ = ["Towers", "build_towers", "build", "towers_of", "replay_forward"]


@dataclasses.dataclass(frozen=True)
class Towers(fallback.PerGroupGradients):
    """The tensors one `build_towers` call made. Immutable; all fields are graph tensors.

    A fallback builder of the dispatch (`pertower._towers.fallback`): `gradients`, and
    from them the squared norms and the clipped sum.

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
      fed_rows: None, or with a batch capacity (`Options.batch_capacity`) the fed
        batch size b <= B, a scalar tensor: the batch was padded to B examples, and
        `stacked` and the gradients keep their first b rows.
    """

    checks_batch = True   # the slices check the fed batch size (`slicing.split_batch`)
    scope = "towers"

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
    fed_rows: tf.Tensor = None

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
        if self.fed_rows is None:
            return backward.gradients(self, grad_ys=grad_ys,
                                      unconnected_gradients=unconnected_gradients,
                                      name=name, sparse=sparse)
        if sparse:
            raise _context.error(ValueError, "sparse=True is not supported with a batch "
                                 "capacity (max_batch_size): pass sparse=False.")
        if grad_ys is not None:   # [b, ...] -> [B, ...], zero rows for the padding
            grad_ys = slicing.pad_batch(tf.convert_to_tensor(grad_ys, self.ys.dtype), 0,
                                        self.batch_size)
        grads = backward.gradients(self, grad_ys=grad_ys,
                                   unconnected_gradients=unconnected_gradients, name=name)
        # [B, *x.shape] -> [b, *x.shape]: the padding's rows dropped
        return [None if g is None else g[:self.fed_rows] for g in grads]


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


def build(ys, xs, batch, num_towers, batch_size, scope, towers_argument, devices=None,
          batch_axis=None):
    """`build_towers` from its arguments, under the public function the call came
    through (`pertower._context`); `towers_argument` is the public name of the number
    of towers, kept on the request for its messages."""
    request = _request.make_request(
        ys, xs, _request.Examples(batch, batch_size, num_towers, batch_axis,
                                  towers_argument, size_required=True),
        _request.Options(method="towers"))
    return towers_of(request, scope, devices)


def replay_forward(ys, batch=None, num_towers=None, batch_size=None, scope="towers",
                   towers_argument="num_microbatches", batch_axis=None):
    """Towers without weight copies: `ys` recomputed slice by slice (`.stacked`,
    [B, ...]), forward only (no gradient is built through them)."""
    request = _request.make_request(
        ys, [], _request.Examples(batch, batch_size, num_towers, batch_axis,
                                  towers_argument, size_required=True),
        _request.Options(method="towers"), weights_required=False)
    return towers_of(request, scope)


def towers_of(request, scope, devices=None):
    """The towers of a checked `request` (with B known) under the name scope `scope`:
    one replay of `request.replay_region` per group, on weight copies of its xs (none
    for a request without weights: a forward-only replay of `ys`)."""
    devices = _checks.device_list(devices)
    ys, xs, graph, batch, B = (request.ys, request.xs, request.graph, request.batch,
                               request.batch_size)
    # a batch capacity: any fed batch of at most B examples, padded to B
    padded = B is None and request.options.batch_capacity is not None
    if padded:
        if request.segments is not None or request.num_groups is not None:
            raise _context.error(ValueError, "a batch capacity (max_batch_size) takes one "
                                 "batch of one group per example: leave num_microbatches "
                                 "None and feed the batch as one tensor per input.")
        B = request.options.batch_capacity
    T = B if request.num_groups is None else request.num_groups

    with graph.as_default():
        reads = request.reads
        replayed = set(request.replay_region)
        # the batch's one draw of sampled classes: read by every tower, not redrawn
        samplers = (shared_draws.shared_samplers(replayed, request.analysis)
                    if request.segments is None else [])
        replayed -= set(samplers)
        gather_ops = {op for r in reads for op in r.gather_ops}
        call_ops = {op for r in reads for op, _ in r.call_inputs}
        # without weight copies (the run-time check's replay of `ys`) no gradient is
        # built through the replay, so TF1 loops may be replayed: frame and all
        forward_only = not any(r.reached for r in reads)
        graph_walk.check_replayable(replayed, forward_only)
        if forward_only:
            replayed |= graph_walk.v1_loop_frames(replayed, request.ys_upstream)
        # Rewrite the control-flow functions once now, so that a refusal comes before
        # any op is added; the towers get their own rewrites in the replay.
        call_positions = replay_lib.call_positions(reads, xs)
        trial = control_flow.FunctionRewriter(graph, "trial")
        for op in sorted(replayed, key=_tf.op_order_key()):
            if op.type in op_types.CALL_OP_TYPES:
                positions = call_positions.get(op, {})
                trial.rewrite_call(replay_lib.node_def(op),
                                   replay_lib.value_specs(positions, reads),
                                   replay_lib.where(op, positions, reads), 0,
                                   lambda: "trial")
        noisy = graph_walk.random_ops(replayed)
        if noisy:
            warnings.warn(_context.prefixed(
                f"`ys` depends on the random op {noisy[0].name!r} ({noisy[0].type}), e.g. "
                "dropout in training mode. Each tower draws its own random numbers, so the "
                "towers' outputs (and gradients) use other draws than `ys` does in the "
                "same run."), stacklevel=3)

        derived, aliases = replay_lib.derived_entries(reads, replayed)
        with tf.name_scope(scope):
            if request.segments is None:
                slices = slicing.split_batch(batch, B, T, request.batch_axes,
                                             request.static_sizes, padded)
                drawn = shared_draws.per_example_outputs(samplers)
                shared_rows = tuple(zip(drawn, slicing.split_batch(
                    drawn, B, T, [0] * len(drawn), shared_draws.static_rows(drawn), padded)))
            else:
                slices = slicing.split_segments(batch, request.segments, B, T,
                                                request.batch_axes, request.static_sizes)
                shared_rows = ()
            copies, first_index = _copies(reads, derived, aliases, T, devices)
            unique = sorted(k for k in set(first_index.values()) if k not in derived)
            # a token unique in the graph names this build's function copies
            token = graph.unique_name("pertower", mark_as_used=True).replace("/", "_")
            outputs = replay_lib.replay(replay_lib.Replay(
                request=request, copies=copies, unique=unique,
                call_positions=call_positions,
                rewriter=control_flow.FunctionRewriter(graph, token), slices=slices,
                replayed=frozenset(replayed), num_towers=T, devices=devices,
                shared_rows=shared_rows,
                also=tuple(reads[k].x for k in derived)))
            outputs, derived_copies = [o[0] for o in outputs], [o[1:] for o in outputs]
            for position, k in enumerate(derived):  # the replay's own copy of xs[k]
                copies[k] = tuple(tower[position] for tower in derived_copies)
            for k, r in enumerate(reads):  # repeated entries share their first's copies
                first = first_index[id(r.x)]
                if first != k:
                    copies[k] = copies[first]
            outputs = slicing.check_tower_rows(outputs, ys, batch, B, T)
            # T x [B/T, ...] -> [B, ...]
            fed_rows = None
            if padded:   # [B, ...] -> [b, ...], the fed rows
                fed_rows = tf.shape(batch[0])[request.batch_axes[0]]
                stacked = tf.identity(tf.concat(outputs, axis=0, name="padded_rows")[
                    :fed_rows], name="stacked")
            else:
                stacked = tf.concat(outputs, axis=0, name="stacked")
        if not forward_only:
            # the towers differentiate copies: edit the user's loops, conds and calls
            # as a tf.gradients through them would, for a training op built later
            later_gradients.prepare_for_later_gradients(
                graph_walk.downstream_ops(
                    [t for r in reads for t in r.read_tensors]
                    + [t for op in gather_ops | call_ops for t in op.outputs],
                    request.ys_upstream)
                | call_ops)
    return Towers(ys=ys, xs=tuple(xs), batch=tuple(batch), batch_size=B, num_towers=T,
                  slices=tuple(zip(*slices)), copies=tuple(copies), outputs=tuple(outputs),
                  stacked=stacked, devices=devices, fed_rows=fed_rows)


def _copies(reads, derived, aliases, T, devices):
    """(copies, first_index): copies[k][t] = tf.identity of xs[k]'s value for tower t
    (None for an unreached entry and for one made from another entry's copies, filled
    in later); first_index: id(x) -> the first k of each weight."""
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
                with slicing.on_device(devices, t):
                    tower_copies.append(tf.identity(source, name=f"tower_{t}"))
            copies.append(tuple(tower_copies))
    for k, j in aliases.items():  # xs[k] is a read of xs[j]: c_t(k) = c_t(j)
        with tf.name_scope(f"copies_{k}"):
            alias_copies = []
            for t, c in enumerate(copies[j]):
                with slicing.on_device(devices, t):
                    alias_copies.append(tf.identity(c, name=f"tower_{t}"))
            copies[k] = tuple(alias_copies)
    return copies, first_index

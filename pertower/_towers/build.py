"""Towers: replay the graph from the batch to `ys` once per slice, on weight copies.

Notation:
    B   examples in the batch            T   towers; each takes B/T examples
    x   one weight (entry of `xs`)       c_t tower t's `tf.identity` copy of x
    S   the replayed ops (`Request.replay_region`)

Goodfellow's trick ("Efficient per-example gradient computations", arXiv 1510.01799):
split every batch tensor on its batch axis into T slices, give tower t its own copy c_t
of each weight, replay S on slice t with c_t in place of every read of x
(`pertower._towers.replay`), and stack the tower outputs, which then equal `ys`. Tower
t's output depends on c_t alone among the copies, so

    d/d c_t  sum_t' sum(y_t')  =  d sum(y_t) / d x      (the gradient of tower t alone),

and one `tf.gradients` call over all copies returns T separate gradients
(`pertower._towers.backward`): per-example for T = B, per microbatch for T = M < B.
Loops, conds and calls of the user's graph between the weights and `ys` are edited as a
`tf.gradients` through them would (`pertower._towers.later_gradients`).
"""

import dataclasses
import warnings

import tensorflow as tf

from pertower import _checks
from pertower import _context
from pertower import _docs
from pertower import _graph_walk as graph_walk
from pertower import _op_types as op_types
from pertower import _request
from pertower._towers import backward
from pertower._towers import fallback
from pertower._towers import later_gradients
from pertower._towers import replay as replay_lib
from pertower._towers import slicing

__all__ = ["Towers", "build_towers", "towers_of", "replay_forward"]


@dataclasses.dataclass(frozen=True)
class Towers(fallback.PerGroupGradients):
    """The tensors one `build_towers` call made (a `pertower._towers.fallback` builder).

    Attributes:
      ys, xs, batch: as given (tuples), `ys` and each batch tensor [B, ...].
      batch_size: B; num_towers: T, each tower taking B/T contiguous examples.
      slices: slices[t][j] is tower t's part of batch[j], [B/T, ...].
      copies: copies[k][t] is tower t's copy of xs[k], [*x.shape] (the replay's
        version for an entry computed from another); None when `ys` does not reach xs[k].
      outputs: outputs[t] is tower t's replay of `ys`, [B/T, ...].
      stacked: the tower outputs concatenated, [B, ...]; equal to `ys`.
      devices: the device strings (tower t on devices[t % len(devices)]), or None.
      fed_rows: None, or with a batch capacity the fed batch size b <= B, a scalar
        tensor: the batch was padded to B, and `stacked` and the gradients keep b rows.
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

        Args:
          grad_ys: None (all ones), or a tensor shaped like `ys`, [B, ...], weighting
            each output entry.
          unconnected_gradients: "zero" or "none", as in `tf.gradients`.
          name: name scope for the ops.
          sparse: when True, a weight whose every tower gradient is a
            `tf.IndexedSlices` (e.g. an embedding) gets a
            `pertower.PerExampleIndexedSlices` instead of the dense [T, *x.shape].

        Returns:
          One entry per x: [T, *x.shape], entry t the gradient of sum(grad_ys_t * y_t)
          on tower t's slice alone; None for a weight `ys` does not reach when
          unconnected_gradients="none".
        """
        if self.fed_rows is None:
            return backward.gradients(self, grad_ys, unconnected_gradients, name, sparse)
        if sparse:
            raise _context.error(ValueError, "sparse=True is not supported with a batch "
                                 "capacity (max_batch_size): pass sparse=False.")
        if grad_ys is not None:   # [b, ...] -> [B, ...], zero rows for the padding
            grad_ys = slicing.pad_batch(tf.convert_to_tensor(grad_ys, self.ys.dtype), 0,
                                        self.batch_size)
        grads = backward.gradients(self, grad_ys, unconnected_gradients, name)
        # [B, *x.shape] -> [b, *x.shape]: the padding's rows dropped
        return [None if g is None else g[:self.fed_rows] for g in grads]


@_context.public("build_towers")
@_docs.documented
def build_towers(ys, xs, batch=None, batch_size=None, num_microbatches=None, name=None,
                 devices=None, num_towers=None, batch_axis=None):
    """Builds T towers that replay the graph from the batch to `ys`.

    Args:
      ys: a tensor whose axis 0 is the batch, [B, ...].
      xs: a variable or tensor, or a list of them (e.g. `model.trainable_weights`).
      {options: batch}
      batch_size: B when the batch axis is not static; read from the graph otherwise.
      num_microbatches: T, the number of towers, which must divide B; None means one
        tower per example (T = B).
      name: name scope for the new ops (default "towers").
      devices: None, or a list of device strings ("/cpu:0", "/gpu:1", ...): tower t,
        its weight copies and its replayed ops are placed on devices[t % len(devices)].
      num_towers: deprecated name of `num_microbatches` (a DeprecationWarning; giving
        both is a TypeError).
      {options: batch_axis}

    Returns:
      A `Towers` record.

    Example:
      towers = pertower.build_towers(cost, net.trainable_weights, batch_size=32)
      per_example = towers.gradients()   # list of [32, *w.shape]
    """
    T, towers_argument = _checks.renamed_argument(
        num_microbatches, num_towers, "num_microbatches", "num_towers")
    request = _request.make_request(
        ys, xs, _request.Examples(batch, batch_size, T, batch_axis, towers_argument,
                                  size_required=True),
        _request.Options(method="towers"))
    return towers_of(request, name or "towers", devices)


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
    """The towers of a checked `request` (with B known) under the name scope `scope`
    (a request without weights: a forward-only replay of `ys`)."""
    devices = _checks.device_list(devices)
    ys, graph, batch, B = request.ys, request.graph, request.batch, request.batch_size
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
        left_out = graph_walk.placeholders_left_out(request.ys_upstream, batch)
        if T > 1 and left_out:
            _refuse_paired_inputs_left_out(request, replayed, left_out)
        # the batch's one draw of sampled classes: read by every tower, not redrawn
        samplers = (slicing.shared_samplers(replayed, request.analysis)
                    if request.segments is None else [])
        replayed -= set(samplers)
        # without weight copies (the run-time check's replay of `ys`) no gradient is
        # built through the replay, so TF1 loops may be replayed: frame and all
        forward_only = not any(r.reached for r in reads)
        graph_walk.check_replayable(replayed, forward_only)
        if forward_only:
            replayed |= graph_walk.v1_loop_frames(replayed, request.ys_upstream)
        replay_lib.check_calls(request, replayed)
        noisy = graph_walk.random_ops(replayed)
        if noisy:
            warnings.warn(_context.prefixed(
                f"`ys` depends on the random op {noisy[0].name!r} ({noisy[0].type}), e.g. "
                "dropout in training mode. Each tower draws its own random numbers, so the "
                "towers' outputs (and gradients) use other draws than `ys` does in the "
                "same run."), stacklevel=3)

        with tf.name_scope(scope):
            if request.segments is None:
                slices = slicing.split_batch(batch, B, T, request.batch_axes,
                                             request.static_sizes, padded)
                shared_rows = slicing.shared_rows(samplers, B, T, padded)
            else:
                slices = slicing.split_segments(batch, request.segments, B, T,
                                                request.batch_axes, request.static_sizes)
                shared_rows = ()
            outputs, copies = replay_lib.replay(request, frozenset(replayed), slices,
                                                shared_rows, T, devices)
            outputs = slicing.check_tower_rows(outputs, ys, batch, B, T, left_out)
            fed_rows = None
            if padded:   # T x [B/T, ...] -> [B, ...] -> [b, ...], the fed rows
                fed_rows = tf.shape(batch[0])[request.batch_axes[0]]
                stacked = tf.identity(tf.concat(outputs, axis=0, name="padded_rows")[
                    :fed_rows], name="stacked")
            else:   # T x [B/T, ...] -> [B, ...]
                stacked = tf.concat(outputs, axis=0, name="stacked")
        if not forward_only:
            # the towers differentiate copies: edit the user's loops, conds and calls
            # as a tf.gradients through them would, for a training op built later
            call_ops = {op for r in reads for op, _ in r.call_inputs}
            gather_ops = {op for r in reads for op in r.gather_ops}
            later_gradients.prepare_for_later_gradients(
                graph_walk.downstream_ops(
                    [t for r in reads for t in r.read_tensors]
                    + [t for op in gather_ops | call_ops for t in op.outputs],
                    request.ys_upstream)
                | call_ops)
    return Towers(ys=ys, xs=tuple(request.xs), batch=tuple(batch), batch_size=B,
                  num_towers=T, slices=tuple(zip(*slices)), copies=tuple(copies),
                  outputs=tuple(outputs), stacked=stacked, devices=devices,
                  fed_rows=fed_rows)


def _refuse_paired_inputs_left_out(request, replayed, left_out):
    """Raises when a loss pairs a placeholder left out of `batch=` (`left_out`) row by row
    with the examples (labels of a softmax cross-entropy): each tower would read all B of
    its rows against its own B/T examples, which TensorFlow refuses at run time."""
    paired_ops = sorted((op for op in replayed if op.type in op_types.ROW_PAIRED_OP_TYPES),
                        key=lambda op: op.name)
    for op in paired_ops:
        rows = [request.analysis.rows(t) is not None for t in op.inputs]
        if not any(rows):
            continue
        upstream = graph_walk.upstream_ops([t for t, r in zip(op.inputs, rows) if not r])
        paired = [p for p in left_out if p.op in upstream]
        if paired:
            names = ", ".join(f"{t.name} {t.shape}" for t in paired)
            every = ", ".join(t.name for t in list(request.batch) + paired)
            raise _context.error(
                ValueError, f"`ys` reads {names}, which is not in `batch=` "
                f"({', '.join(b.name for b in request.batch)}), but {op.name!r} ({op.type}) "
                "pairs it row by row with the examples: it carries the examples too "
                f"(labels), so it must be in `batch=` (batch=[{every}]).")

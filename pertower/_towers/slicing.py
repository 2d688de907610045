"""The towers' slices: each batch tensor split on its batch axis, one slice per tower.

Notation:
    B   examples in the batch          T   towers; each takes B/T examples
    g   B/T, the examples of one tower S   sampled classes

Also the check that each tower produced one row of `ys` per example of its slice, the
device of tower t, and the batch's one draw of sampled classes. A candidate sampler of a
fixed distribution (`op_types.FIXED_CANDIDATE_SAMPLER_OP_TYPES`, the sampler of
`tf.nn.sampled_softmax_loss` and `tf.nn.nce_loss`) draws S classes once per run for the
whole batch. Per-example gradients are defined given that draw, so that the B gradients
sum to the batch gradient of the same run; a tower that copied the sampler would draw
other classes (and, with `unique=True`, other expected counts). So the sampler is not
replayed: each tower reads the batch's sampled classes and their expected counts [S],
and its own rows of the true classes' expected counts [B, num_true] -> [B/T, num_true].
"""

import contextlib

import tensorflow as tf

from pertower import _checks
from pertower import _context
from pertower import _graph_walk as graph_walk
from pertower import _op_types as op_types
from pertower import _tf
from pertower._batch_axis.lattice import Rows

__all__ = ["split_batch", "pad_batch", "capacity_check", "split_segments", "check_tower_rows",
           "on_device", "device_function", "shared_samplers", "shared_rows"]


def split_batch(batch, B, T, axes, static_sizes, padded=False):
    """Each batch tensor [B, ...] -> T slices [B/T, ...] along its batch axis (axes[j];
    [T', B, ...] -> T x [T', B/T, ...] for a time-major one), checking B at run time
    where the batch axis is not static (static_sizes[j] None); with `padded`, a fed
    batch of b <= B examples is padded with B - b rows of zeros instead (checked)."""
    slices = []
    for j, (b, axis, static) in enumerate(zip(batch, axes, static_sizes)):
        with tf.name_scope(f"slices_{j}"):
            if static is None and padded:
                b = pad_batch(b, axis, B)
            elif static is None:
                check = _checks.fed_batch_size_check(
                    b, axis, B, "the towers",
                    "or build the towers again for the new batch size.")
                with tf.control_dependencies([check]):
                    b = tf.identity(b)
            # [..., B, ...] -> T x [..., B/T, ...] (the batch on axis `axis`)
            parts = tf.split(b, T, axis=axis)
            for part in parts:
                part.set_shape(_batch_shape(b, axis, B // T))
            slices.append(parts)
    return slices


def pad_batch(b, axis, B):
    """[..., b, ...] -> [..., B, ...]: the fed batch and B - b rows of zeros after it
    on axis `axis`, after a run-time check that b <= B (the towers' capacity, the
    `max_batch_size` of DPOptimizer)."""
    check = capacity_check(b, axis, B, "the towers were")
    fed = tf.shape(b)[axis]
    with tf.control_dependencies([check]):
        rank = tf.rank(b)
        # [rank, 2]: B - b rows after the fed ones on `axis`, none elsewhere
        paddings = tf.scatter_nd([[axis, 1]], [B - fed], tf.stack([rank, 2]))
        padded = tf.pad(b, paddings)
    padded.set_shape(_batch_shape(b, axis, B))
    return padded


def _batch_shape(b, axis, size):
    """b's static shape with `size` (an int or None) on the batch axis `axis`."""
    if b.shape.rank is None:
        return b.shape
    return b.shape[:axis].concatenate([size]).concatenate(b.shape[axis + 1:])


def capacity_check(b, axis, B, built):
    """A run-time assertion that the batch fed to `b` has at most B examples on its axis
    `axis` (a batch capacity, `max_batch_size`): one message on every path, the towers'
    (`pad_batch`) and the rules' (`pertower.DPOptimizer`), `built` saying what was built
    ("the towers were", "the DP step was")."""
    fed = tf.shape(b)[axis]
    message = tf.strings.join([
        f"pertower: {built} built for batches of at most {B} examples "
        f"(max_batch_size={B}), but the batch fed to {b.name} has ",
        tf.strings.as_string(fed), f" examples. Feed at most {B} examples, or build the "
        "step again with a larger max_batch_size (for Poisson batches, "
        "pertower.poisson_capacity gives one with a stated overflow probability)."])
    return tf.debugging.Assert(fed <= B, [message], name="check_capacity")


def split_segments(batch, segments, B, T, axes, static_sizes):
    """The slices when `ys` joins several batches along axis 0 (rows of s1, then of
    s2; `segments`: ((batch indices, B_s), ...) in that order, B = B_1 + B_2 + ...):
    tower t holds rows t*g ... (t+1)*g - 1 (g = B/T), which lie in one batch s
    (`_request` checked it); it gets slice [i*g, (i+1)*g) of each batch tensor of s and
    an empty [0:0] slice of the others, so that f(empty) adds no row. Returns
    slices[j][t], [g or 0, ...] on the batch axis."""
    g = B // T
    size_of = {j: size for indices, size in segments for j in indices}
    slices = []
    for j, (b, axis, static) in enumerate(zip(batch, axes, static_sizes)):
        with tf.name_scope(f"slices_{j}"):
            B_j = size_of[j]
            # [..., B_j, ...] -> B_j/g x [..., g, ...] (checked against the fed size)
            parts = split_batch([b], B_j, B_j // g, [axis], [static])[0]
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
    return tf.compat.v1.placeholder_with_default(tensor, _batch_shape(tensor, axis, None))


def check_tower_rows(outputs, ys, batch, B, T, left_out=()):
    """Each tower output must have B/T rows, one per example of its slice; otherwise
    axis 0 of `ys` is not the batch axis of `batch` (e.g. `ys` is computed from a
    concatenation of several batch tensors, or reads labels left out of `batch=`: the
    placeholders `left_out`) and the towers would mix examples up."""
    # The message around the number of rows a tower produced.
    before = _context.prefixed(
        f"axis 0 of `ys` ({ys.name}) does not follow the batch "
        f"({', '.join(b.name for b in batch)}): a tower given {B // T} example(s) produced ")
    after = (" row(s). This happens when `ys` is computed from several batch tensors "
             "joined along axis 0 (pass `batch=` the joined tensor and its `batch_size`) "
             "or when the graph mixes rows across the batch axis.")
    if left_out:
        every = ", ".join(t.name for t in list(batch) + list(left_out))
        after += (f" `ys` also reads {', '.join(t.name for t in left_out)}, not in `batch=`: "
                  f"if it carries the examples too, pass batch=[{every}].")
    rows = graph_walk.static_batch_size(outputs[0])
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


def device_function(devices):
    """None, or t -> the device of tower t, devices[t % len(devices)]."""
    if devices is None:
        return None
    return lambda t: devices[t % len(devices)]


def on_device(devices, t):
    """The device scope of tower t (none when `devices` is None)."""
    if devices is None:
        return contextlib.nullcontext()
    return tf.device(devices[t % len(devices)])


def shared_samplers(replayed, analysis):
    """The fixed-distribution candidate samplers among `replayed` whose true classes
    hold one row per example on axis 0 (the analysis' Rows(0, 1, .)); the towers share
    their draws. Others stay replayed (each tower draws its own; the run-time check of
    `ys` then refuses the result)."""
    shared = []
    for op in sorted(replayed, key=_tf.op_order_key()):
        if op.type not in op_types.FIXED_CANDIDATE_SAMPLER_OP_TYPES:
            continue
        value = analysis.value(op.inputs[0]) if analysis is not None else None
        if isinstance(value, Rows) and value.lead == 0 and value.k == 1:
            shared.append(op)
    return shared


def shared_rows(samplers, B, T, padded):
    """(true_expected_count [B, num_true], its T slices [B/T, num_true]) per sampler."""
    drawn = [op.outputs[1] for op in samplers]
    static = [tf.compat.dimension_value(t.shape[0]) if t.shape.rank else None
              for t in drawn]
    return tuple(zip(drawn, split_batch(drawn, B, T, [0] * len(drawn), static, padded)))

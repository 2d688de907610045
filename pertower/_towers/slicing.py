"""The towers' slices: each batch tensor split on its batch axis, one slice per tower.

Notation as in `pertower._towers.build`; g = B/T, S sampled classes.

Also the check that each tower produced one row of `ys` per example of its slice, the
device of tower t, and the batch's one draw of sampled classes: a fixed-distribution
candidate sampler (of `tf.nn.sampled_softmax_loss`, `tf.nn.nce_loss`) draws S classes
once per run for the whole batch, and per-example gradients are defined given that
draw. So it is not replayed: each tower reads the batch's sampled classes and their
expected counts [S], and its rows of the true classes' counts [B/T, num_true].
"""

import tensorflow as tf

from pertower import _checks
from pertower import _context
from pertower import _graph_walk as graph_walk
from pertower import _op_types as op_types
from pertower import _tf
from pertower._batch_axis.lattice import Rows

__all__ = ["split_batch", "pad_batch", "capacity_check", "split_segments", "check_tower_rows",
           "device_function", "shared_samplers", "shared_rows"]


def split_batch(batch, B, T, axes, static_sizes, padded=False):
    """Each batch tensor [B, ...] -> T slices [B/T, ...] along its batch axis axes[j],
    checking B at run time where it is not static (static_sizes[j] None); with
    `padded`, a fed batch of b <= B examples is padded with zero rows instead."""
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
    """[..., b, ...] -> [..., B, ...]: B - b rows of zeros after the fed ones on `axis`,
    after a run-time check that b <= B (the capacity, DPOptimizer's `max_batch_size`)."""
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
    """A run-time assertion that the batch fed to `b` has at most B examples on `axis`,
    the one message of every path, `built` saying what was ("the DP step was")."""
    fed = tf.shape(b)[axis]
    message = tf.strings.join([
        f"pertower: {built} built for batches of at most {B} examples "
        f"(max_batch_size={B}), but the batch fed to {b.name} has ",
        tf.strings.as_string(fed), f" examples. Feed at most {B} examples, or build the "
        "step again with a larger max_batch_size (for Poisson batches, "
        "pertower.poisson_capacity gives one with a stated overflow probability)."])
    return tf.debugging.Assert(fed <= B, [message], name="check_capacity")


def split_segments(batch, segments, B, T, axes, static_sizes):
    """slices[j][t], [g or 0, ...], when `ys` joins several batches along axis 0
    (`segments`: ((batch indices, B_s), ...) in order): tower t holds rows t*g ...
    (t+1)*g - 1 (g = B/T) of one batch s, and gets its slice of each batch tensor of s
    and an empty [0:0] slice of the others, so that f(empty) adds no row."""
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
    """`outputs`, checked to have B/T rows each (else axis 0 of `ys` is not the batch
    axis of `batch`; `left_out`: placeholders `ys` reads, not in `batch=`)."""
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


def shared_samplers(replayed, analysis):
    """The fixed-distribution candidate samplers among `replayed` whose true classes
    hold one row per example on axis 0 (the analysis' Rows(0, 1, .)): shared draws."""
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

"""The number of groups, and the run-time checks of the fed batch size.

Notation: B examples in the batch, M microbatches (groups).
"""

import tensorflow as tf

from pertower import _checks
from pertower import _context
from pertower import _plan

__all__ = ["group_count", "run_time_checks", "size_advice"]


def group_count(request, num_groups):
    """G: M, or B (an int when known, else a scalar tensor read from the batch)."""
    if num_groups is not None:
        return num_groups
    if request.batch_size is not None:
        return request.batch_size
    return tf.shape(request.batch[0])[request.batch_axes[0]]


def run_time_checks(plan):
    """Assertions on the fed batch: its size equals `batch_size` (B, or B_s for each
    batch `ys` joins) given for a None batch axis; M divides it when B is left to run
    time."""
    checks, request = [], plan.request
    B, M = request.batch_size, request.num_groups
    own_size = {}
    if request.segments is not None:
        own_size = {j: size for indices, size in request.segments for j in indices}
    for j, (b, axis, size) in enumerate(zip(request.batch, request.batch_axes,
                                            request.static_sizes)):
        if size is not None:
            continue
        if B is not None:
            given = f"batch_size[{j}]={own_size[j]}" if j in own_size else None
            checks.append(_checks.fed_batch_size_check(
                b, axis, own_size.get(j, B), "the gradients", size_advice(request, plan),
                name=f"check_batch_size_{j}", given=given))
        elif M is not None:
            fed = tf.shape(b)[axis]   # the batch axis (1 for a time-major [T, B, ...])
            message = tf.strings.join([
                _context.prefixed(f"`num_microbatches` ({M}) must divide the batch size, "
                                  f"but the batch fed to {b.name} has "),
                tf.strings.as_string(fed), f" examples. Feed a multiple of {M} examples."])
            checks.append(tf.debugging.Assert(
                tf.equal(tf.math.floormod(fed, M), 0), [message],
                name=f"check_microbatches_{j}"))
    return checks


def size_advice(request, plan):
    """The end of the fed-batch-size message: what else works for this plan."""
    again = "build the gradients again for the new batch size"
    if request.segments is not None:
        return (f"{again} (batch_size=[B_1, B_2, ...], one size per batch tensor): `ys` "
                "joins several batches, whose sizes are fixed when the gradients are built.")
    static = [(b, size) for b, size in zip(request.batch, request.static_sizes)
              if size is not None]
    if static:
        b, size = static[0]
        return (f"{again}: batch_size cannot be left out, since the batch tensor "
                f"{b.name} has a static batch size of {size}.")
    if plan.fallback:
        names = ", ".join(_plan.weight_name(request.xs[k]) for k in plan.fallback)
        by = "row passes" if plan.fallback_method == "passes" else "towers"
        return (f"{again} (batch_size=B): batch_size cannot be left out, since no rule "
                f"computes {names}, whose gradients come from {by} built for a fixed "
                "number of examples.")
    return f"{again}, or leave out batch_size (then the rules work for any fed batch size)."

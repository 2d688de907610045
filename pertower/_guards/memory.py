"""Memory guard: estimate what a planned call will hold, refuse above a limit.

Notation:
    B   examples in the batch          T   towers (B per-example, M microbatches)
    P   weights (scalars over all xs)  K   output entries per example (Jacobians)
    R   rows of the result: B or M     s   bytes per number
    P_t the scalars of the weights left to towers

The estimate counts what the plan builds: the result (R x K x P numbers; for the
norms only the towers' weights), the towers' gradients before stacking (T x K x P_t)
and the forward activations of the batch (floating outputs of the non-elementwise
ops between the batch and `ys`):

    estimate = R*K*P*s  +  T*K*P_t*s  +  activations

Not counted: the weights and their `tf.identity` copies, the batch, the backward
pass's temporaries, integer tensors, parts of unknown static shape (a lower bound).
Refused above `memory_limit` bytes (default half of the physical memory; float("inf")
switches the guard off); nothing is estimated while B is unknown.
"""

import dataclasses
import math
import os

import numpy as np
import tensorflow as tf

from pertower import _op_types as op_types
from pertower import _checks
from pertower import _context

__all__ = ["MemoryEstimate", "estimate_plan", "check_plan", "default_memory_limit", "gb",
           "static_size"]

def physical_memory_bytes():
    """The machine's physical memory in bytes, or None where sysconf cannot tell."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def default_memory_limit():
    """Half of the machine's physical memory, in bytes (no limit when unknown)."""
    physical = physical_memory_bytes()
    return math.inf if physical is None else int(0.5 * physical)


def gb(n):
    return f"{n / 1e9:.3g} GB" if n >= 1e7 else f"{n / 1e6:.3g} MB"


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a per-example computation will hold (static estimate; the module's
    notation): batch_size B, num_towers T, rows R, outputs_per_example K, num_weights
    P, result_bytes, tower_gradient_bytes, activation_bytes; fallback: "towers" or
    "row passes" (past a TF1 loop)."""

    batch_size: int
    num_towers: int
    rows: int
    outputs_per_example: int
    num_weights: int
    result_bytes: int
    tower_gradient_bytes: int
    activation_bytes: int
    fallback: str = "towers"

    @property
    def total_bytes(self):
        return self.result_bytes + self.tower_gradient_bytes + self.activation_bytes

    def describe(self):
        K = f" x {self.outputs_per_example} outputs" if self.outputs_per_example > 1 else ""
        held = (f", the {self.num_towers} {self.fallback}' gradients before stacking "
                f"{gb(self.tower_gradient_bytes)}" if self.tower_gradient_bytes else "")
        return (f"{gb(self.total_bytes)}: the result {self.rows}{K} x {self.num_weights} "
                f"weights = {gb(self.result_bytes)}{held}, replayed activations "
                f"{gb(self.activation_bytes)}")


def static_size(shape):
    """The number of elements of a static `shape`, or None."""
    if shape.rank is None or not shape.is_fully_defined():
        return None
    return int(np.prod(shape.as_list(), dtype=np.int64))


def _activation_bytes(request, B):
    """Bytes of the floating outputs of the ops between the batch and `ys`, for B."""
    total = 0
    for op in request.batch_downstream:
        if op.type in op_types.ELEMENTWISE_OP_TYPES:
            continue  # TF kernels write these into their input's buffer when they can
        for out in op.outputs:
            if not out.dtype.is_floating or out.shape.rank is None or out.shape.rank == 0:
                continue
            per_example = static_size(out.shape[1:])
            if per_example is not None:
                total += B * per_example * out.dtype.size
    return total


def _weight_bytes(xs):
    """(scalars, bytes) over the entries of xs whose shape is static."""
    P, nbytes = 0, 0
    for x in xs:
        size = static_size(tf.TensorShape(x.shape))
        if size is None:
            continue
        P += size
        nbytes += size * tf.as_dtype(x.dtype).base_dtype.size
    return P, nbytes


def estimate_plan(plan):
    """The `MemoryEstimate` of what `plan` builds, or None while B is unknown."""
    request = plan.request
    B = request.batch_size
    if B is None:
        return None
    rows = B if request.num_groups is None else request.num_groups
    K = int(plan.outputs_per_example)
    reached = [x for x, r in zip(request.xs, request.reads) if r.reached]
    P, all_bytes = _weight_bytes(reached)
    _, fallback_bytes = _weight_bytes([request.xs[k] for k in plan.fallback])
    result_bytes = rows * K * (all_bytes if plan.forms_gradients else fallback_bytes)
    activations = _activation_bytes(request, B)
    return MemoryEstimate(batch_size=B, num_towers=rows, rows=rows, outputs_per_example=K,
                          num_weights=P, result_bytes=result_bytes,
                          tower_gradient_bytes=rows * K * fallback_bytes,
                          activation_bytes=activations,
                          fallback="towers" if plan.loop_op is None else "row passes")


def resolve_limit(memory_limit):
    """The limit in bytes for `memory_limit` (None: the default); raises on bad values."""
    _checks.check_memory_limit(memory_limit)
    return default_memory_limit() if memory_limit is None else memory_limit


def check_plan(plan, memory_limit):
    """Raises ValueError when `plan.estimate` exceeds `memory_limit` (see the module)."""
    limit = resolve_limit(memory_limit)
    estimate = plan.estimate
    if estimate is None or limit == math.inf or estimate.total_bytes <= limit:
        return
    default = default_memory_limit()
    default_words = ("the default, half of this machine's physical memory"
                     if limit == default else "the memory_limit you passed")
    norms_words = ("" if plan.function_name == "per_example_norms" else
                   "per_example_norms if you only need the norms, ")
    raise _context.error(
        ValueError, "the per-example result would need about "
        f"{estimate.describe()}, above the limit of {gb(limit)} ({default_words}). "
        "Ask for less: microbatch_gradients with fewer microbatches (M x P numbers "
        f"instead of B x P), {norms_words}a smaller batch (batch_size) or fewer weights "
        "in `xs`. To raise the limit pass "
        f"memory_limit=<bytes> (e.g. memory_limit={int(estimate.total_bytes * 1.1)}), or "
        "memory_limit=float('inf') to switch the guard off.")

"""Memory guard: estimate what a per-example result will hold, refuse above a limit.

Notation:
    B   examples in the batch          T   towers (B per-example, M microbatches)
    P   weights (scalars over all xs)  K   output entries per example (Jacobians)
    R   rows of the result: B (per-example), M (microbatches)

What is counted, from static shapes, before any op is built:

    estimate = R*K*P*s  +  T*K*P*s  +  activations      (s bytes per number)

  R*K*P*s      the result: R rows (B, or M microbatches) of K outputs (Jacobians; 1
               otherwise) of every weight in `xs`, each in its own dtype. Every entry
               of `xs` counts, including weights `ys` does not reach (they get zeros).
  T*K*P*s      the same again, T = R: the towers' gradients before they are stacked
               into the result. Counted for every method, so for weights the per-op
               rules compute (they write the [R, *x.shape] result directly) the
               estimate errs high.
  activations  B x the per-example size of every floating output of the ops between
               the batch tensors and `ys` (the forward pass the towers replay, and the
               rules' batched inputs), except elementwise ops (activations, bias adds),
               whose kernels reuse their input's buffer when they can.

Not counted: the weights themselves and the towers' `tf.identity` copies of them
(which share their input's buffer), the batch tensors, the backward pass's temporary
gradients of the activations (and, for Jacobians, its K repetitions), integer
tensors, weights and activations whose static shape is unknown (where these matter
the estimate is low). It is within a few percent of the traced peak where the result
dominates (docs/independence_and_memory.md). `per_example_norms`
counts only the weights it leaves to towers (the rules' norms form no per-example
gradient of the others); with method="towers" it counts every weight. `build_towers`
is not guarded. When B is not known before building (a None batch axis and no
`batch_size`, allowed for method="rules"), nothing is estimated and nothing is
refused.

The call is refused above `memory_limit` bytes. The default limit is half of the
machine's physical memory (os.sysconf page size x physical pages; no limit where that
is unknown); pass `memory_limit=<bytes>` to set another, or
`memory_limit=float("inf")` to switch the guard off. With B = 512 examples and a 25
M-weight model in float32 the result alone is 51 GB.
"""

import dataclasses
import math
import numbers
import os

import numpy as np
import tensorflow as tf

from pertower import _checks
from pertower import _graph_walk as graph_walk
from pertower._batch_axis import mixing

__all__ = ["MemoryEstimate", "estimate_memory", "check_memory", "default_memory_limit"]

# The default limit: this fraction of the machine's physical memory.
DEFAULT_FRACTION = 0.5


def physical_memory_bytes():
    """The machine's physical memory in bytes, or None where sysconf cannot tell."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def default_memory_limit():
    """Half of the machine's physical memory, in bytes (no limit when unknown)."""
    physical = physical_memory_bytes()
    return math.inf if physical is None else int(DEFAULT_FRACTION * physical)


def _gb(n):
    return f"{n / 1e9:.3g} GB" if n >= 1e7 else f"{n / 1e6:.3g} MB"


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a per-example computation will hold when it runs (static estimate).

    Attributes:
      batch_size: B.
      num_towers: T.
      rows: R, the result's leading axis (B, or M microbatches).
      outputs_per_example: K (1 except for Jacobians).
      num_weights: P, scalars over the weights whose shape is static.
      result_bytes: R x K x P x bytes per number, the returned tensors.
      tower_gradient_bytes: T x K x P x bytes, the towers' gradients before stacking.
      activation_bytes: the replayed forward activations for the whole batch (0 when
        their shapes are not static).
    """

    batch_size: int
    num_towers: int
    rows: int
    outputs_per_example: int
    num_weights: int
    result_bytes: int
    tower_gradient_bytes: int
    activation_bytes: int

    @property
    def total_bytes(self):
        return self.result_bytes + self.tower_gradient_bytes + self.activation_bytes

    def describe(self):
        K = f" x {self.outputs_per_example} outputs" if self.outputs_per_example > 1 else ""
        return (f"{_gb(self.total_bytes)}: the result {self.rows}{K} x {self.num_weights} "
                f"weights = {_gb(self.result_bytes)}, the {self.num_towers} towers' "
                f"gradients before stacking {_gb(self.tower_gradient_bytes)}, replayed "
                f"activations {_gb(self.activation_bytes)}")


def _static_size(shape):
    if shape.rank is None or not shape.is_fully_defined():
        return None
    return int(np.prod(shape.as_list(), dtype=np.int64))


def _weight_shape(x):
    return x.shape


def _batch_size_hint(ys, batch, batch_size):
    """B from `batch_size`, the static axis 0 of `batch` or of `ys`; None if unknown
    (then the builder asks for batch_size itself)."""
    if isinstance(batch_size, numbers.Integral) and not isinstance(batch_size, bool) \
            and batch_size > 0:
        return int(batch_size)
    for b in _checks.as_list(batch) if batch is not None else []:
        if isinstance(b, tf.Tensor) and b.shape.rank:
            size = _checks.static_batch_size(b)
            if size is not None:
                return size
    if isinstance(ys, tf.Tensor) and ys.shape.rank:
        return _checks.static_batch_size(ys)
    return None


def _activation_bytes(ys, batch, B):
    """Bytes of the floating outputs of the ops between the batch and `ys`, for B
    examples; tensors whose per-example shape is not static are left out, and so are
    elementwise ops (activations, bias adds), whose kernels reuse their input's buffer
    when they can."""
    upstream = graph_walk.upstream_ops([ys])
    if batch is None:
        try:
            batch = graph_walk.find_batch_tensors(ys, upstream)
        except ValueError:
            return 0  # the builder reports it
    batch = [b for b in _checks.as_list(batch) if isinstance(b, tf.Tensor)]
    total = 0
    for op in graph_walk.downstream_ops(batch, upstream):
        if op.type in mixing.ELEMENTWISE_OP_TYPES:
            continue  # TF kernels write these into their input's buffer when they can
        for out in op.outputs:
            if not out.dtype.is_floating or out.shape.rank is None or out.shape.rank == 0:
                continue
            per_example = _static_size(out.shape[1:])
            if per_example is not None:
                total += B * per_example * out.dtype.size
    return total


def estimate_memory(ys, xs, batch=None, batch_size=None, num_microbatches=None,
                    outputs_per_example=1):
    """Estimates the bytes per-example gradients of `ys` with respect to `xs` will hold.

    Args:
      ys, xs, batch, batch_size: as in `pertower.per_example_gradients`.
      num_microbatches: M for microbatch gradients (None: one row per example).
      outputs_per_example: K, the output entries per example for Jacobians.

    Returns:
      A `MemoryEstimate`, or None when B is not known yet (no static batch axis and
      no batch_size).

    Example:
      estimate = pertower.estimate_memory(cost, net.trainable_weights, batch_size=512)
      print(estimate.describe())
    """
    B = _batch_size_hint(ys, batch, batch_size)
    if B is None:
        return None
    rows = B if num_microbatches is None else int(num_microbatches)
    P, weight_bytes = 0, 0
    for x in _checks.as_list(xs):
        shape = getattr(x, "shape", None)
        dtype = getattr(x, "dtype", None)
        if shape is None or dtype is None:
            continue  # the builder names the bad entry
        size = _static_size(tf.TensorShape(shape))
        if size is None:
            continue
        P += size
        weight_bytes += size * tf.as_dtype(dtype).base_dtype.size
    K = int(outputs_per_example)
    activations = _activation_bytes(ys, batch, B) if isinstance(ys, tf.Tensor) else 0
    return MemoryEstimate(batch_size=B, num_towers=rows, rows=rows, outputs_per_example=K,
                          num_weights=P, result_bytes=rows * K * weight_bytes,
                          tower_gradient_bytes=rows * K * weight_bytes,
                          activation_bytes=activations)


def resolve_limit(memory_limit, function_name):
    """The limit in bytes for `memory_limit` (None: the default); raises on bad values."""
    if memory_limit is None:
        return default_memory_limit()
    if isinstance(memory_limit, bool) or not isinstance(memory_limit, numbers.Real) or not (
            memory_limit > 0):
        raise ValueError(
            f"pertower.{function_name}: `memory_limit` must be a positive number of bytes, "
            "None (the default: half of the machine's physical memory) or float('inf') (no "
            f"limit), but received {memory_limit!r}.")
    return memory_limit


def check_memory(ys, xs, batch=None, batch_size=None, num_microbatches=None,
                 outputs_per_example=1, memory_limit=None,
                 function_name="per_example_gradients"):
    """Raises ValueError when the estimated bytes exceed `memory_limit`.

    Args:
      ys, xs, batch, batch_size, num_microbatches, outputs_per_example: as in
        `estimate_memory`.
      memory_limit: bytes; None for the default (half the physical memory),
        float("inf") for no limit.
      function_name: the public function named in the message.

    Returns:
      The `MemoryEstimate` (None when B is unknown or the guard is off).
    """
    limit = resolve_limit(memory_limit, function_name)
    if limit == math.inf or tf.executing_eagerly() or not (
            isinstance(ys, tf.Tensor) and hasattr(ys, "op")):
        return None  # off, or bad input the builder reports
    estimate = estimate_memory(ys, xs, batch, batch_size, num_microbatches,
                               outputs_per_example)
    if estimate is None or estimate.total_bytes <= limit:
        return estimate
    default = default_memory_limit()
    default_words = ("the default, half of this machine's physical memory"
                     if limit == default else "the memory_limit you passed")
    norms_words = ("" if function_name == "per_example_norms" else
                   "per_example_norms if you only need the norms, ")
    raise ValueError(
        f"pertower.{function_name}: the per-example result would need about "
        f"{estimate.describe()}, above the limit of {_gb(limit)} ({default_words}). "
        "Ask for less: microbatch_gradients with fewer microbatches (M x P numbers "
        f"instead of B x P), {norms_words}a smaller batch (batch_size) or fewer weights "
        "in `xs`. To raise the limit pass "
        f"memory_limit=<bytes> (e.g. memory_limit={int(estimate.total_bytes * 1.1)}), or "
        "memory_limit=float('inf') to switch the guard off.")

"""The bench's rows: what one row holds, the rows' names, and when a row agrees with
the loop. Nothing here imports TensorFlow or numpy (the command-line parser, the peers'
driver and their child processes read it).

Notation:
    B   examples in the batch       P   weights (parameters) of the model
    x   one weight                  [B, *x.shape] one gradient of x per example
"""

import dataclasses
import resource
import time

__all__ = ["counted", "Entry", "TOLERANCE", "agrees", "short_error", "NOT_COMPARED", "LOOP", "BATCH",
           "OUTER", "HAND_NORMS", "VMAP", "WRITE_LIMIT", "NORMS_FLOOR", "TORCH_VMAP",
           "JAX_VMAP", "TF_PLAIN", "PERTOWER_DP", "OPACUS_HOOKS", "OPACUS_GHOST", "JAX_DP",
           "PEER_ENTRIES"]

# Agreement with the loop in float32: max |diff| <= TOLERANCE * max(1, max |loop|).
TOLERANCE = 1e-4

LOOP, BATCH, OUTER, HAND_NORMS, VMAP, WRITE_LIMIT, NORMS_FLOOR = (
    "loop", "batch gradient", "outer products", "norms by hand", "vectorized_map",
    "memory-write limit", "norms floor")
# entries whose result is not compared with the loop ("n/c")
NOT_COMPARED = ("write", "floor")

# The peers' rows (`benchmarks.peers`), and what each computes: "gradients"
# (per-example, [B, *x.shape]), "step" (a plain SGD step: the mean gradient) or "dp step"
# (a DP-SGD step: the clipped mean, checked with σ = 0, timed with the job's σ).
TORCH_VMAP = "torch vmap(grad)"
JAX_VMAP = "jax jit(vmap(grad))"
TF_PLAIN = "step: tf plain SGD"
PERTOWER_DP = "dp step: pertower"
OPACUS_HOOKS = "dp step: opacus hooks"
OPACUS_GHOST = "dp step: opacus ghost"
JAX_DP = "dp step: jax"
PEER_ENTRIES = {"tf": [(TF_PLAIN, "step"), (PERTOWER_DP, "dp step")],
                "torch": [(TORCH_VMAP, "gradients"), (OPACUS_HOOKS, "dp step"),
                          (OPACUS_GHOST, "dp step")],
                "jax": [(JAX_VMAP, "gradients"), (JAX_DP, "dp step")]}


@dataclasses.dataclass
class Entry:
    """One row of the table: one way of computing one model's results at one B.

    Attributes:
      model: a name of `benchmarks.models.MODEL_NAMES` ("mlp", "cnn", "cifar").
      batch_size: B.
      parameters: P, the number of weights (entries of all of xs).
      name: the row's name ("loop", "gradients[towers]", ...).
      computes: "gradients" ([B, *x.shape] per weight), "norms" ([B]), "sum"
        (the batch gradient, [*x.shape] per weight), "write" (the memory-write
        limit: [B, P] of filler) or "floor" (the norms floor: every layer output's
        gradient dZ); the last two are not compared with the loop.
      status: "ok", "n/a" (the method is not available), "skipped" or "error".
      reason: why the row is not "ok" (empty when it is).
      median_ms: median milliseconds of one pass (one sess.run; the loop: B of them).
      runs_ms: every timed pass, milliseconds.
      median_cpu_ms, cpu_ms: the same in the process's CPU milliseconds (all threads;
        steadier than the wall time on a loaded machine).
      ratio_to_loop: median_ms / the loop's median_ms.
      ratio_to_batch: median_ms / the batch gradient's median_ms.
      ratio_to_outer: median_ms / the hand outer products' median_ms (MLP only).
      build_seconds: graph construction time of the entry's tensors.
      first_run_seconds: the first sess.run (includes Grappler's optimization).
      peak_bytes: peak memory of one traced sess.run (the loop: of one example's run).
      estimate_bytes: pertower.estimate_memory's total for this call (pertower
        gradients entries only).
      max_abs_diff: max |result - the loop's result| over all entries (norms: against
        the norms of the loop's gradients; the batch gradient: against their sum).
      max_abs_reference: max |the loop's result| over the same entries (its scale).
      agrees: max_abs_diff <= TOLERANCE * max(1, max_abs_reference) (None unless run).
      note: where the result differs most from the loop's (the peers: weight k and
        example i, and the max |diff| of a second run on the same inputs, which shows
        a result that changes from run to run); printed under the table when the row
        disagrees.
    """

    model: str
    batch_size: int
    parameters: int
    name: str
    computes: str
    status: str = "ok"
    reason: str = ""
    median_ms: float = None
    runs_ms: list = dataclasses.field(default_factory=list)
    median_cpu_ms: float = None
    cpu_ms: list = dataclasses.field(default_factory=list)
    ratio_to_loop: float = None
    ratio_to_batch: float = None
    ratio_to_outer: float = None
    build_seconds: float = None
    first_run_seconds: float = None
    peak_bytes: int = None
    estimate_bytes: int = None
    max_abs_diff: float = None
    max_abs_reference: float = None
    agrees: bool = None
    note: str = ""


def agrees(max_abs_diff, max_abs_reference):
    """Whether a result within `max_abs_diff` of the loop's, whose largest entry is
    `max_abs_reference`, agrees with it: max_abs_diff <= TOLERANCE * max(1, reference)."""
    return bool(max_abs_diff <= TOLERANCE * max(1.0, max_abs_reference))


def short_error(error):
    """A one-line description of an exception for the table's reason column."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def counted(run, row):
    """`run` that appends the process's minor page faults and CPU ms during each call to
    `row.faults` and `row.cpu_ms`."""
    def run_counted():
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.process_time()
        run()
        row.cpu_ms.append(1e3 * (time.process_time() - start))
        row.faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return run_counted

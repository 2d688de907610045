"""Weights read inside a TF2 while loop (Keras GRU/LSTM, tf.while_loop): per-step A and dZ.

Notation:
    B   examples in the batch          G   groups: B (per example) or M (microbatches)
    T   iterations the loop ran        k   rows per example of one step's A and Z
    W   a weight read in the loop body by an op that has a rule (`Z_t = A_t W`, ...)
    ε   zeros [T, B*k, *z] added to the step's Z: Z_t + ε[t]

The rules need, for every read of W, the op's batch-side input A and dZ, the gradient
of sum(ys) at its output. Inside a loop both exist once per step, and `tf.gradients`
cannot reach a tensor inside a loop body from outside. They come from ONE backward
pass of the loop, TensorFlow's own with each step's dZ_t and A_t pushed to lists
(`pertower.rules._loop_backward`, run from a duplicate of the user's op). Where that
backward cannot be built (TensorFlow's private helpers differ, ...), the loop is
copied (a new
`While` built with `while_v2`, the user's op and functions untouched), its body the
original body's ops with, at every covered op, Z_t replaced by Z_t + ε[t] (ε an extra
loop input, a TensorList read at the step counter) and A_t written to an extra
TensorList output [T, B*k, *a]. Since ε = 0, the copy computes what the loop computes,
and by the chain rule d sum(ys) / dε[t] = dZ_t. With dL/dOut the gradient of sum(ys)
at the ORIGINAL loop's outputs (from the engine's one `tf.gradients` call, which
stops there; the copy's outputs have the same values), ONE backward pass of the copy,
`tf.gradients(copy outputs, ε, grad_ys=dL/dOut)`, gives dZ_t for every step and every
covered op at once, and, in the same pass, the gradients of the tensors before the
loop along the paths through it (an embedding's dZ), as the loop's own backward does
(`_loop_uses.output_gradients`). Example i's rows of step t are its own (the proof below), so

    grad_i(W) = sum over t of rule(A_t, dZ_t) for example i = rule(A_all, dZ_all),

with A_all, dZ_all the steps laid out example-major ([T, B*k, ...] -> [B*k*T, ...]):
the op's own rule, unchanged (a dense read is Goodfellow's sum of outer products over
its k*T rows, its norm the ghost norm of Li et al. 2022, arXiv 2110.05679, and a
clipped sum the reweighted batch gradient, Bu et al. 2023, arXiv 2210.00038: the
book-keeping of ghost clipping, through time). Cost: a forward pass of the loop (the
duplicate, or the copy) and one backward pass, the only one (no per-example pass, and
the lists are sized by the fed batch, so no batch_size is needed), where per-example
weight copies [B, *W] inside the body
(the other way considered) would multiply the loop's weight reads and the backward
loop's weight-gradient accumulators by B.

Proof obligations, each checked while planning (else the weight stays on the fallback,
with the reason): the batch-axis analysis proves `ys` row-wise (the engine), and,
seeded with the loop variables' settled values, proves A_t's and Z_t's rows
example-major in the body; the loop follows while_v2's layout (input 0 an iteration
counter starting at 0 that the body increments by 1: T is the original loop's output
0, known before the copy runs); the body calls no function and has no stateful op but
variable reads (the copy must draw nothing); the weight is a loop-invariant resource
input that the body only reads (ReadVariableOp, then the layout-only ops the engine
allows) and the condition never reads; the covered op's other outputs are unused; and
Z's shape past axis 0 is static; the op's rule reads only A, dZ, the weight's shape and
the op's attributes (`step_rule_reason`). A weight's value passed as a loop input (a
reference variable's snapshot) is read like a resource's value. TF1 (v1) while loops
(Enter/Merge/Switch frames): `pertower.rules._v1_loops`.
"""

import tensorflow as tf

from pertower import _batch_axis
from pertower import _context
from pertower import _op_types as op_types
from pertower import _tf
from pertower._batch_axis import analysis as analysis_lib
from pertower._batch_axis import lattice
from pertower._loops import backward as _loop_backward
from pertower._loops import copy as _loop_copy
from pertower._loops import uses as _loop_uses
from pertower._loops import frames as _v1_loops
from pertower._loops.uses import (LoopUse, concrete_uses, differentiated,  # re-exported
                                  output_gradients)

__all__ = ["LoopUse", "Loops", "concrete_uses", "differentiated", "output_gradients"]

# Body op types a copy may hold that are stateful in TensorFlow's sense (the copy
# reads the same values as the loop).
_STATEFUL_ALLOWED = op_types.VARIABLE_READ_OP_TYPES
_SCOPE = "loop_weights"
_UNCHANGED = frozenset({"Identity", "Snapshot"})
# Public functions that read the plan's uses themselves (not through the engine), where a
# TF1 frame's weights keep their row passes.
_CURVATURE_CALLERS = frozenset({"sum_grad_squared", "diag_ggn", "kfac_factors"})
class _BodyAnalysis:
    """The batch-axis values of a loop body's tensors, read like an `Analysis`."""

    def __init__(self, scan):
        self._scan = scan

    def value(self, tensor):
        return self._scan.value_of(tensor)

    def rows(self, tensor):
        value = self._scan.values.get(tensor)
        if not lattice.contiguous(value, tensor.shape):
            return None
        return lattice.complete(value, tensor.shape)


class Loops:
    """The while loops of one plan whose weights the rules may cover (one `LoopCopy`
    per loop op, analysed once)."""

    def __init__(self, request, analysis, registry):
        self.request = request
        self.analysis = analysis
        self.registry = registry
        self._copies = {}
        self._frames = {}      # TF1 frames by name (`pertower.rules._v1_loops`)

    def frame_uses(self, enter, fallback):
        """The uses of the weight that the TF1 loop op `enter` (Enter) takes into its
        frame (`pertower.rules._v1_loops`), or `fallback` (the reason the weight is not
        covered) with the frame's reason."""
        if _context.name() in _CURVATURE_CALLERS:   # they read plan.uses' A and Z directly
            return (f"{fallback}: {_context.name()} does not take a loop's per-step reads "
                    "(row passes)")
        found = _v1_loops.frame_uses(self._frames, self, enter)
        return f"{fallback}: {found}" if isinstance(found, str) else found

    def uses(self, reads, fallback):
        """The `LoopUse`s of the weight of `reads` (a `WeightReads`) inside the loops
        it is passed to as a resource handle (TF2 loops, and TF1 frames: `fallback(op)`
        gives the reason the weight is not covered in those), or a string saying why
        they are not covered."""
        found = []
        for enter in reads.loop_inputs:
            uses = self.frame_uses(enter, fallback(enter))
            if isinstance(uses, str):
                return uses
            found.extend(uses)
        for op, index in reads.call_inputs:
            if op.type not in op_types.WHILE_OP_TYPES:
                return (f"it is read inside the function body of {op.name!r} ({op.type}), "
                        "where no rule looks")
            uses = self._loop_uses(op, index)
            if isinstance(uses, str):
                return uses
            found.extend(uses)
        return found

    def inner_uses(self, exit_, fallback):
        """For a weight's value passed to a loop (an exit edge of its weight-only region,
        `rules._weight_functions.Exit`, into a TF1 Enter or a TF2 While): its uses inside,
        or a string saying why they are not covered; None for any other op."""
        op = exit_.op
        # a reference variable's value comes through its snapshot (Identity)
        changed = [o for o in exit_.through if o.type not in _UNCHANGED]
        if op.type in op_types.V1_ENTER_OP_TYPES:
            return fallback(op) if changed else self.frame_uses(op, fallback(op))
        if op.type in op_types.WHILE_OP_TYPES:
            if changed:
                return (f"it is passed to the while loop {op.name!r} ({op.type}) through "
                        + ", ".join(f"{o.name!r} ({o.type})" for o in exit_.through))
            return self._loop_uses(op, exit_.slot)
        return None

    def _loop_uses(self, op, index):
        if op not in self._copies:
            self._copies[op] = LoopCopy(op, self)
        uses = self._copies[op].weight_uses(index)
        if isinstance(uses, str):
            return f"it is read inside the while loop {op.name!r} ({op.type}): {uses}"
        return uses


class LoopCopy(_loop_uses.LoopPlan):
    """One while loop: its analysis while planning, its rewritten copy when built."""

    def __init__(self, op, loops):
        self.op = op
        self.loops = loops
        self.targets = []       # (body op, slot): the covered reads, in LoopUse.index order
        self.uses = []          # the LoopUses, same order
        self.step_rows = []     # k of each covered read's A_t and Z_t (static)
        self._built = None
        self.reason = self._analyse()

    # -- planning ----------------------------------------------------------------------

    def _analyse(self):
        op = self.op
        if not _tf.loop_copy():
            return _tf.fallback_reason("loop_copy")
        self.body, self.cond = _function_graph(op, "body"), _function_graph(op, "cond")
        if self.body is None or self.cond is None:
            return "its body could not be read"
        body = self.body
        if len(body.inputs) != len(op.inputs) or len(body.outputs) != len(op.inputs):
            return "its body's inputs and outputs do not match its loop variables"
        counter = body.outputs[0].op
        start = _batch_axis.static_value(op.inputs[0])
        if not (counter.type in ("AddV2", "Add") and counter.inputs[0] is body.inputs[0]
                and _batch_axis.static_value(counter.inputs[1]) == 1
                and start is not None and int(start) == 0):
            return ("its first loop variable is not an iteration counter from 0 (while_v2's "
                    "layout), so the number of steps is not known before a copy runs")
        for inner in body.get_operations():
            reason = _loop_uses.unreplayable_reason(inner, _STATEFUL_ALLOWED)
            if reason is not None:
                return reason
        self.needed = self._needed_variables()
        self.live = _loop_copy.graph_upstream([body.outputs[i] for i in self.needed])
        scan = self._settled_scan()
        if isinstance(scan, str):
            return scan
        self.body_analysis = _BodyAnalysis(scan)
        return None

    def _needed_variables(self):
        """The loop variables the outputs `ys` reads (and the counter) depend on,
        through the body and the condition (accumulators of past gradients are not)."""
        upstream, ys = self.loops.request.ys_upstream, self.loops.request.ys
        self.read = [i for i, t in enumerate(self.op.outputs)   # the outputs ys is or reads
                     if t is ys or any(c in upstream for c in t.consumers())]
        needed = {0} | set(self.read)
        cond_ops = _loop_copy.graph_upstream(self.cond.outputs)
        needed |= {i for i, t in enumerate(self.cond.inputs) if t.op in cond_ops}
        while True:
            ops = _loop_copy.graph_upstream([self.body.outputs[i] for i in needed])
            more = needed | {i for i, t in enumerate(self.body.inputs) if t.op in ops}
            if more == needed:
                return sorted(needed)
            needed = more

    def _settled_scan(self):
        """The body's scan seeded with the loop variables' values over all iterations."""
        analysis = self.loops.analysis
        values = [analysis.value(t) for t in self.op.inputs]
        outputs = [self.body.outputs[i] for i in self.needed]
        for _ in range(4):
            seeds = [(t, v) for t, v in zip(self.body.inputs, values) if v != lattice.INDEPENDENT]
            scan = analysis_lib._Scan(  # pylint: disable=protected-access
                seeds, self.live, outputs, self.loops.registry,
                self.loops.request.batch_size, depth=1).run()
            if scan.couplings or scan.losses:
                found = (scan.couplings[0].op, scan.couplings[0].reason) if scan.couplings \
                    else scan.losses[0]
                return (f"the batch axis of its body is not proven at {found[0].name!r} "
                        f"({found[0].type}): {found[1]}")
            outs = [scan.value_of(t) if i in self.needed else values[i]
                    for i, t in enumerate(self.body.outputs)]
            merged = [_loop_join(a, b) for a, b in zip(values, outs)]
            if merged == values:
                return scan
            values = merged
        return "the values of its loop variables did not settle"

    def weight_uses(self, index):
        """The `LoopUse`s of the weight passed as loop input `index` (its resource handle
        or its value), or a reason."""
        if self.reason is not None:
            return self.reason
        body = self.body
        handle = body.inputs[index]
        if body.outputs[index] is not handle:
            return "the weight's loop variable is not passed on unchanged"
        if handle.consumers() and any(c in _loop_copy.graph_upstream(self.cond.outputs)
                                      for c in self.cond.inputs[index].consumers()):
            return "its condition reads the weight"
        return self.weight_uses_from(handle)

    # what `_loop_uses.LoopPlan` asks of a TF2 loop
    _scope = _SCOPE
    _use_type = LoopUse

    def _in_body(self, op):
        return op in self.live

    def _in_cond(self, op):   # the condition is a function of its own, checked above
        return False

    @property
    def _use_analysis(self):
        return self.body_analysis

    def _steps_rows(self, use):
        """k*T rows per example (T at most the static maximum_iterations: k only
        chooses between a rule's exact forms, e.g. the ghost norm); None when not static."""
        steps = _batch_axis.static_value(self.op.inputs[1])
        return (use.rows.k * int(steps) if steps is not None and steps.ndim == 0 and steps > 0
                else None)

    @property
    def reached_outputs(self):
        """The original loop's outputs that `ys` reads and whose gradients the copy's
        backward pass takes (floating point and TensorLists)."""
        return [self.op.outputs[i] for i in self.read
                if self.op.outputs[i].dtype == tf.variant or self.op.outputs[i].dtype.is_floating]

    def _make_copy(self):
        return _loop_backward.OwnBackward(self)


def _function_graph(op, attr):
    """The graph of the function `attr` ("body" or "cond") of a While op: while_v2's
    own (shapes inferred), or one read back from the graph's library with the op's input
    shapes; None when it cannot be read."""
    own = _tf.own_function_graph(op, attr)
    if own is not None and len(own.inputs) == len(op.inputs):
        return own
    return _tf.called_function_graph(op, attr, input_shapes=[t.shape for t in op.inputs])


def _loop_join(first, second):
    """A loop variable's value over iterations (as the analysis joins them)."""
    if first in (lattice.INDEPENDENT, lattice.SIZE) and isinstance(second, lattice.Rows):
        return second
    return lattice.join(first, second)

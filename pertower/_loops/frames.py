"""Weights read inside a TF1 (v1) while loop's frame (`tf.compat.v1.nn.dynamic_rnn`,
`tf.while_loop` under control flow v1): per-step A and dZ from a copy of the frame.

Notation (as in `pertower.rules._loops`):
    T   iterations the frame ran       k   rows per example of one step's A and Z
    W   a weight entered into the frame (Enter) and read there by an op with a rule
    ε   zeros [T, B*k, *z] added to the step's Z: Z_t + ε[t]

A v1 frame is made of ops of the graph itself (Enter, Merge, Switch, the body's ops,
NextIteration, Exit), so the batch-axis analysis has already given its tensors their
rows, and a rule matches a body op as it matches any op. What `tf.gradients` cannot
give is dZ_t per step (a gradient at a tensor inside a frame). So the frame is copied
as a control flow v2 loop (`while_v2`, `pertower.rules._v1_loop_copy`) whose body
replays the frame's body ops with Z_t + ε[t] at every covered op and writes A_t to a
TensorList, as `_loops` does for a TF2 loop: one backward pass of the copy from the
gradients at the frame's outputs gives every step's dZ_t, and the op's rule sums over
the steps (A_all, dZ_all example-major, [B*k*T, ...]). The user's frame is only read.

What the copy can replay (else the weight keeps its fallback, with the reason): a frame
nested in no other, whose body and condition hold no control flow (no cond, no inner
loop), no function call and no stateful op but variable reads and the TensorArray ops
of `dynamic_rnn`'s layout: reads of an input TensorArray filled outside by one scatter
at indices 0, 1, ... (replayed as items of a TensorList of the scattered tensor, through
which the copy's backward pass reaches it) and one write per step to an output TensorArray carried as a
loop variable, read after the frame by a gather or a read (replayed as a TensorList);
a loop variable counting iterations from 0 by 1 (T, read from the frame's exit); the
weight entered as a loop invariant and read only in the body, through layout ops.
"""

import dataclasses

import tensorflow as tf

from pertower import _batch_axis
from pertower import _op_types as op_types
from pertower import _tf
from pertower._loops import uses as _loop_uses
from pertower._loops import frame_copy as _v1_loop_copy

__all__ = ["Frame", "FrameUse", "frame_uses"]

_SCOPE = "frame_weights"
_TA_READ, _TA_WRITE = "TensorArrayReadV3", "TensorArrayWriteV3"
_TA_AFTER = frozenset({"TensorArrayGatherV3", "TensorArrayReadV3", "TensorArraySizeV3"})
_PLUMBING = (op_types.V1_LOOP_OP_TYPES | op_types.V1_SWITCH_OP_TYPES
             | op_types.V1_MERGE_OP_TYPES)
_STATEFUL_ALLOWED = op_types.VARIABLE_READ_OP_TYPES | {_TA_READ, _TA_WRITE}


@dataclasses.dataclass(frozen=True)
class FrameUse(_loop_uses.LoopUse):
    """A covered read of a weight inside a v1 frame (`loop` is its `Frame`)."""

    @property
    def label(self):
        frame = self.loop.name.rsplit("/while_context", 1)[0]
        return f"{self.op.name} ({self.op.type}) in the TF1 loop {frame!r} per step"


def frame_uses(frames, loops, enter):
    """The `FrameUse`s of the weight that `enter` (an Enter op) takes into its frame, or
    a string saying why they are not covered; `frames` caches one `Frame` per name."""
    name = enter.get_attr("frame_name").decode()
    if name not in frames:
        frames[name] = Frame(enter, name, loops)
    return frames[name].weight_uses(enter)


@dataclasses.dataclass
class LoopVariable:
    """One loop variable of the frame: its Enter, Merge, Switch, body value (the
    Identity of the Switch's true output), NextIteration, Exit (or None); `array` the
    TensorArrayV3 op whose flow it carries (None for a plain value)."""

    enter: tf.Operation
    merge: tf.Operation
    switch: tf.Operation
    value: tf.Tensor
    next_value: tf.Tensor
    exit: object
    array: object = None


class Frame(_loop_uses.LoopPlan):
    """One v1 frame: its structure and analysis while planning, its copy when built."""

    def __init__(self, enter, name, loops):
        self.name = name
        self.loops = loops
        self.graph = enter.graph
        self.targets, self.uses, self.step_rows = [], [], []
        self.reads = {}         # body TensorArrayReadV3 op -> the scattered tensor
        self.writes = {}        # body TensorArrayWriteV3 op -> index of its loop variable
        self.after = []         # (tensor after the frame, loop variable index, op) reached
        self._built = None
        self.reason = self._analyse()

    # -- planning ----------------------------------------------------------------------

    def _analyse(self):
        if not _tf.loop_copy():
            return _tf.fallback_reason("loop_copy")
        enters = [op for op in self.graph.get_operations()
                  if op.type in op_types.V1_ENTER_OP_TYPES
                  and op.get_attr("frame_name").decode() == self.name]
        if any(op.inputs[0].op.type in _PLUMBING or _context_of(op.inputs[0].op) is not None
               for op in enters):
            return "it is nested in another loop or cond"
        if any(op.type != "Enter" for op in enters):   # RefEnter: a reference-typed tensor
            return "it enters a reference-typed tensor"
        self.invariants = {op.outputs[0].ref(): op for op in enters if op.get_attr("is_constant")}
        # every loop variable; those a `tf.gradients` through the frame added (its
        # forward counter, whose increment holds the stack pushes) are not needed by ys
        parsed = [_variable(op) for op in sorted(
            (op for op in enters if not op.get_attr("is_constant")),
            key=_tf.op_order_key())]
        variables = [v for v in parsed if not isinstance(v, str)]
        if not variables:
            return "its loop variables could not be read"
        self.loop_cond = variables[0].switch.inputs[1].op
        needed = self._needed(variables)
        if isinstance(needed, str):
            return needed
        if not needed:
            return "`ys` reads none of its loop variables"
        self.variables = needed
        by_value = {v.value.ref(): j for j, v in enumerate(needed)}
        by_merge = {v.merge.outputs[0].ref(): j for j, v in enumerate(needed)}
        self.body_ops = self._region([v.next_value for v in needed], by_value)
        if isinstance(self.body_ops, str):
            return self.body_ops
        self.cond_ops = self._region([self.loop_cond.inputs[0]], by_merge)
        if isinstance(self.cond_ops, str):
            return self.cond_ops
        found = self._arrays() or self._counter() or self._outputs()
        return found

    def _needed(self, variables):
        """The loop variables that `ys` reads at the frame's exits, that the condition
        reads, and those their next values read (data edges only), in order."""
        by_value = {v.value.ref(): v for v in variables}
        by_merge = {v.merge.outputs[0].ref(): v for v in variables}
        cond = self._region([self.loop_cond.inputs[0]], by_merge)
        if isinstance(cond, str):
            return cond
        needed = {id(v) for v in variables
                  if v.exit is not None and self._reached(v.exit.outputs[0])}
        needed |= {id(by_merge[t.ref()]) for op in cond for t in op.inputs if t.ref() in by_merge}
        needed |= {id(by_merge[t.ref()]) for t in self.loop_cond.inputs if t.ref() in by_merge}
        while True:
            region = self._region([v.next_value for v in variables if id(v) in needed], by_value)
            if isinstance(region, str):
                return region
            reads = [t for op in region for t in op.inputs] + [
                v.next_value for v in variables if id(v) in needed]   # and pass-throughs
            more = needed | {id(by_value[t.ref()]) for t in reads if t.ref() in by_value}
            if more == needed:
                return [v for v in variables if id(v) in needed]
            needed = more

    def _region(self, tensors, stops):
        """The ops of the frame between its loop variables (`stops`: tensor ref -> index)
        and invariants and `tensors`, in creation order, or a reason."""
        seen, stack = set(), [t for t in tensors if t.ref() not in stops
                              and t.ref() not in self.invariants]
        while stack:
            op = stack.pop().op
            if op in seen:
                continue
            if op.type in _PLUMBING or _context_of(op) is None:
                return f"its body or condition holds control flow ({op.name!r}, {op.type})"
            reason = _loop_uses.unreplayable_reason(op, _STATEFUL_ALLOWED)
            if reason is not None:
                return reason
            seen.add(op)
            stack.extend(t for t in op.inputs
                         if t.ref() not in stops and t.ref() not in self.invariants)
        return sorted(seen, key=_tf.op_order_key())

    def _arrays(self):
        """Matches the body's TensorArray reads and writes to `dynamic_rnn`'s layout."""
        by_value = {v.value.ref(): j for j, v in enumerate(self.variables)}
        for op in self.body_ops + self.cond_ops:
            if op.type == _TA_READ and op in self.body_ops:
                handle, flow = (self.invariants.get(op.inputs[i].ref()) for i in (0, 2))
                scatter = flow.inputs[0].op if flow is not None else None
                if (handle is None or scatter is None or scatter.type != "TensorArrayScatterV3"
                        or scatter.inputs[0] is not handle.inputs[0]
                        or scatter.inputs[3] is not handle.inputs[0].op.outputs[1]
                        or not _counts_from_zero(scatter.inputs[1])):
                    return (f"its body reads the TensorArray at {op.name!r} other than as "
                            "one scatter at indices 0, 1, ... made before the loop")
                self.reads[op] = scatter.inputs[2]
            elif op.type == _TA_WRITE and op in self.body_ops:
                handle = self.invariants.get(op.inputs[0].ref())
                j = by_value.get(op.inputs[3].ref())
                variable = self.variables[j] if j is not None else None
                if (handle is None or variable is None or variable.array is not None
                        or handle.inputs[0].op.type != "TensorArrayV3"
                        or variable.enter.inputs[0] is not handle.inputs[0].op.outputs[1]
                        or variable.next_value is not op.outputs[0]
                        or len([c for c in variable.value.consumers()
                                if c in self.body_ops + self.cond_ops]) != 1):
                    return (f"its body writes the TensorArray at {op.name!r} other than once "
                            "per step to a TensorArray it carries from its creation")
                variable.array = handle.inputs[0].op
                self.writes[op] = j
            elif op.type.startswith("TensorArray"):
                return f"its body uses the TensorArray op {op.name!r} ({op.type})"
        return None

    def _counter(self):
        """Finds a loop variable counting the iterations from 0 by 1 (T at its exit)."""
        for v in self.variables:
            add = v.next_value.op
            start = _batch_axis.static_value(v.enter.inputs[0])
            if (v.exit is not None and v.array is None and start is not None
                    and start.ndim == 0 and int(start) == 0
                    and add.type in ("Add", "AddV2") and add.inputs[0] is v.value
                    and _batch_axis.static_value(add.inputs[1]) == 1):
                self.steps = v.exit.outputs[0]
                return None
        return ("it has no loop variable counting its iterations from 0 by 1, so the number "
                "of steps is not known before a copy runs")

    def _reached(self, tensor):
        """Whether `ys` is `tensor` or reads it."""
        request = self.loops.request
        return tensor is request.ys or any(c in request.ys_upstream for c in tensor.consumers())

    def _outputs(self):
        """The tensors after the frame that `ys` reads: exits, and gathers or reads of
        the TensorArrays the frame writes."""
        upstream = self.loops.request.ys_upstream
        for j, v in enumerate(self.variables):
            if v.exit is None:
                continue
            if v.array is None:
                if self._reached(v.exit.outputs[0]) and v.exit.outputs[0].dtype.is_floating:
                    self.after.append((v.exit.outputs[0], j, None))
                continue
            for consumer in v.exit.outputs[0].consumers():
                if consumer not in upstream:
                    continue
                if (consumer.type not in _TA_AFTER
                        or consumer.inputs[0] is not v.array.outputs[0]):
                    return (f"the TensorArray it writes is read after it by "
                            f"{consumer.name!r} ({consumer.type})")
                if consumer.type != "TensorArraySizeV3":
                    self.after.append((consumer.outputs[0], j, consumer))
        return None

    def weight_uses(self, enter):
        """The `FrameUse`s of the weight entered by `enter`, or a reason."""
        if self.reason is not None:
            return self.reason
        if not enter.get_attr("is_constant"):
            return "the weight is a loop variable, not a loop invariant"
        return self.weight_uses_from(enter.outputs[0])

    # what `_loop_uses.LoopPlan` asks of a TF1 frame
    _scope = _SCOPE
    _use_type = FrameUse

    def _in_body(self, op):
        return op in self.body_ops

    def _in_cond(self, op):
        return op in self.cond_ops

    @property
    def _use_analysis(self):   # the frame's ops are the graph's: the plan's analysis
        return self.loops.analysis

    def _steps_rows(self, use):   # k*T rows per example: T is only known when the copy runs
        return None

    @property
    def reached_outputs(self):
        """The tensors after the frame that `ys` reads and the copy reproduces."""
        return [t for t, _, _ in self.after]

    def _make_copy(self):
        return _v1_loop_copy.BuiltFrame(self)


def _variable(enter):
    """The `LoopVariable` that `enter` opens, or a reason."""
    merges = [c for c in enter.outputs[0].consumers() if c.type == "Merge"]
    if len(merges) != 1 or merges[0].inputs[0] is not enter.outputs[0]:
        return f"its loop variable entered by {enter.name!r} has no Merge"
    merge = merges[0]
    switches = [c for c in merge.outputs[0].consumers() if c.type == "Switch"]
    next_op = merge.inputs[1].op if len(merge.inputs) == 2 else None
    if len(switches) != 1 or next_op is None or next_op.type != "NextIteration":
        return f"its loop variable {merge.name!r} is not Merge -> Switch -> NextIteration"
    switch = switches[0]
    values = [c for c in switch.outputs[1].consumers() if c.type == "Identity"]
    others = [c for c in switch.outputs[1].consumers() if c.type != "Identity"]
    exits = [c for c in switch.outputs[0].consumers() if c.type == "Exit"]
    if len(values) != 1 or others or len(exits) > 1:
        return f"its loop variable {merge.name!r} is not read through one Identity"
    return LoopVariable(enter, merge, switch, values[0].outputs[0], next_op.inputs[0],
                        exits[0] if exits else None)


def _context_of(op):
    """The op's TF1 control flow context (None outside loops and conds, and in a graph
    imported without its while contexts)."""
    return _tf.control_flow_context(op)


def _counts_from_zero(indices):
    """Whether `indices` is Range(0, n, 1)."""
    op = indices.op
    return (op.type == "Range" and _batch_axis.static_value(op.inputs[0]) == 0
            and _batch_axis.static_value(op.inputs[2]) == 1)

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
at indices 0, 1, ... (replayed as a gather from the scattered tensor, which the copy
does not differentiate) and one write per step to an output TensorArray carried as a
loop variable, read after the frame by a gather or a read (replayed as a TensorList);
a loop variable counting iterations from 0 by 1 (T, read from the frame's exit); the
weight entered as a loop invariant and read only in the body, through layout ops.
"""

import dataclasses

import tensorflow as tf

from pertower import _batch_axis
from pertower import _op_types as op_types
from pertower.rules import _loop_copy
from pertower.rules import _loop_uses
from pertower.rules import _v1_loop_copy
from pertower.rules import registry as registry_lib

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


class Frame:
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
            key=lambda o: o._id)]  # pylint: disable=protected-access
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
            if any(v.HasField("func") or (v.HasField("list") and v.list.func)
                   for v in op.node_def.attr.values()):
                return f"its body calls functions ({op.name!r}, {op.type})"
            if op.op_def.is_stateful and op.type not in _STATEFUL_ALLOWED:
                return (f"its body has the stateful op {op.name!r} ({op.type}), which a copy "
                        "of the loop would not reproduce")
            seen.add(op)
            stack.extend(t for t in op.inputs
                         if t.ref() not in stops and t.ref() not in self.invariants)
        return sorted(seen, key=lambda o: o._id)  # pylint: disable=protected-access

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
        stack, terminals = [], []
        for consumer in enter.outputs[0].consumers():
            if consumer in self.cond_ops:
                return "its condition reads the weight"
            if consumer not in self.body_ops:
                continue
            if enter.outputs[0].dtype == tf.resource:
                if consumer.type not in op_types.VARIABLE_READ_OP_TYPES:
                    return f"its body passes the weight to {consumer.name!r} ({consumer.type})"
                stack.append((consumer.outputs[0], ()))
            else:
                stack.append((enter.outputs[0], ()))
                break
        while stack:
            tensor, placements = stack.pop()
            for consumer in tensor.consumers():
                if consumer not in self.body_ops:
                    if consumer in self.cond_ops:
                        return "its condition reads the weight"
                    continue
                slots = [j for j, t in enumerate(consumer.inputs) if t is tensor]
                if (consumer.type in op_types.WEIGHT_LAYOUT_OP_TYPES and slots == [0]
                        and consumer.outputs[0].shape.is_fully_defined()
                        and all(_batch_axis.static_value(t) is not None
                                for t in consumer.inputs[1:])):
                    stack.append((consumer.outputs[0], placements))
                    continue
                if consumer.type == "Unpack" and tensor.shape.is_fully_defined():
                    axis = consumer.get_attr("axis") % tensor.shape.rank
                    stack.extend((out, placements + (_loop_copy.Slice(axis, i, tensor.shape),))
                                 for i, out in enumerate(consumer.outputs))
                    continue
                terminals.extend((consumer, j, placements) for j in slots)
        found = []
        for target, slot, placements in sorted(terminals, key=lambda p: (p[0].name, p[1])):
            use = self._target_use(target, slot, placements)
            if isinstance(use, str):
                return use
            found.append(use)
        return found

    def _target_use(self, target, slot, placements):
        where = f"{target.name!r} ({target.type})"
        rule = self.loops.registry.lookup(target.type)
        if rule is None:
            return f"its body reads it by {where}, which has no rule"
        if _loop_uses.step_rule_reason(target, rule) is not None:
            return _loop_uses.step_rule_reason(target, rule)
        use = rule.match(target, slot, self.loops.analysis)
        if isinstance(use, str):
            return f"its body reads it by {where}: {use}"
        if any(c in self.body_ops for out in target.outputs[1:] for c in out.consumers()):
            return f"the body reads other outputs of {where}"
        z_shape = target.outputs[0].shape
        if z_shape.rank is None or not z_shape[1:].is_fully_defined():
            return f"the shape of {target.outputs[0].name} past its rows is not static"
        if use.weight_shape is None or not use.weight_shape.is_fully_defined():
            return f"its shape at {where} ({use.weight_shape}) is not static"
        if use.output is not target.outputs[0] or type(use) is not registry_lib.Use or use.through:
            return (f"the rule of {where} reads it through a view or another output, which "
                    "the loop's copy does not carry")
        if (target, slot) in self.targets:   # the same weight asked for twice
            return self.uses[self.targets.index((target, slot))]
        frame_use = FrameUse(**{f.name: getattr(use, f.name)
                                for f in dataclasses.fields(registry_lib.Use)},
                             loop=self, index=len(self.targets))
        if placements:
            rule = _loop_copy.Placed(rule, placements, target.inputs[slot].shape)
        # k*T rows per example: T is only known when the copy runs
        frame_use = dataclasses.replace(frame_use, rule=rule, rows=use.rows._replace(k=None))
        self.targets.append((target, slot))
        self.uses.append(frame_use)
        self.step_rows.append(use.rows.k)
        return frame_use

    @property
    def reached_outputs(self):
        """The tensors after the frame that `ys` reads and the copy reproduces."""
        return [t for t, _, _ in self.after]

    # -- building ----------------------------------------------------------------------

    def built(self):
        """The copy of the frame (built once, on first use): a `_v1_loop_copy.BuiltFrame`."""
        if self._built is None:
            with tf.name_scope(_SCOPE):
                self._built = _v1_loop_copy.BuiltFrame(self)
        return self._built


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
    return op._control_flow_context  # pylint: disable=protected-access


def _counts_from_zero(indices):
    """Whether `indices` is Range(0, n, 1)."""
    op = indices.op
    return (op.type == "Range" and _batch_axis.static_value(op.inputs[0]) == 0
            and _batch_axis.static_value(op.inputs[2]) == 1)

"""A TF1 frame's plan (`tf.compat.v1.nn.dynamic_rnn`, `tf.while_loop` under control flow
v1): see `pertower._loops`.

A frame's ops are the graph's own, so the plan's batch-axis analysis covers its body and
dZ_t comes from the copy. What the copy can replay (else the weight keeps its fallback,
with the reason): a frame nested in no other, whose body and condition hold no control
flow, function call or stateful op but variable reads and `dynamic_rnn`'s TensorArray
layout: an input TensorArray filled before the frame by one scatter at indices 0, 1, ...
(read as items of a TensorList of the scattered tensor), one write per step to an output
TensorArray carried as a loop variable and gathered or read after the frame (a TensorList
grown as written, padded with zeros to the array's size); a loop variable counting from 0
by 1 (T at its exit); the weight a loop invariant read only in the body, through layout ops.
"""

import dataclasses

import tensorflow as tf

from pertower import _batch_axis
from pertower import _op_types as op_types
from pertower import _tf
from pertower._loops import copy
from pertower._loops import uses as uses_lib
from pertower._tf import list_ops

__all__ = ["Frame"]

_TA_READ, _TA_WRITE = "TensorArrayReadV3", "TensorArrayWriteV3"
_TA_AFTER = frozenset({"TensorArrayGatherV3", "TensorArrayReadV3", "TensorArraySizeV3"})
_PLUMBING = (op_types.V1_LOOP_OP_TYPES | op_types.V1_SWITCH_OP_TYPES
             | op_types.V1_MERGE_OP_TYPES)
_STATEFUL_ALLOWED = op_types.VARIABLE_READ_OP_TYPES | {_TA_READ, _TA_WRITE}


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


class Frame(uses_lib.LoopPlan):
    """One v1 frame: its structure and analysis while planning, its copy when built."""

    def __init__(self, enter, name, loops):
        super().__init__(loops)
        self.name = name
        self.graph = enter.graph
        self.after = []         # (tensor after the frame, loop variable index, op) reached
        self.reason = self._analyse()

    # -- planning ----------------------------------------------------------------------

    def _analyse(self):
        if not _tf.loop_copy():
            return _tf.fallback_reason("loop_copy")
        enters = [op for op in self.graph.get_operations()
                  if op.type in op_types.V1_ENTER_OP_TYPES
                  and op.get_attr("frame_name").decode() == self.name]
        if any(op.inputs[0].op.type in _PLUMBING
               or _tf.control_flow_context(op.inputs[0].op) is not None for op in enters):
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
        return self._arrays() or self._counter() or self._outputs()

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
            if op.type in _PLUMBING or _tf.control_flow_context(op) is None:
                return f"its body or condition holds control flow ({op.name!r}, {op.type})"
            reason = uses_lib.unreplayable_reason(op, _STATEFUL_ALLOWED)
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
        """The `LoopUse`s of the weight entered by `enter`, or a reason."""
        if self.reason is not None:
            return self.reason
        if not enter.get_attr("is_constant"):
            return "the weight is a loop variable, not a loop invariant"
        return self.weight_uses_from(enter.outputs[0])

    # what `uses.LoopPlan` asks of a loop

    @property
    def where(self):
        return f"the TF1 loop {self.name.rsplit('/while_context', 1)[0]!r}"

    def _in_body(self, op):
        return op in self.body_ops

    def _in_cond(self, op):
        return op in self.cond_ops

    @property
    def _use_analysis(self):   # the frame's ops are the graph's: the plan's analysis
        return self.loops.analysis

    @property
    def _body_outputs(self):
        return [v.next_value for v in self.variables]

    def _invariant_input(self, tensor):   # a loop invariant's Enter
        enter = self.invariants.get(tensor.ref())
        return None if enter is None else enter.inputs[0]

    def _steps_rows(self, use):   # k*T rows per example: T is only known when the copy runs
        return None

    @property
    def reached_outputs(self):
        """The tensors after the frame that `ys` reads (`_outputs`)."""
        return [t for t, _, _ in self.after]

    def _make_copy(self):
        return copy.BuiltCopy(self)

    # -- what `copy.BuiltCopy` asks of a loop --------------------------------------------

    edits_user_op = False   # a frame's ops are not edited by a gradient through them

    @property
    def cond_output(self):
        return self.loop_cond.inputs[0]

    def copy_variables(self):
        """The copy's `CopyVariable`s: the needed loop variables (an output TensorArray's
        flow as a TensorList grown as written), then the tensor scattered into each input
        TensorArray, [T, ...], as a TensorList (read at the step's index)."""
        self.outer = {ref: enter.inputs[0] for ref, enter in self.invariants.items()}
        self._element_shapes, variables = {}, []
        for j, v in enumerate(self.variables):
            initial, shape = v.enter.inputs[0], v.merge.outputs[0].shape
            if v.array is not None:
                item = next(op for op, i in self.writes.items() if i == j).inputs[2]
                element = (-1 if item.shape.rank is None else
                           [-1 if d is None else d for d in item.shape.as_list()])
                self._element_shapes[j] = element
                initial = list_ops.tensor_list_reserve(element, 0, v.array.get_attr("dtype"))
                shape = tf.TensorShape([])
            variables.append(copy.CopyVariable(initial, shape, v.merge.outputs[0], v.value,
                                               v.next_value))
        for t in {t.ref(): t for t in self.reads.values()}.values():
            variables.append(copy.CopyVariable(
                list_ops.tensor_list_from_tensor(t, copy.row_shape(t)), tf.TensorShape([]),
                None, t))
        return variables

    def copied_outputs(self, results):
        """The copy's values of `reached_outputs`: an exit's, or a gather or read of an
        output TensorArray from its list padded with zeros to the array's size (as a
        TensorArray's unwritten elements read)."""
        outputs = []
        for _, j, after in self.after:
            if after is None:
                outputs.append(results[j])
                continue
            array = self.variables[j].array
            stacked = list_ops.tensor_list_stack(results[j], array.get_attr("dtype"),
                                                 element_shape=self._element_shapes[j])
            missing = tf.maximum(array.inputs[0] - tf.shape(stacked)[0], 0)
            padded = tf.pad(stacked, tf.concat(
                [[[0, missing]], tf.zeros([tf.rank(stacked) - 1, 2], tf.int32)], axis=0))
            outputs.append(tf.gather(padded, after.inputs[1]))
        return outputs


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


def _counts_from_zero(indices):
    """Whether `indices` is Range(0, n, 1)."""
    op = indices.op
    return (op.type == "Range" and _batch_axis.static_value(op.inputs[0]) == 0
            and _batch_axis.static_value(op.inputs[2]) == 1)

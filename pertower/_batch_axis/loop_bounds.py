"""Loops bounded by a maximum over the batch: the proof that each example's state stops.

Notation (as in every core module):
    B   examples in the batch       L   a per-example length, [B] (or [B, ...])
    t   the loop counter            g   the integer arithmetic from max(L) to the bound

`tf.compat.v1.nn.dynamic_rnn(..., sequence_length=L)` runs `t < g(max(L))` steps on the
whole batch, one example alone `t < g(L_i)`. The extra steps leave the example alone
only when the body keeps its state fixed past its own end:

    state <- where(t >= L, state, cell(state))     output[t] <- where(t >= L, 0, out)

With g non-decreasing and g(x) >= x (identity, casts, max(x, c), min(x, c) with c the
same alone and in the batch, x + c with c >= 0), every extra step has t >= g(L_i) >=
L_i, so the select keeps that example's state and writes zeros where, alone, nothing
was written (a TensorArray reads unwritten entries as zeros). `masked_past_end` checks
this shape of loop, v1 (a LoopCond frame) or v2 (`While`); any other such loop is not
proven, and one bounded by a minimum over the batch never is.
"""

from pertower._batch_axis import static

__all__ = ["V1Loop", "V2Loop", "masked_past_end"]

_COMPARISONS = {  # op type -> (counter operand index, True when the counter is below)
    "Less": (0, True), "LessEqual": (0, True), "Greater": (1, True), "GreaterEqual": (1, True)}
_PAST_END = {  # op type of cond -> (counter operand index, True when "past the end")
    "GreaterEqual": (0, True), "Less": (0, False), "LessEqual": (1, True), "Greater": (1, False)}
_SELECT_TYPES = frozenset({"Select", "SelectV2"})
_ROW_SHAPING_TYPES = frozenset({"Identity", "ExpandDims", "Reshape"})


def _strip(tensor, types=("Identity",)):
    while tensor.op.type in types:
        tensor = tensor.op.inputs[0]
    return tensor


class V1Loop:
    """A TF1 loop seen from its LoopCond: its variables are its Merge ops."""

    def __init__(self, loop_cond):
        self.pred = loop_cond.inputs[0]
        self.switches = {}
        for switch in loop_cond.outputs[0].consumers():
            if switch.type in ("Switch", "RefSwitch") and switch.inputs[1] is loop_cond.outputs[0]:
                merge = switch.inputs[0].op
                if merge.type in ("Merge", "RefMerge"):
                    self.switches[switch] = merge
        self.variables = list(self.switches.values())

    def in_cond(self, tensor):
        """The variable whose current value `tensor` is, as the condition (the body:
        `in_body`) reads it, or None."""
        tensor = _strip(tensor)
        return tensor.op if tensor.op in self.variables else None

    def in_body(self, tensor):
        tensor = _strip(tensor)
        if tensor.value_index == 1 and tensor.op in self.switches:
            return self.switches[tensor.op]
        return None

    def next_value(self, variable):
        for tensor in variable.inputs:
            if tensor.op.type in ("NextIteration", "RefNextIteration"):
                return tensor.op.inputs[0]
        return None

    def outside(self, tensor, in_cond=False):
        """The tensor outside the loop that `tensor` (an Enter of it) reads, or None."""
        tensor = _strip(tensor)
        if tensor.op.type in ("Enter", "RefEnter"):
            return _strip(tensor.op.inputs[0])
        return None


class V2Loop:
    """A `While` op and its two functions: its variables are their input indices."""

    def __init__(self, while_op, cond, body, region=()):
        self.op, self.cond, self.body = while_op, cond, body
        self.pred = cond.outputs[0]
        self.variables = list(range(len(body.inputs)))
        self.region = region

    def accumulator(self, variable):
        """Whether `variable` only records values for a gradient: a list the body only
        extends (TensorListPushBack), whose final value no op between the batch and
        `ys` reads."""
        new = _strip(self.next_value(variable))
        if new.op.type != "TensorListPushBack" or self.in_body(new.op.inputs[0]) != variable:
            return False
        if any(c is not new.op for c in self.body.inputs[variable].consumers()):
            return False
        return variable < len(self.op.outputs) and not any(
            c in self.region for c in self.op.outputs[variable].consumers())

    @staticmethod
    def _index(tensor, inputs):
        tensor = _strip(tensor)
        return next((j for j, t in enumerate(inputs) if t is tensor), None)

    def in_cond(self, tensor):
        return self._index(tensor, self.cond.inputs)

    def in_body(self, tensor):
        return self._index(tensor, self.body.inputs)

    def next_value(self, variable):
        return self.body.outputs[variable]

    def outside(self, tensor, in_cond=False):
        """The input of the `While` that `tensor` (a variable passed on unchanged)
        reads, or None."""
        j = self.in_cond(tensor) if in_cond else self.in_body(tensor)
        if j is None or j >= len(self.op.inputs):
            return None
        if self.in_body(self.body.outputs[j]) != j:
            return None
        return _strip(self.op.inputs[j])


def _same_alone(tensor, shape_value):
    """Whether `tensor` (outside the loop) is the same alone as in the batch: a
    constant, or shape entries that do not follow B."""
    if static.static_value(tensor) is not None:
        return True
    entries = shape_value(tensor)
    return entries is not None and all(power == 0 for _, power in entries)


def _bound_of(tensor, reduction, shape_value):
    """Whether `tensor` is g(max(L)) with g as in the module docstring."""
    tensor = _strip(tensor, ("Identity", "Cast"))
    if tensor is reduction.outputs[0]:
        return True
    op = tensor.op
    if op.type in ("Maximum", "Minimum", "Add", "AddV2"):
        for j in (0, 1):
            other = op.inputs[1 - j]
            if op.type in ("Add", "AddV2"):
                value = static.static_value(other)
                fits = value is not None and value.size == 1 and value.item() >= 0
            else:
                fits = _same_alone(other, shape_value)
            if fits and _bound_of(op.inputs[j], reduction, shape_value):
                return True
    return False


def _is_counter(loop, variable):
    """Whether the body adds a positive constant to `variable` (t <- t + 1)."""
    step = _strip(loop.next_value(variable))
    if step.op.type not in ("Add", "AddV2"):
        return False
    for j in (0, 1):
        value = static.static_value(step.op.inputs[1 - j])
        if (loop.in_body(step.op.inputs[j]) == variable and value is not None
                and value.size == 1 and value.item() > 0):
            return True
    return False


def _conjuncts(pred):
    pred = _strip(pred)
    if pred.op.type == "LogicalAnd":
        return _conjuncts(pred.op.inputs[0]) + _conjuncts(pred.op.inputs[1])
    return [pred]


def _bounding_counter(loop, reduction, shape_value):
    """The counter t of a condition `t < g(max(L))` (and'ed with conditions on counters
    and values that are the same alone and in the batch), or None."""
    counter = None
    for conjunct in _conjuncts(loop.pred):
        if conjunct.op.type not in _COMPARISONS:
            return None
        below = _COMPARISONS[conjunct.op.type][0]
        t, limit = conjunct.op.inputs[below], conjunct.op.inputs[1 - below]
        variable = loop.in_cond(t)
        if variable is None or not _is_counter(loop, variable):
            return None
        outer = loop.outside(limit, in_cond=True)
        if outer is None:
            return None
        if counter is None and _bound_of(outer, reduction, shape_value):
            counter = variable
        elif not _same_alone(outer, shape_value):
            return None
    return counter


def _new_axes_only(op):
    """Whether `op` is a StridedSlice that only inserts axes (`cond[:, None]`)."""
    spec = static.static_value(op.inputs[1]) if op.type == "StridedSlice" else None
    strides = static.static_value(op.inputs[3]) if spec is not None else None
    if strides is None:
        return False
    whole, new_axes = (1 << spec.size) - 1, op.get_attr("new_axis_mask")
    return (op.get_attr("shrink_axis_mask") == 0 and op.get_attr("ellipsis_mask") == 0
            and new_axes != 0 and bool((strides == 1).all())
            and (op.get_attr("begin_mask") | new_axes) == whole
            and (op.get_attr("end_mask") | new_axes) == whole)


def _past_end(loop, cond, counter, lengths):
    """True when `cond` is `t >= L` (row by row), False when it is `t < L`, else None."""
    cond = _strip(cond, _ROW_SHAPING_TYPES)
    if _new_axes_only(cond.op):
        return _past_end(loop, cond.op.inputs[0], counter, lengths)
    if cond.op.type == "LogicalNot":
        inner = _past_end(loop, cond.op.inputs[0], counter, lengths)
        return None if inner is None else not inner
    if cond.op.type not in _PAST_END:
        return None
    at, past = _PAST_END[cond.op.type]
    t, limit = cond.op.inputs[at], cond.op.inputs[1 - at]
    outer = loop.outside(limit)
    if loop.in_body(t) != counter or outer is None:
        return None
    return past if _strip(outer, ("Identity", "Cast")) is lengths else None


def _split_select(loop, select, counter, lengths):
    """(the branch taken past the end, the other) of a select on `t >= L`, or None."""
    if select.op.type not in _SELECT_TYPES:
        return None
    past = _past_end(loop, select.op.inputs[0], counter, lengths)
    if past is None:
        return None
    return (select.op.inputs[1], select.op.inputs[2]) if past else (
        select.op.inputs[2], select.op.inputs[1])


def _is_zeros(loop, tensor):
    outer = loop.outside(tensor)
    tensor = _strip(outer if outer is not None else tensor)
    if tensor.op.type == "ZerosLike":
        return True
    value = static.static_value(tensor.op.inputs[1] if tensor.op.type == "Fill" else tensor)
    return value is not None and not value.any()


def _kept_past_end(loop, variable, counter, lengths):
    """Whether the body leaves `variable` as it was once t >= L (row by row), or writes
    zeros at index t of the array it stands for."""
    new = _strip(loop.next_value(variable))
    if loop.in_body(new) == variable or _is_counter(loop, variable):
        return True
    branches = _split_select(loop, new, counter, lengths)
    if branches is not None:
        return loop.in_body(branches[0]) == variable
    if new.op.type == "TensorArrayWriteV3":
        handle, index, item = new.op.inputs[3], new.op.inputs[1], new.op.inputs[2]
    elif new.op.type == "TensorListSetItem":
        handle, index, item = new.op.inputs[0], new.op.inputs[1], new.op.inputs[2]
    else:
        return False
    branches = _split_select(loop, _strip(item), counter, lengths)
    return (loop.in_body(handle) == variable and loop.in_body(index) == counter
            and branches is not None and _is_zeros(loop, branches[0]))


def masked_past_end(reduction, loop, shape_value):
    """Whether `loop` (a `V1Loop` or `V2Loop`), bounded by the result of `reduction`
    over the batch axis, keeps each example's state past its own end (the module's
    proof); `shape_value`: the scan's `static.ShapeEvaluator`."""
    if reduction.type != "Max":
        return False
    counter = _bounding_counter(loop, reduction, shape_value)
    if counter is None:
        return False
    lengths = _strip(reduction.inputs[0], ("Identity", "Cast"))
    return all(_kept_past_end(loop, v, counter, lengths)
               or (isinstance(loop, V2Loop) and loop.accumulator(v)) for v in loop.variables)

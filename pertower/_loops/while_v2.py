"""A TF2 `While` loop's plan (Keras GRU/LSTM, `tf.while_loop`): see `pertower._loops`.

Checked while planning (else the weight keeps its fallback, with the reason): while_v2's
layout (input 0 counts iterations from 0 by 1, so T is output 0); a body with no function
call and no stateful op but variable reads; A_t's and Z_t's rows proven example-major by
the batch-axis analysis seeded with the loop variables' settled values; the weight a
loop-invariant input that only the body reads (`uses.LoopPlan`).
"""

import tensorflow as tf

from pertower import _batch_axis
from pertower import _graph_walk
from pertower import _op_types as op_types
from pertower import _tf
from pertower._batch_axis import analysis as analysis_lib
from pertower._batch_axis import lattice
from pertower._loops import backward
from pertower._loops import copy
from pertower._loops import uses as uses_lib

__all__ = ["WhileLoop"]


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


class WhileLoop(uses_lib.LoopPlan):
    """One While op: its analysis while planning, its backward or copy when built."""

    def __init__(self, op, loops):
        super().__init__(loops)
        self.op = op
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
        while counter.type == "Identity":   # (a tf.function's body returns through one)
            counter = counter.inputs[0].op
        start = _batch_axis.static_value(op.inputs[0])
        if not (counter.type in ("AddV2", "Add") and counter.inputs[0] is body.inputs[0]
                and _batch_axis.static_value(counter.inputs[1]) == 1
                and start is not None and int(start) == 0):
            return ("its first loop variable is not an iteration counter from 0 (while_v2's "
                    "layout), so the number of steps is not known before a copy runs")
        for inner in body.get_operations():
            reason = uses_lib.unreplayable_reason(
                inner, op_types.VARIABLE_READ_OP_TYPES | op_types.HANDLE_GATHER_OP_TYPES)
            if reason is not None:
                return reason
        self.needed = self._needed_variables()
        self.live = _graph_walk.upstream_ops([body.outputs[i] for i in self.needed])
        scan = self._settled_scan()
        if isinstance(scan, str):
            return scan
        self.body_analysis = _BodyAnalysis(scan)
        return None

    def _needed_variables(self):
        """The loop variables the outputs `ys` reads (and the counter) depend on,
        through the body and the condition (accumulators of past gradients are not)."""
        self.read = [i for i, t in enumerate(self.op.outputs) if self._reached(t)]
        needed = {0} | set(self.read)
        cond_ops = _graph_walk.upstream_ops(self.cond.outputs)
        needed |= {i for i, t in enumerate(self.cond.inputs) if t.op in cond_ops}
        while True:
            ops = _graph_walk.upstream_ops([self.body.outputs[i] for i in needed])
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
        if handle.consumers() and any(c in _graph_walk.upstream_ops(self.cond.outputs)
                                      for c in self.cond.inputs[index].consumers()):
            return "its condition reads the weight"
        return self.weight_uses_from(handle)

    # what `uses.LoopPlan` asks of a loop

    @property
    def where(self):
        return repr(self.op.name)

    def _in_body(self, op):
        return op in self.live

    def _in_cond(self, op):   # the condition is a function of its own, checked above
        return False

    @property
    def _use_analysis(self):
        return self.body_analysis

    @property
    def _body_outputs(self):
        return self.body.outputs

    def _invariant_input(self, tensor):   # a loop variable passed on unchanged
        index = next((i for i, t in enumerate(self.body.inputs) if t is tensor), None)
        if index is None or self.body.outputs[index] is not tensor:
            return None
        return self.op.inputs[index]

    def _steps_rows(self, use):   # T at most the static maximum_iterations: k only
        # chooses between a rule's exact forms (e.g. the ghost norm)
        steps = _batch_axis.static_value(self.op.inputs[1])
        return (use.rows.k * int(steps) if steps is not None and steps.ndim == 0 and steps > 0
                else None)

    @property
    def reached_outputs(self):
        """The loop's outputs that `ys` reads, floating point or TensorLists."""
        return [self.op.outputs[i] for i in self.read
                if self.op.outputs[i].dtype == tf.variant or self.op.outputs[i].dtype.is_floating]

    def _make_copy(self):
        return backward.OwnBackward(self)

    # -- what `copy.BuiltCopy` asks of a loop --------------------------------------------

    @property
    def steps(self):
        return self.op.outputs[0]

    @property
    def edits_user_op(self):
        return not differentiated_before(self.op)

    def copy_variables(self):
        """The copy's `CopyVariable`s: the `needed` loop variables, but a resource the
        body receives unchanged and only reads: its reads are made once, before the loop
        (`outer`; a read inside is a per-step intermediate, which the copy's backward
        would accumulate), and it is carried only if the condition reads it."""
        body, cond, op = self.body, self.cond, self.op
        cond_ops = _graph_walk.upstream_ops(cond.outputs)
        self.outer, hoisted, variables, self._kept = {}, set(), [], []
        for i in self.needed:
            inner = body.inputs[i]
            readers = [c for c in inner.consumers() if c in self.live]
            if (inner.dtype == tf.resource and body.outputs[i] is inner
                    and all(c.type == "ReadVariableOp" for c in readers)):
                for read in readers:
                    hoisted.add(read)
                    self.outer[read.outputs[0].ref()] = tf.raw_ops.ReadVariableOp(
                        resource=op.inputs[i], dtype=read.get_attr("dtype"))
                if not any(c in cond_ops for c in cond.inputs[i].consumers()):
                    continue
            self._kept.append(i)
            variables.append(copy.CopyVariable(op.inputs[i], inner.shape, cond.inputs[i],
                                               inner, body.outputs[i]))
        order = _tf.op_order_key()
        inputs = {t.op for t in body.inputs} | {t.op for t in cond.inputs}
        self.body_ops = sorted(self.live - inputs - hoisted, key=order)
        self.cond_ops = sorted(cond_ops - inputs, key=order)
        self.cond_output = cond.outputs[0]
        return variables

    def copied_outputs(self, results):
        """The copy's values of `reached_outputs`, from its final loop variables."""
        position = {i: j for j, i in enumerate(self._kept)}
        return [results[position[t.value_index]] for t in self.reached_outputs]


def differentiated_before(op):
    """Whether a gradient through the While op `op` has already edited it: while_v2's
    `_WhileGrad` renames the body it gives accumulator outputs "..._rewritten" and sets
    `_num_original_outputs` to the op's output count; a further gradient finds every
    accumulator it reads (a loop that needed none is edited again, at no harm)."""
    try:
        return (op.get_attr("body").name.endswith("_rewritten")
                and op.get_attr("_num_original_outputs") == len(op.outputs))
    except ValueError:
        return False


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

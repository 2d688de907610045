"""Where each weight enters the computation of `ys`: its reads, gathers, and the
function calls and TF1 loops that get its resource handle (notation: `_graph_walk`)."""

import tensorflow as tf

from pertower import _context
from pertower import _graph_walk as graph_walk
from pertower import _op_types as op_types
from pertower import _tf

__all__ = ["WeightReads", "weight_reads"]


class WeightReads:
    """Where one entry of `xs` enters the computation of `ys`.

    Attributes:
      x, name: the entry of `xs` as given, and a readable name for messages.
      read_tensors: tensors holding the weight's value that ops in S consume.
      gather_ops: `ResourceGather` ops in S.
      call_inputs: (op, input index) pairs of function-calling ops (While, If,
        PartitionedCall, ...) that get the weight's handle.
      loop_inputs: TF1 (v1) while loop ops (Enter) that take the weight's handle.
      handle: the resource handle, or None (reference variables and tensors).
      key: entries of `xs` with the same key are one weight, computed once (a variable
        and a wrapper sharing its handle, such as AutoCastVariable, or one listed twice).
      reached: whether `ys` depends on the weight at all.
    """

    def __init__(self, x, name, read_tensors=(), gather_ops=(), call_inputs=(), handle=None,
                 value=None, loop_inputs=()):
        self.x = x
        self.name = name
        self.read_tensors = list(read_tensors)
        self.gather_ops = list(gather_ops)
        self.call_inputs = list(call_inputs)
        self.loop_inputs = list(loop_inputs)
        self.handle = handle
        self.reached = bool(self.read_tensors or self.gather_ops or self.call_inputs
                            or self.loop_inputs)
        self._read = value
        self.key = handle.ref() if handle is not None else id(x)

    @property
    def copy_source(self):
        """The tensor the towers' copies are taken of (None when not reached): a read,
        a reference variable's snapshot, or one `ReadVariableOp` made on first use."""
        if not self.reached:
            return None
        if self._read is None and self.read_tensors:
            self._read = self.read_tensors[0]
        if self._read is None:
            with tf.control_dependencies(None):
                self._read = tf.raw_ops.ReadVariableOp(
                    resource=self.handle, dtype=self.dtype, name="read")
        return self._read

    @property
    def dtype(self):
        """The dtype of the value x (a variable, a tensor or a resource handle) holds."""
        x = self.x
        if self.gather_ops and not isinstance(x, tf.Variable):
            return self.gather_ops[0].get_attr("dtype")
        if x.dtype != tf.resource:
            return x.dtype.base_dtype
        handle_data = _tf.handle_data(x)
        if handle_data is not None and handle_data.shape_and_type:
            return tf.as_dtype(handle_data.shape_and_type[0].dtype)
        raise _context.error(TypeError, f"the resource tensor {x.name} carries no dtype; "
                             "pass the variable instead of its handle.")


def _handle_consumers(handle, within):
    """(op, input index) pairs of the consumers in `within` of a resource handle,
    looking through Identity ops."""
    found = []
    stack = [handle]
    while stack:
        tensor = stack.pop()
        for op in tensor.consumers():
            if op not in within:
                continue
            if op.type in op_types.HANDLE_FORWARDING_OP_TYPES:
                stack.extend(out for out in op.outputs if out.dtype == tf.resource)
            else:
                found.extend((op, i) for i, t in enumerate(op.inputs) if t is tensor)
    return found


def _resource_reads(x, name, handle, ys_upstream):
    read_tensors, gather_ops, call_inputs, loop_inputs = [], [], [], []
    for op, index in _handle_consumers(handle, ys_upstream):
        if op.type in op_types.VARIABLE_READ_OP_TYPES:
            read_tensors.append(op.outputs[0])
        elif op.type in op_types.HANDLE_GATHER_OP_TYPES:
            gather_ops.append(op)
        elif op.type in op_types.CALL_OP_TYPES:
            call_inputs.append((op, index))
        elif op.type in op_types.V1_LOOP_OP_TYPES:
            loop_inputs.append(op)
        elif op.type in op_types.V1_SWITCH_OP_TYPES:
            raise _context.error(
                NotImplementedError, f"the weight {name!r} is read inside a TF1 (v1) "
                f"tf.compat.v1.cond: its resource handle goes to op {op.name!r} ({op.type}), "
                "which neither the rules nor the towers follow. Read its value before the "
                "cond (value = w.read_value(), used inside the branches: the towers then "
                "compute it), or build the graph with "
                "tf.compat.v1.enable_control_flow_v2() (the cond is then an If op, which "
                "the towers rewrite), or leave this weight out of `xs`.")
        else:
            raise _context.error(
                NotImplementedError, f"the weight {name!r} is passed to op "
                f"{op.name!r} of type {op.type}, which towers cannot give a weight copy to "
                "(they rewrite ReadVariableOp, ResourceGather and the function-calling ops "
                f"{', '.join(sorted(op_types.CALL_OP_TYPES))}). Leave this weight out "
                "of `xs`, or compute `ys` with a plain read of it.")
    order = _tf.op_order_key()
    read_tensors = sorted(set(read_tensors), key=lambda t: order(t.op))
    gather_ops = sorted(set(gather_ops), key=order)
    call_inputs.sort(key=lambda pair: (order(pair[0]), pair[1]))
    loop_inputs = sorted(set(loop_inputs), key=order)
    return WeightReads(x, name, read_tensors, gather_ops, call_inputs, handle,
                       loop_inputs=loop_inputs)


def weight_reads(x, index, ys_upstream, batch):
    """The `WeightReads` of `xs[index]` in the default graph (that of `ys`): a resource
    variable's reads, gathers and calls of its handle; a reference variable's ref
    tensor; a tensor itself."""
    if isinstance(x, _tf.RefVariable):
        ref = _tf.ref_variable_tensor(x)
        reached = any(c in ys_upstream for c in ref.consumers())
        return WeightReads(x, x.name, [ref] if reached else [], value=x.value())
    if isinstance(x, tf.Variable):
        handle = getattr(x, "handle", None)
        if handle is None or not isinstance(handle, tf.Tensor) or handle.dtype != tf.resource:
            raise _context.error(
                TypeError, f"`xs[{index}]` is a variable of type "
                f"{type(x).__name__} without a graph resource handle; pass graph-mode "
                "resource or reference variables, or tensors.")
        # inside a tf.function: the placeholder capturing the handle (None: not captured)
        handle = _tf.handle_in_graph(handle, tf.compat.v1.get_default_graph())
        if handle is None:
            return WeightReads(x, x.name)
        return _resource_reads(x, x.name, handle, ys_upstream)
    if isinstance(x, tf.Tensor) and hasattr(x, "op"):
        if x.dtype == tf.resource:
            return _resource_reads(x, x.name, x, ys_upstream)
        x_upstream = graph_walk.upstream_ops([x])
        if any(b.op in x_upstream for b in batch):
            raise _context.error(
                ValueError, f"`xs[{index}]` ({x.name}) depends on the batch, "
                "so it is an activation rather than a weight: each example already has "
                "its own rows of it, and tf.gradients(ys, activation) gives them. Pass "
                "weights (variables, or tensors that do not depend on the batch).")
        reached = x.op in ys_upstream and any(c in ys_upstream for c in x.consumers())
        return WeightReads(x, x.name, [x] if reached else [])
    raise _context.error(
        TypeError, f"`xs[{index}]` must be a tf.Variable or a tf.Tensor, "
        f"but received {type(x).__name__} ({x!r:.80}).")

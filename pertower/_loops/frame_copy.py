"""The copy of a TF1 (v1) frame that `pertower.rules._v1_loops` plans: ε in, A_t out.

Notation (as in `_loops`):
    T   iterations the frame ran       k   rows per example of one step's A and Z
    ε   zeros [T, B*k, *z] added to a covered op's output Z_t at step t

`BuiltFrame` builds, with `while_v2`, a loop over the frame's loop variables (their
values on entering), a step counter, one TensorList of A_t per covered read and one of
ε per covered read; its condition and body re-create the frame's condition and body
ops one by one (same type, attributes and inputs, mapped to the copy's tensors; loop
invariants read as captures of the tensors the frame enters), with each covered op's
output replaced by output + ε[t]. A read of an input TensorArray becomes an item of a
TensorList of the tensor scattered into it (a loop variable, so that the copy's
backward pass reaches that tensor: the gradients of the weights before the loop come
from it too, `_loop_uses.output_gradients`), and an output TensorArray a TensorList carried as the loop variable (one
element set per write, grown as written); the gathers or reads of that TensorArray
after the frame become gathers from the list's elements padded with zeros to the
TensorArray's size (as a TensorArray's unwritten elements read). T is the frame's own
iteration counter at its exit. One backward pass of the copy,
`tf.gradients(copy outputs, ε, grad_ys=dL/dOut)`, gives every step's dZ_t.
"""

import tensorflow as tf

from pertower import _tf
from pertower._tf import list_ops
from pertower._loops import copy as _loop_copy

__all__ = ["BuiltFrame"]

# attributes not copied: colocation with ops outside the copy's function
_DROPPED_ATTRS = frozenset({"_class"})


class BuiltFrame:
    """The frame's copy with ε inputs and A outputs; the concrete uses of its reads."""

    def __init__(self, frame):
        self.frame = frame
        request = frame.loops.request
        variables = frame.variables
        steps = frame.steps                                              # T
        B = (request.batch_size if request.batch_size is not None else
             tf.shape(request.batch[0])[request.batch_axes[0]])
        eps, eps_lists, a_lists, a_shapes = [], [], [], []
        for (target, _), use, k in zip(frame.targets, frame.uses, frame.step_rows):
            z, a = target.outputs[0], use.activation
            rest = z.shape.as_list()[1:]
            zeros = tf.zeros(tf.stack([steps, B * k] + rest), z.dtype)  # ε [T, B*k, *z]
            eps.append(zeros)
            eps_lists.append(list_ops.tensor_list_from_tensor(zeros, [-1] + rest))
            a_shape = [-1] + [-1 if d is None else d for d in a.shape.as_list()[1:]]
            a_shapes.append(a_shape)
            a_lists.append(list_ops.tensor_list_reserve(a_shape, steps, a.dtype))
        n, J = len(variables), len(frame.targets)
        element_shapes = {}
        initial, invariants = [], []
        for j, v in enumerate(variables):
            if v.array is None:
                initial.append(v.enter.inputs[0])
                invariants.append(v.merge.outputs[0].shape)
            else:
                write = next(op for op, i in frame.writes.items() if i == j)
                shape = [-1 if d is None else d for d in write.inputs[2].shape.as_list()] \
                    if write.inputs[2].shape.rank is not None else None
                element_shapes[j] = shape
                initial.append(list_ops.tensor_list_reserve(
                    shape if shape is not None else -1, 0, v.array.get_attr("dtype")))
                invariants.append(tf.TensorShape([]))
        # each input TensorArray's scattered tensor [T, ...] as a TensorList loop variable,
        # read at the step's index: the copy's backward pass reaches the tensor
        scattered = list({t.ref(): t for t in frame.reads.values()}.values())
        in_lists = [list_ops.tensor_list_from_tensor(t, _element_shape(t)) for t in scattered]
        invariants += [tf.TensorShape([])] * (1 + 2 * J + len(scattered))

        def arrays(values):
            return {t.ref(): (values[n + 1 + 2 * J + i], t)
                    for i, t in enumerate(scattered)}
        target_index = {target: j for j, (target, _) in enumerate(frame.targets)}

        def cond(*values):
            mapping = {v.merge.outputs[0].ref(): values[j] for j, v in enumerate(variables)}
            _replay(frame, frame.cond_ops, mapping, arrays(values))
            return mapping[frame.loop_cond.inputs[0].ref()]

        def body(*values):
            s = values[n]
            mapping = {v.value.ref(): values[j] for j, v in enumerate(variables)}

            def perturbed(target, z):
                j = target_index[target]
                return tf.math.add_n([z, list_ops.tensor_list_get_item(
                    values[n + 1 + J + j], s, z.dtype,
                    element_shape=[-1] + target.outputs[0].shape.as_list()[1:])])

            _replay(frame, frame.body_ops, mapping, arrays(values), perturbed)
            outs = [mapping[v.next_value.ref()] for v in variables]
            written = [list_ops.tensor_list_set_item(values[n + 1 + j], s,
                                                     mapping[u.activation.ref()])
                       for j, u in enumerate(frame.uses)]
            return outs + [s + 1] + written + list(values[n + 1 + J:])

        results = _tf.while_loop(
            cond, body, initial + [tf.constant(0, tf.int32)] + a_lists + eps_lists + in_lists,
            shape_invariants=invariants, name="copy")
        self.outputs = []
        for _, j, after in frame.after:
            if after is None:
                self.outputs.append(results[j])
                continue
            array = variables[j].array
            stacked = list_ops.tensor_list_stack(results[j], array.get_attr("dtype"),
                                                 element_shape=element_shapes[j])
            size = array.inputs[0]
            missing = tf.maximum(size - tf.shape(stacked)[0], 0)
            padded = tf.pad(stacked, tf.concat(
                [[[0, missing]], tf.zeros([tf.rank(stacked) - 1, 2], tf.int32)], axis=0))
            self.outputs.append(tf.gather(padded, after.inputs[1]))
        self.eps = eps
        self.uses = _loop_copy.stacked_uses(frame.uses, results[n + 1:], a_shapes, eps)

    def output_gradients(self, d_outputs, unconnected, others=(), stops=()):
        """({id(ε_j): dZ_all_j, [B*k*T, *z]}, [gradient at each of `others`, or None])
        from one backward pass of the copy, given the gradients `d_outputs` at
        `frame.reached_outputs` (None where unconnected), stopping at `stops`."""
        return _loop_copy.eps_gradients(self.outputs, d_outputs, self.eps, unconnected,
                                        others, stops)


def _element_shape(tensor):
    """The element shape of a TensorList of the rows of `tensor` (-1 where unknown)."""
    if tensor.shape.rank is None:
        return -1
    return [-1 if d is None else d for d in tensor.shape.as_list()[1:]]


def _replay(frame, ops, mapping, arrays, perturbed=None):
    """Re-creates `ops` (in creation order) in the current graph, reading
    mapping[tensor.ref()] for the frame's tensors and the entered tensor for a loop
    invariant, and arrays[ref(scattered)] = (TensorList, scattered) for a read of an input
    TensorArray; adds each op's outputs to `mapping` (a covered op's output Z as
    `perturbed(op, Z)`)."""
    graph = tf.compat.v1.get_default_graph()

    def read(tensor):
        found = mapping.get(tensor.ref())
        if found is not None:
            return found
        return frame.invariants[tensor.ref()].inputs[0]

    for op in ops:
        if op in frame.reads:      # an input TensorArray's element at the step's index
            items, scattered = arrays[frame.reads[op].ref()]
            outputs = [list_ops.tensor_list_get_item(
                items, read(op.inputs[1]), scattered.dtype,
                element_shape=_element_shape(scattered))]
        elif op in frame.writes:   # an output TensorArray's element: a TensorList item
            outputs = [list_ops.tensor_list_set_item(
                read(op.inputs[3]), read(op.inputs[1]), read(op.inputs[2]),
                resize_if_index_out_of_bounds=True)]
        else:
            attrs = {key: value for key, value in op.node_def.attr.items()
                     if key not in _DROPPED_ATTRS}
            copied = _tf.create_op(
                graph, op.type, [read(t) for t in op.inputs], dtypes=[t.dtype for t in op.outputs],
                name=op.name.rsplit("/", 1)[-1], attrs=attrs, op_def=op.op_def)
            outputs = list(copied.outputs)
            if perturbed is not None and any(op is t for t, _ in frame.targets):
                outputs[0] = perturbed(op, outputs[0])
        for original, value in zip(op.outputs, outputs):
            mapping[original.ref()] = value

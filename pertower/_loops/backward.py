"""dZ_t and A_t of a TF2 loop's covered reads from ONE backward pass of the loop.

Notation as in `pertower._loops`; `op` the user's While op, D its duplicate (a While op
calling the same functions on the same inputs). `OwnBackward.output_gradients` builds D
and its backward as while_v2's `_WhileGrad` does (`_create_grad_func`, `_grad_fn`; TF
2.21) with two changes: the backward body's `_GradientsHelper` call also returns the
gradient at each covered op's output Z_t, and the body pushes that dZ_t and A_t (popped
from the accumulator the op's own gradient reads; the unread A_t of a BiasAdd or a
broadcast Add or Sub is stood in by dZ_t) onto two extra loop variables, both holding steps T-1 .. 0. The body reads what
TensorFlow's reads, so its edit of the forward loop is made to D and, identically, to
`op` (as any `tf.gradients` would, `_towers.later_gradients`); pertower reads only D's
outputs. Otherwise (way `loop_backward`, a body graph not while_v2's own, an
IndexedSlices gradient, another unread A_t) the copy (`copy.BuiltCopy`) is used.
"""

import tensorflow as tf

from pertower import _op_types as op_types
from pertower import _tf
from pertower._loops import copy
from pertower._tf import list_ops
from pertower._towers import later_gradients

__all__ = ["OwnBackward"]

# the covered op types whose rules read only dZ (their A is a stand-in): a broadcast
# Add's or Sub's gradient with respect to the weight is ±dZ summed over its broadcast axes,
# whatever the other input, rebuilt on dZ_all (`rules.broadcast`), holds
_DZ_ONLY_OP_TYPES = frozenset({"BiasAdd", "Add", "AddV2", "Sub"})


class _Unsupported(Exception):
    """The backward body needs what `OwnBackward` does not handle."""


class OwnBackward:
    """The per-step A and dZ of a TF2 loop's covered reads from the loop's own backward
    (see the module notes); a `BuiltCopy` where that is not possible."""

    def __init__(self, loop):
        self.loop = loop
        op = loop.op
        # while_v2's helpers as expected, the op in the graph being built, its own body
        # graph planned, no extra output TensorFlow did not add; else the copy
        supported = (op.graph is tf.compat.v1.get_default_graph()
                     and _tf.loop_backward()
                     and op.type in op_types.WHILE_OP_TYPES
                     and _tf.own_function_graph(op, "body") is loop.body
                     and _tf.own_function_graph(op, "cond") is not None
                     and len(loop.body.outputs) == len(op.outputs))
        self._copy = None if supported else copy.BuiltCopy(loop)
        self._uses = None

    @property
    def uses(self):
        """The built `Use` of each loop use (A_all example-major, [B*k*T, *a], and the
        key of dZ_all), known once `output_gradients` has run (else the copy's)."""
        if self._copy is None and self._uses is None:
            self._copy = copy.BuiltCopy(self.loop)   # asked for before the backward
        return self._copy.uses if self._copy is not None else self._uses

    def output_gradients(self, d_outputs, unconnected, others=(), stops=()):
        """As `copy.BuiltCopy.output_gradients`, from one backward pass of the loop (dZ_all
        keyed by id(key_j) of `uses`)."""
        if self._copy is None and any(d is not None for d in d_outputs):
            try:
                return self._backward(d_outputs, others, stops)
            except _Unsupported:
                if self._uses is not None:
                    raise
                _fresh_graphs(self.loop.op)
        if self._copy is None:
            self._copy = copy.BuiltCopy(self.loop)
        return self._copy.output_gradients(d_outputs, unconnected, others, stops)

    def _backward(self, d_outputs, others, stops):
        loop, op = self.loop, self.loop.op
        cond_graph = _tf.while_graph(op, "cond")
        body_graph = _tf.while_graph(op, "body")
        if body_graph is not loop.body:
            raise _Unsupported("the body graph is not while_v2's own")
        given = {t.value_index: d for t, d in zip(loop.reached_outputs, d_outputs)
                 if d is not None}
        grads, chosen = later_gradients.body_gradients(
            op, later_gradients.output_gradients(op, given), body_graph)
        if any(isinstance(g, tf.IndexedSlices) for g in grads):
            raise _Unsupported("an output gradient is an IndexedSlices")
        if not chosen:
            raise _Unsupported("no output takes a gradient")
        ys, xs, non_none = (list(part) for part in zip(*chosen))
        dup = _duplicate(op)
        body_grad_graph, args, stand_ins = self._grad_body(
            ys, xs, non_none, cond_graph, body_graph, dup)
        if body_grad_graph.while_op_needs_rewrite:
            later_gradients.edit_while_ops([op, dup], cond_graph, body_graph, body_grad_graph)
        for target in (op, dup):
            _tf.set_num_original_outputs(target)
        if op.control_inputs:
            _tf.add_control_inputs(dup, op.control_inputs)
        captured = _tf.resolve_grad_captures(body_graph, body_grad_graph, dup)
        loop_vars = args + captured

        def grad_cond(counter, unused_maximum_iterations, forward_loop_iters, *unused):
            return counter < forward_loop_iters

        cond_name = _tf.unique_grad_fn_name(op.get_attr("cond").name)
        cond_grad_graph = _tf.func_graph_from_py_func(
            cond_name, grad_cond, loop_vars,
            func_graph=_tf.cond_func_graph(cond_name))
        outputs = _tf.build_while_op(
            loop_vars, cond_grad_graph, body_grad_graph,
            output_shapes=[t.shape for t in body_grad_graph.outputs],
            parallel_iterations=op.get_attr("parallel_iterations"), name="backward",
            num_original_outputs=len(body_grad_graph.outputs))
        return self._results(outputs, grads, body_grad_graph, xs, stand_ins, others, stops)

    def _grad_body(self, ys, xs, grads, cond_graph, body_graph, dup):
        """(the backward body, its arguments, [j: A_t stood in by dZ_t]): while_v2's
        `_create_grad_func` with `_grad_fn` also pushing dZ_t and A_t."""
        loop = self.loop
        zs = [target.outputs[0] for target, _ in loop.targets]
        J = len(zs)
        dz_lists = [list_ops.empty_tensor_list(copy.element_shape(z, lead), z.dtype)
                    for z, lead in zip(zs, loop.z_leads)]
        a_lists = [list_ops.empty_tensor_list(copy.element_shape(u.activation, u.rows.lead),
                                              u.activation.dtype)
                   for u in loop.uses]
        total_iters = dup.outputs[0]
        counter = tf.constant(0, dtype=total_iters.dtype, name="grad_counter")
        maximum_iterations = loop.op.inputs[1]
        args = [counter, maximum_iterations, total_iters] + grads + dz_lists + a_lists
        n = len(grads)
        stand_ins = [False] * J

        def body(*values):
            found = _tf.gradients_in_body(
                ys, xs + zs, grad_ys=values[3:3 + n], src_graph=body_graph)
            grad_outs, dzs = found[:len(xs)], found[len(xs):]
            if any(isinstance(g, tf.IndexedSlices) for g in grad_outs + dzs):
                raise _Unsupported("a gradient in the body is an IndexedSlices")
            graph = tf.compat.v1.get_default_graph()
            pushed_a = []
            for j, use in enumerate(loop.uses):
                a = _already_read(graph, use.activation)
                if a is None and use.op.type in _DZ_ONLY_OP_TYPES:
                    stand_ins[j] = True
                    pushed_a.append(values[3 + n + J + j])
                    continue
                if a is None:
                    raise _Unsupported(f"the backward does not read {use.activation.name}")
                pushed_a.append(list_ops.tensor_list_push_back(values[3 + n + J + j], a))
            pushed_dz = [list_ops.tensor_list_push_back(values[3 + n + j], dz)
                         for j, dz in enumerate(dzs)]
            return ([values[0] + 1, values[1], values[2]] + list(grad_outs)
                    + pushed_dz + pushed_a)

        name = _tf.unique_grad_fn_name(body_graph.name)
        grad_graph = _tf.func_graph_from_py_func(
            name, body, args,
            func_graph=_tf.body_grad_func_graph(
                name, cond_graph, body_graph, maximum_iterations, dup,
                _IdentitySet(body_graph.inputs), _IdentitySet(body_graph.outputs)))
        for external, internal in grad_graph.captures:
            key = _tf.tensor_id(internal)
            if key not in grad_graph.internal_capture_to_output:
                raise _Unsupported(f"{internal} captures {external} without an output")
            grad_graph.outputs.append(grad_graph.internal_capture_to_output[key])
            grad_graph.structured_outputs.append(grad_graph.internal_capture_to_output[key])
        return grad_graph, args, stand_ins

    def _results(self, outputs, grads, body_grad_graph, xs, stand_ins, others, stops):
        """({id(key_j): dZ_all_j}, [gradients at `others`]) from the backward's outputs;
        sets the built uses (once)."""
        loop, J = self.loop, len(self.loop.targets)
        first = 3 + len(xs)
        found, uses = {}, []
        for j, use in enumerate(loop.uses):
            dz = copy.stacked(tf.identity(outputs[first + j]), use.output,
                              loop.z_leads[j])                                # [B*k*T, *z]
            a = dz if stand_ins[j] else copy.stacked(
                tf.identity(outputs[first + J + j]), use.activation,
                use.rows.lead)                                                # [B*k*T, *a]
            key = dz if self._uses is None else self._uses[j].output
            found[id(key)] = dz
            uses.append(copy.built_use(use, a, key))
        if self._uses is None:
            self._uses = uses
        d_inputs = _tf.structured_grad_output(outputs, grads, body_grad_graph)
        others = list(others)
        pairs = [(t, tf.identity(g)) for t, g in zip(loop.op.inputs, d_inputs)
                 if g is not None and (t.dtype.is_floating or t.dtype == tf.variant)]
        more = [None] * len(others)
        if others and pairs:
            more = tf.gradients([t for t, _ in pairs], others, grad_ys=[g for _, g in pairs],
                                stop_gradients=list(stops),
                                unconnected_gradients=tf.UnconnectedGradients.NONE)
        return found, more


def _duplicate(op):
    """D: a While op with `op`'s type, inputs and attributes, in the current name scope
    (it calls the same functions), without control inputs (the caller adds `op`'s after
    the edit: a data input added after a control input makes an invalid node)."""
    attrs = {key: value for key, value in op.node_def.attr.items()}
    with _tf.clear_control_inputs():
        dup = _tf.create_op(op.graph, op.type, list(op.inputs),
                            [t.dtype for t in op.outputs], name="copy",
                            attrs=attrs)
    _tf.copy_handle_data(op.outputs, dup.outputs)
    return dup


def _already_read(graph, tensor):
    """The backward body's value of the forward body's `tensor` when the gradient has
    already read it (so reading it adds no accumulator), else None."""
    captures = _tf.indirect_captures(graph)
    while True:
        found = captures.get(_tf.tensor_id(tensor))
        if found is not None or tensor.op.type != "Identity":
            return found
        tensor = tensor.op.inputs[0]


def _fresh_graphs(op):
    """Replaces the body and condition graphs a failed attempt may have given
    accumulators (the op itself is not edited yet) with graphs read back from the op's
    functions, as while_v2 `_get_graph` reads them for an op it did not build; kept on
    the op, so that every later gradient through it edits and reads the same graph."""
    shapes = [tf.TensorShape(s) for s in op.get_attr("output_shapes")]
    for attr in ("cond", "body"):
        _tf.set_own_function_graph(op, attr, _tf.read_function_graph(
            op, shapes, op.get_attr(attr).name))


class _IdentitySet:
    """A set of tensors by identity (while_v2's loop-invariant test reads `in`)."""

    def __init__(self, tensors):
        self._ids = {id(t) for t in tensors}

    def __contains__(self, tensor):
        return id(tensor) in self._ids

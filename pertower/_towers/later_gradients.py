"""The user's control-flow ops made ready for a gradient the user builds later.

Notation:
    op   a function-calling op of the user's graph between the weights and `ys` (While,
         If, PartitionedCall, ... of control flow v2 and `tf.function`)
    S    scratch: a `FuncGraph` inside the user's graph that is never called

TensorFlow builds the gradient of such an op by editing the op itself (while_v2
`_WhileGrad` adds accumulator outputs; cond_v2 `_IfGrad` and a call's gradient add
outputs too), and a session that has run the graph keeps the op as it first ran: a
gradient built later fails with "Connecting to invalid output N of source node". Towers
and loop copies never differentiate the op itself, so `prepare_for_later_gradients`
calls each op's gradient function once, inside S, with the zero gradients `tf.gradients`
feeds unreached outputs: the edit lands in the user's graph, the backward op stays in S.
For a While op only the editing part of `_WhileGrad` runs (`_edit_while`).
"""

import tensorflow as tf

from pertower import _op_types as op_types
from pertower import _tf

__all__ = ["body_gradients", "edit_while_ops", "num_original_outputs", "output_gradients",
           "prepare_for_later_gradients"]


def output_gradients(op, given):
    """The output gradients a `tf.gradients` that reaches the While op's outputs `given`
    ({output index: gradient}) passes to its gradient function: those, TensorFlow's zero
    rule for the other original outputs, None past them."""
    count = num_original_outputs(op)
    zeros = _zero_output_gradients(op, count=count, skip=given)
    return [given[i] if i in given and i < count else g for i, g in enumerate(zeros)]


def _zero_output_gradients(op, dense=True, count=None, skip=()):
    """The output gradients `tf.gradients` passes to op's gradient function when the
    cost reaches none of its outputs: `ZerosLike` for an output taking a default
    gradient, else None (also in `skip` and past `count`); True instead of a floating
    one's zeros with `dense` False."""
    count = len(op.outputs) if count is None else count
    return [None if i in skip or i >= count or not _tf.takes_default_gradient(t)
            else True if not dense and (t.dtype.is_floating or t.dtype.is_complex)
            else _tf.zeros_like_output(op, i)
            for i, t in enumerate(op.outputs)]


def prepare_for_later_gradients(ops):
    """Edits each function-calling op in `ops` (one graph) the way a `tf.gradients`
    through it would (the module notes); one without a registered gradient or a
    trainable output is skipped."""
    calls = sorted((op for op in ops if op.type in op_types.CALL_OP_TYPES),
                   key=_tf.op_order_key())
    for op in calls:
        try:
            gradient_function = _tf.gradient_function(op)
        except LookupError:
            continue
        if gradient_function is None:
            continue
        with op.graph.as_default():
            scratch = _tf.FuncGraph(f"pertower_scratch_{op.name.replace('/', '_')}")
        with scratch.as_default():
            # S is never called: its ops (the zero gradients, the backward op) and its
            # captures of the op's outputs never enter the user's graph
            if gradient_function is _tf.while_gradient_function() and _edit_while(op):
                continue
            output_gradients = _zero_output_gradients(op)
            if any(g is not None for g in output_gradients):
                gradient_function(op, *output_gradients)


def _edit_while(op):
    """Edits the While op `op` as `_WhileGrad(op, *zero output gradients)` does, without
    the backward op. False, editing nothing, where TensorFlow's helpers are missing or no
    output takes a gradient: the caller runs the whole gradient."""
    if not _tf.while_edit():
        return False
    count = num_original_outputs(op)
    grads = [tf.compat.v1.placeholder(t.dtype, t.shape) if g is True else g
             for t, g in zip(op.outputs, _zero_output_gradients(op, dense=False, count=count))]
    cond_graph, body_graph = _tf.while_graph(op, "cond"), _tf.while_graph(op, "body")
    _, chosen = body_gradients(op, grads, body_graph)
    if not chosen:
        return False
    body_grad_graph, _ = _tf.create_grad_func(
        *zip(*chosen), cond_graph, body_graph, _tf.unique_grad_fn_name(body_graph.name),
        op, op.inputs[1])
    if body_grad_graph.while_op_needs_rewrite:
        edit_while_ops([op], cond_graph, body_graph, body_grad_graph)
    _tf.set_num_original_outputs(op)
    return True


def num_original_outputs(op):
    """The outputs of the While op `op` before any gradient's accumulators."""
    try:
        return op.get_attr("_num_original_outputs")
    except ValueError:
        return len(op.outputs)


def body_gradients(op, grads, body_graph):
    """(the output gradients `grads` of the While op `op` as `_WhileGrad` passes them to
    its backward body, None past the original outputs; [(body output, body input,
    gradient)] of those not None)."""
    count = num_original_outputs(op)
    grads = [_tf.preprocess_grad(g, body_out, while_in, while_out)
             for g, body_out, while_in, while_out in zip(
                 grads[:count], body_graph.outputs, op.inputs, op.outputs)]
    grads += [None] * (len(op.outputs) - count)
    return grads, [(y, x, g) for y, x, g in zip(body_graph.outputs, body_graph.inputs, grads)
                   if g is not None]


def edit_while_ops(ops, cond_graph, body_graph, body_grad_graph):
    """`_WhileGrad`'s edit of its forward op, made to each While op of `ops` (the same
    functions): the rewritten cond and body, the accumulator inputs the backward body
    added (`extra_inputs`) and the outputs past the original ones."""
    orig_num_params = len(ops[0].inputs)
    new_inputs = body_grad_graph.extra_inputs
    cond_graph.name += "_rewritten"
    body_graph.name += "_rewritten"
    cond_function = _tf.create_new_tf_function(cond_graph)
    body_function = _tf.create_new_tf_function(body_graph)
    for while_op in ops:
        if len(body_graph.output_types) != len(while_op.inputs) + len(new_inputs):
            raise AssertionError(
                f"the edited While op {while_op.name!r} has {len(body_graph.output_types)} "
                f"output types for {len(while_op.inputs)} inputs and {len(new_inputs)} new "
                "ones, as TensorFlow's own While gradient would have found")
        _tf.edit_while_op(while_op, cond_function, body_function, body_graph, new_inputs,
                          orig_num_params)

"""The user's control-flow ops made ready for a gradient the user builds later.

Notation:
    op   a function-calling op of the user's graph between the weights and `ys` (While,
         If, PartitionedCall, ... of control flow v2 and `tf.function`)
    S    scratch: a `FuncGraph` inside the user's graph that is never called

TensorFlow builds the gradient of such an op by editing the op itself: the While
gradient (tensorflow/python/ops/while_v2.py, `_WhileGrad`) makes the forward loop
output the accumulators of the intermediates the backward loop reads
(`while_op._set_func_attr("body", ...)`, `_add_while_inputs`, `_add_outputs`); the If
gradient (cond_v2.py, `_IfGrad`) and the gradient of a `tf.function` call
(`_DelayedRewriteGradientFunctions` in function.py / atomic_function) likewise add
outputs to the forward op. A session that has already run the graph keeps the op as
it was when it first ran (TF's C API only records the change: "was changed by setting
attribute after it was run by a session"), so a gradient built after the first run,
which reads the new outputs, fails with "Connecting to invalid output N of source node
.../while". Plain TensorFlow has the same limit; code that computes per-example
gradients with plain `tf.gradients` differentiates the op (and so edits it) when it
builds them, and a training op built after the first run then reuses the
accumulators already there.

Towers differentiate copies of the op, never the op itself. So that a training op
built after pertower's tensors have run works as with plain `tf.gradients`, the towers
call each op's registered gradient function once, with a zero gradient for every
trainable output (what `tf.gradients` feeds an output the cost does not reach;
gradients_util.py `_GradientsHelper`: "dC/doutput[i] is 0"; every trainable output
gets one, so the edit is the one any `tf.gradients` through the op makes), inside S.
The edit of the forward op lands in the user's graph, exactly as a user's
`tf.gradients` makes it (the rewritten functions are added to the op's graph: control_flow_util_v2
`create_new_tf_function` adds to `func_graph.outer_graph`; the accumulators' initial
`EmptyTensorList`s are made in the forward graph's outer graph, while_v2
`_WhileBodyGradFuncGraph._capture_helper`), while the backward op and everything that
reads the new outputs stay in S, which is never called: no op of the user's graph
reads an output a running session may lack. A graph a session has already run before
the pertower call (the op already ran) keeps running unchanged: that session ignores
the edit (TF logs the warning quoted above once) and sees only new ops that read no
new output.

For a While op, only the part of `_WhileGrad` that edits the op runs (`_edit_while`):
the backward body is built (it decides which accumulators the op gets) but not the
backward op itself (its condition, its function, its output identities), which S
would drop anyway; the edit is the same. Where TensorFlow's private While gradient
helpers differ from what `_edit_while` expects, the whole gradient function runs.
"""

import tensorflow as tf

from pertower import _op_types as op_types
from pertower import _tf

__all__ = ["output_gradients", "prepare_for_later_gradients", "set_while_functions"]


def output_gradients(op, given, count):
    """The output gradients a `tf.gradients` that reaches op's outputs `given`
    ({output index: gradient}) passes to op's gradient function: those, and for each
    other output TensorFlow's zero rule (`_zero_output_gradients`); None past the
    first `count` outputs."""
    zeros = _zero_output_gradients(op, count=count, skip=given)
    return [given[i] if i in given and i < count else g for i, g in enumerate(zeros)]


def _zero_output_gradients(op, dense=True, count=None, skip=()):
    """The output gradients `tf.gradients` passes to op's gradient function when the
    cost reaches none of its outputs, made by TF's own rule (gradients_util.py
    `_GradientsHelper`): `control_flow_state.ZerosLike` for each trainable output that
    supports a default gradient, None for the others. With `dense` False, a floating
    output gets True instead of its zeros (`_edit_while` makes its own); a resource's
    or a variant's zeros depend on its handle, and are TensorFlow's. With `count`, the
    outputs past the first `count` get None, and the outputs in `skip` None (made
    by the caller)."""
    count = len(op.outputs) if count is None else count
    return [None if i in skip else
            (True if not dense and (t.dtype.is_floating or t.dtype.is_complex)
             else _tf.zeros_like_output(op, i))
            if i < count and _tf.is_trainable(t)
            and _tf.supports_default_grad(t)
            else None for i, t in enumerate(op.outputs)]


def prepare_for_later_gradients(ops):
    """Edits each op in `ops` the way a `tf.gradients` through it would, leaving none of
    the gradient's own ops in the user's graph (see the module notes).

    Args:
      ops: ops of one graph, in any order. Only function-calling ops are edited; one
        without a registered gradient (differentiated through SymbolicGradient, which
        does not edit the forward op) or without a trainable output is skipped.
    """
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
    """Edits the While op `op` as while_v2 `_WhileGrad(op, *zero output gradients)`
    does, without building the backward op: `_WhileGrad`'s statements up to its
    `_num_original_outputs` attribute (TF 2.21, while_v2.py), the backward body built by
    `_create_grad_func` and dropped. Returns False, editing nothing, where those helpers
    are missing (another TensorFlow) or no output takes a gradient: the caller then runs
    the whole gradient function.

    The backward body receives each output gradient as a placeholder of its dtype and
    shape (`func_graph_from_py_func`), so a floating output's zero gradient is a
    placeholder of S here (one op, not a capture and a `ZerosLike`)."""
    if not _tf.while_edit():
        return False
    while_op = op.outputs[0].op
    try:
        num_original_outputs = while_op.get_attr("_num_original_outputs")
    except ValueError:
        num_original_outputs = len(while_op.outputs)
    # `_WhileGrad` drops the gradients of the accumulator outputs (past the original
    # ones): none is made for them
    grads = [tf.compat.v1.placeholder(t.dtype, t.shape) if g is True else g
             for t, g in zip(op.outputs, _zero_output_gradients(
                 op, dense=False, count=num_original_outputs))]
    cond_graph = _tf.while_graph(while_op, "cond")
    body_graph = _tf.while_graph(while_op, "body")
    orig_num_params = len(body_graph.outputs)
    maximum_iterations = op.inputs[1]
    num_intermediates = len(while_op.outputs) - num_original_outputs
    grads = [_tf.preprocess_grad(grad, body_out, while_in, while_out)
             for grad, body_out, while_in, while_out in zip(
                 grads[:num_original_outputs], body_graph.outputs[:num_original_outputs],
                 while_op.inputs[:num_original_outputs],
                 while_op.outputs[:num_original_outputs])] + [None] * num_intermediates
    chosen = [(y, x, g) for y, x, g in zip(body_graph.outputs, body_graph.inputs, grads)
              if g is not None]
    if not chosen:
        return False
    ys, xs, non_none_grads = zip(*chosen)
    body_grad_graph, _ = _tf.create_grad_func(
        ys, xs, non_none_grads, cond_graph, body_graph,
        _tf.unique_grad_fn_name(body_graph.name), op, maximum_iterations)
    if body_grad_graph.while_op_needs_rewrite:
        cond_graph.name += "_rewritten"
        body_graph.name += "_rewritten"
        new_inputs = body_grad_graph.extra_inputs
        set_while_functions(while_op, _tf.create_new_tf_function(cond_graph),
                            _tf.create_new_tf_function(body_graph),
                            body_graph, new_inputs, orig_num_params)
    _tf.set_num_original_outputs(while_op)
    return True


def set_while_functions(while_op, cond_function, body_function, body_graph, new_inputs,
                        orig_num_params):
    """Gives `while_op` the rewritten cond and body functions of `_WhileGrad`'s edit and the
    inputs and outputs they add (`new_inputs`: the accumulators' initial values; the outputs
    are `body_graph`'s past the first `orig_num_params`), as while_v2's `_WhileGrad` does."""
    if len(body_graph.output_types) != len(while_op.inputs) + len(new_inputs):
        raise AssertionError(
            f"the edited While op {while_op.name!r} has {len(body_graph.output_types)} "
            f"output types for {len(while_op.inputs)} inputs and {len(new_inputs)} new "
            "ones, as TensorFlow's own While gradient would have found")
    _tf.edit_while_op(while_op, cond_function, body_function, body_graph, new_inputs,
                      orig_num_params)

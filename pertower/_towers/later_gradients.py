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
"""

from tensorflow.python.eager import backprop_util
from tensorflow.python.framework import func_graph as func_graph_lib
from tensorflow.python.framework import ops as ops_lib
from tensorflow.python.ops import control_flow_state
from tensorflow.python.ops import default_gradient

from pertower import _op_types as op_types

__all__ = ["prepare_for_later_gradients"]


def _zero_output_gradients(op):
    """The output gradients `tf.gradients` passes to op's gradient function when the
    cost reaches none of its outputs, made by TF's own rule (gradients_util.py
    `_GradientsHelper`): `control_flow_state.ZerosLike` for each trainable output that
    supports a default gradient, None for the others."""
    return [control_flow_state.ZerosLike(op, i)
            if backprop_util.IsTrainable(t) and default_gradient.supports_default_grad(t)
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
                   key=lambda op: op._id)  # pylint: disable=protected-access
    for op in calls:
        try:
            gradient_function = ops_lib.get_gradient_function(op)
        except LookupError:
            continue
        if gradient_function is None:
            continue
        with op.graph.as_default():
            scratch = func_graph_lib.FuncGraph(f"pertower_scratch_{op.name.replace('/', '_')}")
        with scratch.as_default():
            # S is never called: its ops (the zero gradients, the backward op) and its
            # captures of the op's outputs never enter the user's graph
            output_gradients = _zero_output_gradients(op)
            if any(g is not None for g in output_gradients):
                gradient_function(op, *output_gradients)

"""TensorFlow's private While machinery (while_v2, control_flow_util_v2, gradients_util),
by name: ways `loop_backward` (`_loops.backward`), `while_edit` (`_towers.later_gradients`)
and `loop_copy` (`_loops.copy`); their fallbacks are in `probe.WAYS`.
"""

import inspect

# pylint: disable=no-name-in-module,protected-access
from tensorflow.core.framework import attr_value_pb2
from tensorflow.python.eager import backprop_util as _backprop_util
from tensorflow.python.framework import func_graph as _func_graph
from tensorflow.python.framework import ops as _ops
from tensorflow.python.ops import control_flow_state as _control_flow_state
from tensorflow.python.ops import control_flow_util_v2 as _util_v2
from tensorflow.python.ops import default_gradient as _default_gradient
from tensorflow.python.ops import gradients_util as _gradients_util
from tensorflow.python.ops import while_v2 as _while_v2

from pertower._tf import probe

__all__ = ["loop_backward", "while_edit", "loop_copy", "while_gradient_function",
           "own_function_graph", "set_own_function_graph", "while_graph", "preprocess_grad",
           "create_grad_func", "body_grad_func_graph", "resolve_grad_captures",
           "build_while_op", "copy_handle_data", "structured_grad_output",
           "gradients_in_body", "indirect_captures", "edit_while_op",
           "set_num_original_outputs", "zeros_like_output", "takes_default_gradient",
           "unique_grad_fn_name", "create_new_tf_function",
           "read_function_graph", "clear_control_inputs", "cond_func_graph",
           "func_graph_from_py_func", "tensor_id", "while_loop"]

# what the `while_edit` way calls: while_v2's helpers and their parameters
_EDIT_HELPERS = {
    "_get_graph": ("while_op", "func_attr_name", "attr_graph_name"),
    "_preprocess_grad": ("grad", "body_graph_output", "while_op_input", "while_op_output"),
    "_create_grad_func": ("ys", "xs", "grads", "cond_graph", "body_graph", "name",
                          "while_op", "maximum_iterations"),
    "_copy_handle_data": ("src_tensors", "tgt_tensors"),
}
# and what the `loop_backward` way calls besides
_BACKWARD_HELPERS = {
    "_resolve_grad_captures": ("body_graph", "body_grad_graph", "while_op"),
    "_build_while_op": ("loop_vars", "cond_graph", "body_graph", "output_shapes",
                        "parallel_iterations", "name", "num_original_outputs"),
    "_get_structured_grad_output": ("outputs", "grads", "body_grad_graph"),
}
_BODY_GRAD_GRAPH = ("name", "forward_cond_graph", "forward_body_graph", "maximum_iterations",
                    "forward_while_op", "body_graph_inputs", "body_graph_outputs")
_BODY_GRAD_ATTRIBUTES = ("self.extra_inputs", "self.internal_capture_to_output",
                         "self._indirect_captures", "while_op_needs_rewrite")
_OP_EDITS = ("_set_func_attr", "_set_type_list_attr", "_set_shape_list_attr",
             "_add_while_inputs", "_add_outputs", "_set_attr")


def _helpers_reason(helpers):
    return probe.first_reason(*(probe.signature(_while_v2, name, *params)
                                for name, params in helpers.items()))


def _while_edit_reason():
    return probe.first_reason(
        None if callable(getattr(_while_v2, "_WhileGrad", None)) else "no while_v2._WhileGrad",
        _helpers_reason(_EDIT_HELPERS), probe.missing(_ops.Operation, *_OP_EDITS),
        probe.missing(_util_v2, "unique_grad_fn_name", "create_new_tf_function"),
        probe.missing(_control_flow_state, "ZerosLike"))


def _loop_backward_reason():
    grad_graph = getattr(_while_v2, "_WhileBodyGradFuncGraph", None)
    source = inspect.getsource(grad_graph) if grad_graph is not None else ""
    absent = [name.split(".")[-1] for name in _BODY_GRAD_ATTRIBUTES if name not in source]
    return probe.first_reason(
        _while_edit_reason(), _helpers_reason(_BACKWARD_HELPERS),
        probe.has_parameters(grad_graph, *_BODY_GRAD_GRAPH, label="_WhileBodyGradFuncGraph"),
        f"_WhileBodyGradFuncGraph no longer sets {absent}" if absent else None,
        probe.signature(_gradients_util, "_GradientsHelper", "ys", "xs",
                             "grad_ys"),
        probe.missing(_util_v2, "WhileCondFuncGraph", "get_func_graph",
                      "clear_control_inputs"),
        probe.signature(_func_graph, "func_graph_from_py_func", "name", "python_func", "args",
                        "kwargs", "signature", "func_graph"),
        probe.missing(_ops, "tensor_id"))


def loop_backward():
    """Whether the loop backward (`pertower._loops.backward`) may be built."""
    return probe.private_way("loop_backward")


def while_edit():
    """Whether `later_gradients` may edit a While op without building its backward."""
    return probe.private_way("while_edit")


def loop_copy():
    """Whether weights read in while loops and TF1 frames may be served by the loop
    copies (else they stay on pertower's fallback method)."""
    return probe.private_way("loop_copy")


def _loop_copy_reason():
    return probe.first_reason(
        probe.signature(_while_v2, "while_loop", "cond", "body",
                             "loop_vars", "shape_invariants"),
        probe.missing(_ops.Graph, "_get_function"))


probe.register("loop_backward", _loop_backward_reason)
probe.register("while_edit", _while_edit_reason)
probe.register("loop_copy", _loop_copy_reason)


def while_gradient_function():
    """TensorFlow's registered While gradient (while_v2 `_WhileGrad`), or None."""
    return getattr(_while_v2, "_WhileGrad", None)


# -- a While op's function graphs --------------------------------------------------------------

def own_function_graph(op, attr):
    """The FuncGraph while_v2 keeps on the While op `op` for `attr` ("body" or "cond"),
    or None (an op it did not build, or read from a GraphDef)."""
    return getattr(op, f"_{attr}_graph", None)


def set_own_function_graph(op, attr, graph):
    """Keeps `graph` on `op` as its `attr` graph (while_v2 reads it back)."""
    setattr(op, f"_{attr}_graph", graph)


def while_graph(op, attr):
    """The FuncGraph of the While op's function `attr`, kept on the op (while_v2
    `_get_graph`: read from the function and kept, where the op has none)."""
    return _while_v2._get_graph(op, attr, f"_{attr}_graph")


# A FuncGraph of the function `name` that `op` calls: get_func_graph(op, input_shapes, name)
read_function_graph = getattr(_util_v2, "get_func_graph", None)


# -- pieces of `_WhileGrad`, by name: None where this TensorFlow lacks one (the probes of the
# ways `loop_backward` and `while_edit` check each before either way is taken) -------------

# an output gradient as `_WhileGrad` passes it to the backward body
preprocess_grad = getattr(_while_v2, "_preprocess_grad", None)
# (the backward body graph, its arguments)
create_grad_func = getattr(_while_v2, "_create_grad_func", None)
# the FuncGraph of a backward body: it captures forward intermediates through accumulators
# (`extra_inputs`, `internal_capture_to_output`, `while_op_needs_rewrite`)
body_grad_func_graph = getattr(_while_v2, "_WhileBodyGradFuncGraph", None)
resolve_grad_captures = getattr(_while_v2, "_resolve_grad_captures", None)
# the outputs of a new While op on the FuncGraphs
build_while_op = getattr(_while_v2, "_build_while_op", None)
# copies the resource handle data of the tensors `sources` to `targets`
copy_handle_data = getattr(_while_v2, "_copy_handle_data", None)
# the gradients at the forward loop's inputs among a backward While's `outputs`
structured_grad_output = getattr(_while_v2, "_get_structured_grad_output", None)


def indirect_captures(graph):
    """{tensor_id of a forward body tensor: its value in the backward body graph}."""
    return graph._indirect_captures


def gradients_in_body(ys, xs, grad_ys, src_graph):
    """`tf.gradients` inside a backward body, differentiating `src_graph`'s ops
    (gradients_util `_GradientsHelper`, unconnected gradients zero)."""
    return _gradients_util._GradientsHelper(ys, xs, grad_ys=grad_ys, src_graph=src_graph,
                                            unconnected_gradients="zero")


def edit_while_op(while_op, cond_function, body_function, body_graph, new_inputs,
                  orig_num_params):
    """`_WhileGrad`'s edit of a forward While op: the rewritten functions, the types and
    shapes of `body_graph`'s outputs, the accumulator inputs `new_inputs` and the
    outputs past the first `orig_num_params`."""
    new_outputs = body_graph.outputs[orig_num_params:]
    while_op._set_func_attr("cond", cond_function)
    while_op._set_func_attr("body", body_function)
    while_op._set_type_list_attr("T", body_graph.output_types)
    while_op._set_shape_list_attr("output_shapes", body_graph.output_shapes)
    while_op._add_while_inputs(new_inputs)
    while_op._add_outputs([t.dtype for t in new_outputs], [t.shape for t in new_outputs])
    _while_v2._copy_handle_data(new_outputs, while_op.outputs[orig_num_params:])


def set_num_original_outputs(op):
    """Marks every current output of the While op as one a later gradient keeps."""
    op._set_attr("_num_original_outputs", attr_value_pb2.AttrValue(i=len(op.outputs)))


# -- what `tf.gradients` feeds an output the cost does not reach -------------------------------

def _zero_rule_reason():
    return probe.first_reason(
        probe.signature(_control_flow_state, "ZerosLike", "op", "index"),
        probe.signature(_backprop_util, "IsTrainable", "tensor_or_dtype"),
        probe.signature(_default_gradient, "supports_default_grad", "t"))


def zeros_like_output(op, index):
    """control_flow_state `ZerosLike(op, index)`: the zero gradient of an output."""
    probe.require("tf.gradients' zero rule", _zero_rule_reason)
    return _control_flow_state.ZerosLike(op, index)


def takes_default_gradient(tensor):
    """Whether `tf.gradients` feeds `tensor` a zero gradient where the cost does not reach
    it (backprop_util `IsTrainable` and default_gradient `supports_default_grad`)."""
    probe.require("tf.gradients' zero rule", _zero_rule_reason)
    return _backprop_util.IsTrainable(tensor) and _default_gradient.supports_default_grad(tensor)


# -- building functions (checked by the same probes) --------------------------------------

unique_grad_fn_name = getattr(_util_v2, "unique_grad_fn_name", None)
# adds a FuncGraph's function to its outer graph; returns its name
create_new_tf_function = getattr(_util_v2, "create_new_tf_function", None)
# a context without control dependencies or control-flow context
clear_control_inputs = getattr(_util_v2, "clear_control_inputs", None)
cond_func_graph = getattr(_util_v2, "WhileCondFuncGraph", None)
tensor_id = getattr(_ops, "tensor_id", None)


def func_graph_from_py_func(name, python_func, args, func_graph):
    return _func_graph.func_graph_from_py_func(name, python_func, args, {},
                                               func_graph=func_graph)


def while_loop(cond, body, loop_vars, name, shape_invariants=None):
    """A control-flow-v2 While loop (while_v2 `while_loop`, in any TF1 or TF2 graph),
    flat outputs."""
    probe.require("while_v2.while_loop", lambda: probe.signature(
        _while_v2, "while_loop", "cond", "body", "loop_vars"))
    return _while_v2.while_loop(cond, body, loop_vars, shape_invariants=shape_invariants,
                                return_same_structure=False, name=name)

"""TensorFlow's private graph, op and function API, by name, for the rest of pertower.

Each function reads or writes one private name (listed with its reason and fallback in
docs/tensorflow_upgrade.md). Where a public, slower way exists it is the fallback of a
way of `pertower._tf.probe` (`op_order`, `create_op`, `one_sided_gradients`,
`pfor`); the other names have no public replacement and are checked by
`probe.require` on first use, so a changed TensorFlow raises an error naming them.
"""

import contextlib
import operator
import weakref

import tensorflow as tf
# pylint: disable=no-name-in-module,protected-access
from tensorflow.python.autograph.core import ag_ctx as _ag_ctx
from tensorflow.python.autograph.impl import api as _autograph_api
from tensorflow.python.framework import func_graph as _func_graph
from tensorflow.python.framework import function_def_to_graph as _function_def_to_graph
from tensorflow.python.framework import op_def_registry as _op_def_registry
from tensorflow.python.framework import ops as _ops
from tensorflow.python.ops import ref_variable as _ref_variable
from tensorflow.python.ops import script_ops as _script_ops
from tensorflow.python.ops import variables as _variables
from tensorflow.python.ops.parallel_for import control_flow_ops as _pfor

from pertower._tf import probe

__all__ = ["FuncGraph", "RefVariable", "PartitionedVariable", "op_order_key",
           "control_flow_context", "graph_control_flow_context", "get_function",
           "function_graph", "called_function_graph", "built_function_graph", "function_def",
           "function_graph_def", "function_definition", "op_def", "create_op",
           "set_attr", "add_control_inputs", "handle_data", "registered_gradient",
           "gradient_function", "has_own_gradient_function", "set_gradient_function",
           "one_sided_gradients", "reregister_python_function", "ref_variable_tensor",
           "partitions", "handle_in_graph", "not_converted", "built_as_written",
           "set_chief_queue_runner", "onednn_enabled", "pfor", "keras_train_function"]

FuncGraph = _func_graph.FuncGraph
RefVariable = _ref_variable.RefVariable
PartitionedVariable = _variables.PartitionedVariable


# -- ops in creation order ----------------------------------------------------------------

_ID = operator.attrgetter("_id")
_positions = weakref.WeakKeyDictionary()   # graph -> (graph.version, {op name: position})


def _op_order_reason():
    if not isinstance(getattr(_ops.Operation, "_id", None), property):
        return "Operation._id is not a property"
    with tf.Graph().as_default():
        first, second = tf.constant(0), tf.constant(1)
    return None if _ID(first.op) < _ID(second.op) else "Operation._id is not creation order"


def _position(op):
    graph = op.graph
    entry = _positions.get(graph)
    if entry is None or entry[0] != graph.version:   # version: grows with each op added
        entry = (graph.version, {o.name: i for i, o in enumerate(graph.get_operations())})
        _positions[graph] = entry
    return entry[1][op.name]


def op_order_key():
    """The key that sorts ops of one graph by creation: `Operation._id`, else (way
    `op_order`) their position in `graph.get_operations()`."""
    return _ID if probe.private_way("op_order") else _position


# -- control-flow contexts and function libraries ------------------------------------------

def _an_op():
    """An op of a graph of its own (a probe reads its instance attributes)."""
    with tf.Graph().as_default():
        return tf.constant(0.0).op


def control_flow_context(op):
    """The TF1 control-flow context (while loop or cond) `op` was built in, or None."""
    probe.require("Operation._control_flow_context",
                  lambda: probe.missing(_an_op(), "_control_flow_context"))
    return op._control_flow_context


def graph_control_flow_context(graph):
    """The TF1 control-flow context ops built now in `graph` land in, or None."""
    probe.require("Graph._get_control_flow_context",
                  lambda: probe.missing(_ops.Graph, "_get_control_flow_context"))
    return graph._get_control_flow_context()


def get_function(graph, name):
    """The function `name` of `graph`'s library or of an outer graph's (a body read back
    from a function calls its callees from the outer library): an `AtomicFunction`, with
    `cached_definition`, or None."""
    probe.require("Graph._get_function", lambda: probe.signature(
        _ops.Graph, "_get_function", "name"))
    found = graph._get_function(name)
    outer = getattr(graph, "outer_graph", None)
    return found if found is not None or outer is None else get_function(outer, name)


def function_definition(graph, name):
    """The FunctionDef of the function `name` of `graph`'s library (its
    `cached_definition`, else its `definition`), or None when there is none."""
    function = get_function(graph, name)
    return None if function is None else (
        getattr(function, "cached_definition", None) or function.definition)


def function_graph(definition, input_shapes=None):
    """A `FuncGraph` of the FunctionDef `definition` (function_def_to_graph)."""
    probe.require("function_def_to_graph", lambda: probe.signature(
        _function_def_to_graph, "function_def_to_graph", "fdef",
        "structured_input_signature", "structured_outputs", "input_shapes"))
    return _function_def_to_graph.function_def_to_graph(definition, input_shapes=input_shapes)


def called_function_graph(op, attr, input_shapes=None):
    """The graph of the function that the attribute `attr` of `op` names (a call's "f",
    a While's "body" or "cond"), read from `op.graph`'s library (`function_graph`, with
    `input_shapes`); None when it cannot be read."""
    try:
        definition = get_function(op.graph, op.get_attr(attr).name).cached_definition
        return function_graph(definition, input_shapes=input_shapes)
    except (AttributeError, ValueError, TypeError, KeyError):
        return None


# Where cond_v2 and while_v2 keep on the op the FuncGraph each function was built from.
_BUILT_GRAPH_ATTRS = {"then_branch": "_true_graph", "else_branch": "_false_graph",
                      "body": "_body_graph", "cond": "_cond_graph"}


def built_function_graph(op, attr):
    """The FuncGraph the function `attr` of `op` was built from in Python (cond_v2's and
    while_v2's, kept on the op; a tf.function's, on its library entry): its shapes were
    inferred with the weights' shapes, which a graph read back from the library lacks.
    None when there is none (an op read from a GraphDef)."""
    if attr in _BUILT_GRAPH_ATTRS:
        return getattr(op, _BUILT_GRAPH_ATTRS[attr], None)
    try:
        return getattr(get_function(op.graph, op.get_attr(attr).name), "graph", None)
    except (AttributeError, ValueError, TypeError):
        return None


def function_def(name, graph):
    """The FunctionDef `name` of `graph`'s library (or of an outer graph's), or None."""
    probe.require("get_function_def", lambda: probe.signature(
        _function_def_to_graph, "get_function_def", "fname", "graph"))
    return _function_def_to_graph.get_function_def(name, graph)


def function_graph_def(definition, include_library_functions=False):
    """(GraphDef of the FunctionDef `definition`'s body, {argument or output name:
    tensor name in it}) (function_def_to_graph_def)."""
    probe.require("function_def_to_graph_def", lambda: probe.signature(
        _function_def_to_graph, "function_def_to_graph_def", "fdef",
        "input_shapes", "include_library_functions"))
    return _function_def_to_graph.function_def_to_graph_def(
        definition, include_library_functions=include_library_functions)


def op_def(op_type):
    """The registered OpDef of `op_type`, or None."""
    return _op_def_registry.get(op_type)


# -- creating and editing ops ----------------------------------------------------------------

def _create_op_reason():
    return probe.signature(_ops.Graph, "_create_op_internal", "op_type",
                                "inputs", "dtypes", "input_types", "name", "attrs", "op_def")


# pylint: disable-next=redefined-outer-name
def create_op(graph, op_type, inputs, dtypes, name=None, attrs=None, op_def=None):
    """A new op of `graph` from a NodeDef's parts (`Graph._create_op_internal`; way
    `create_op`, fallback the deprecated public `Graph.create_op`, which also infers
    shapes). Ops are created in the current control-dependency scope."""
    if probe.private_way("create_op"):
        return graph._create_op_internal(op_type, inputs, dtypes=dtypes, name=name,
                                         attrs=attrs, op_def=op_def)
    return graph.create_op(op_type, inputs, dtypes=dtypes, name=name, attrs=attrs,
                           op_def=op_def)


def set_attr(op, name, value):
    """Sets the attribute `name` of `op` to the AttrValue `value` (Operation._set_attr)."""
    probe.require("Operation._set_attr", lambda: probe.signature(
        _ops.Operation, "_set_attr", "attr_name", "attr_value"))
    op._set_attr(name, value)


def add_control_inputs(op, controls):
    """Adds the ops `controls` as control inputs of `op` (Operation._add_control_inputs)."""
    probe.require("Operation._add_control_inputs",
                  lambda: probe.missing(_ops.Operation, "_add_control_inputs"))
    op._add_control_inputs(list(controls))


def handle_data(tensor):
    """The resource handle data (dtype and shape of the value) `tensor` carries, or None."""
    return getattr(tensor, "_handle_data", None)


# -- gradient functions ---------------------------------------------------------------------

def registered_gradient(op_type):
    """The gradient function registered for `op_type` (tf.RegisterGradient's registry).

    Raises:
      LookupError: none is registered.
    """
    probe.require("gradient registry", lambda: probe.signature(
        getattr(_ops, "_gradient_registry", None), "lookup", "name"))
    return _ops._gradient_registry.lookup(op_type)


def gradient_function(op):
    """The gradient function `tf.gradients` calls for `op` (LookupError when none)."""
    probe.require("get_gradient_function", lambda: probe.signature(
        _ops, "get_gradient_function", "op"))
    return _ops.get_gradient_function(op)


def _one_sided_reason():
    if not hasattr(_an_op(), "_gradient_function"):
        return "Operation has no _gradient_function"
    return probe.signature(_ops, "get_gradient_function", "op")


def one_sided_gradients():
    """Whether an op's gradient function may be replaced while a backward is built
    (way `one_sided_gradients`; its fallback keeps every op's registered gradient)."""
    return probe.private_way("one_sided_gradients")


def has_own_gradient_function(op):
    """Whether `op` carries a gradient function of its own (set on the op, not
    registered), which `tf.gradients` calls in place of the registered one."""
    return getattr(op, "_gradient_function", None) is not None


def set_gradient_function(op, function):
    """Makes `tf.gradients` call `function` (None: the registered one again) for `op`;
    only where `one_sided_gradients()`."""
    op._gradient_function = function


# -- Python functions, variables ------------------------------------------------------------

def reregister_python_function(token, graph):
    """A new token for the Python function registered under `token` (tf.py_function's
    registry), the function kept alive by `graph` as tf.py_function keeps it; None when
    `token` names none."""
    probe.require("script_ops._py_funcs", lambda: probe.first_reason(
        probe.missing(_script_ops, "_py_funcs"),
        probe.missing(getattr(_script_ops, "_py_funcs", None), "get", "insert")))
    func = _script_ops._py_funcs.get(token)
    if func is None:
        return None
    if not hasattr(graph, "_py_funcs_used_in_graph"):
        graph._py_funcs_used_in_graph = []
    graph._py_funcs_used_in_graph.append(func)
    return _script_ops._py_funcs.insert(func)


def ref_variable_tensor(variable):
    """The ref tensor a TF1 reference variable's readers consume."""
    probe.require("RefVariable._variable", lambda: probe.missing(variable, "_variable"))
    return variable._variable


def partitions(variable):
    """The number of parts of a PartitionedVariable along each axis."""
    probe.require("PartitionedVariable._get_partitions",
                  lambda: probe.missing(PartitionedVariable, "_get_partitions"))
    return list(variable._get_partitions())


def handle_in_graph(handle, graph):
    """The tensor standing for the resource `handle` in `graph`: the handle itself when it
    is a tensor of `graph`; inside a `tf.function` (a FuncGraph) the placeholder that
    captures it (an eager variable's handle, or an outer graph's, through each enclosing
    function); None when `graph` does not capture it."""
    if not isinstance(handle, tf.Tensor) or getattr(handle, "graph", None) is graph:
        return handle
    if not isinstance(graph, FuncGraph):
        return None
    # FuncGraph.captures: the (outer tensor, placeholder) pairs of its by-value captures
    captured = {id(external): inner for external, inner in graph.captures}
    if id(handle) in captured:
        return captured[id(handle)]
    outer = handle_in_graph(handle, graph.outer_graph)
    return None if outer is None else captured.get(id(outer))


def not_converted(function):
    """`function`, marked so that AutoGraph calls it as it is inside a `tf.function`
    (half of `tf.autograph.experimental.do_not_convert`, without its frame: warnings'
    stack levels stay the caller's)."""
    probe.require("autograph.impl.api.autograph_artifact",
                  lambda: probe.missing(_autograph_api, "autograph_artifact"))
    return _autograph_api.autograph_artifact(function)


@contextlib.contextmanager
def built_as_written():
    """Inside a `tf.function` (a FuncGraph), runs the body as pertower's graph code is
    written: AutoGraph off (the other half of `do_not_convert`: `tf.while_loop` and
    `tf.map_fn` bodies are not converted) and, with TF2's tensor equality on, TF1's
    (tensors hashable and `==` by identity, `tf.compat.v1.disable_tensor_equality`),
    restored after. Elsewhere nothing."""
    if not tf.compat.v1.get_default_graph().building_function:
        yield
        return
    tensor_class = tf.Tensor
    probe.require("Tensor._USE_EQUALITY", lambda: probe.missing(tensor_class, "_USE_EQUALITY"))
    probe.require("autograph.core.ag_ctx.ControlStatusCtx",
                  lambda: probe.missing(_ag_ctx, "ControlStatusCtx", "Status"))
    was_on = tensor_class._USE_EQUALITY
    with _ag_ctx.ControlStatusCtx(status=_ag_ctx.Status.DISABLED):
        if was_on:
            tf.compat.v1.disable_tensor_equality()
        try:
            yield
        finally:
            if was_on:
                tf.compat.v1.enable_tensor_equality()


def set_chief_queue_runner(sync_optimizer, runner):
    """Replaces the chief queue runner a SyncReplicasOptimizer's `apply_gradients` made."""
    probe.require("SyncReplicasOptimizer._chief_queue_runner", lambda: None if hasattr(
        sync_optimizer, "_chief_queue_runner") else "it has no _chief_queue_runner")
    sync_optimizer._chief_queue_runner = runner


def keras_train_function(model):
    """tf_keras' v1 (graph-mode) `model.train_function`, built now when `fit` builds it
    only at its first batch (a Sequence or generator): `Model._make_train_function`,
    which returns at once when it is built."""
    probe.require("tf_keras Model._make_train_function", lambda: None if hasattr(
        model, "_make_train_function") else "the model has no _make_train_function")
    model._make_train_function()
    return model.train_function


def onednn_enabled():
    """Whether this process's TensorFlow runs its oneDNN CPU kernels (util_port
    `IsMklEnabled`); None when it does not say."""
    try:
        # pylint: disable-next=import-outside-toplevel
        from tensorflow.python.util import _pywrap_util_port
        return bool(_pywrap_util_port.IsMklEnabled())
    except (ImportError, AttributeError):
        return None


# -- public ops with a private shortcut --------------------------------------------------------

def pfor(loop_fn, iters, fallback_to_while_loop=True):
    """[iters, ...] stacked `loop_fn(i)` for i in range(iters), vectorized
    (parallel_for's `pfor`; way `pfor`, fallback `tf.vectorized_map` over tf.range)."""
    if probe.private_way("pfor"):
        return _pfor.pfor(loop_fn, iters, fallback_to_while_loop=fallback_to_while_loop)
    return tf.vectorized_map(loop_fn, tf.range(iters),
                             fallback_to_while_loop=fallback_to_while_loop, warn=False)


probe.register("op_order", _op_order_reason)
probe.register("create_op", _create_op_reason)
probe.register("one_sided_gradients", _one_sided_reason)
probe.register("pfor", lambda: probe.signature(
    _pfor, "pfor", "loop_fn", "iters", "fallback_to_while_loop"))

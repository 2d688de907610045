"""Weights read inside functional control flow: hand the towers' copies to the bodies.

Notation:
    x    one weight (a resource variable)   c_t  tower t's copy of x, a value [*x.shape]
    op   a function-calling op (While, If, PartitionedCall, ...) that receives x's
         resource handle as input i and reads it inside its function bodies

A tower's replay of op reads c_t: input i becomes c_t (a value instead of a handle);
every function op calls is copied into a new FunctionDef in which argument i is a value
of x's dtype and every `ReadVariableOp` of it an `Identity` (`ResourceGather` ->
`GatherV2`, `ResourceGatherNd` -> `GatherNd`), recursively through nested calls. When a
body only *reads* x (a write is refused), reading x inside gives the value passed in, and
TensorFlow's While/If gradients treat c_t as a loop-invariant input. A function call
becomes an `If` on a constant True whose branches are copies of the function, which
cond_v2 differentiates with every op's registered Python gradient (the
`SymbolicGradient` of an imported call knows only C++ gradients).

Every tower gets its own copy of every function its call ops reach (`<name>_<build>_t<t>`),
since the While/If gradients edit the forward op and name the edited functions after the
originals. XLA-compiled calls (`_XlaMustCompile`) share one copy, with the gradient of
`pertower._towers.compiled`.
"""

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2
from tensorflow.core.framework import function_pb2
from tensorflow.core.framework import types_pb2

from pertower import _context
from pertower import _op_types as op_types
from pertower import _tf
from pertower._towers import compiled

__all__ = ["ControlFlowError", "FunctionRewriter", "gather_from_value"]

# Per function-calling op type (`op_types.CALL_OP_TYPES`): (attributes naming the called
# functions, offset of the functions' arguments in the op's inputs, attribute listing
# the input types, whether the op passes its inputs through to its outputs as loop
# variables).
_CALLS = {
    **{t: (("cond", "body"), 0, "T", True) for t in op_types.WHILE_OP_TYPES},
    **{t: (("then_branch", "else_branch"), 1, "Tin", False) for t in op_types.IF_OP_TYPES},
    **{t: (("f",), 0, "Tin", False) for t in op_types.FUNCTION_CALL_OP_TYPES},
}


class ControlFlowError(NotImplementedError):
    """A weight is used inside a function in a way the rewrite cannot reproduce."""


class FunctionRewriter:
    """Rewrites function-calling NodeDefs so that weight handles become weight values;
    one per build (`token` makes the names unique), `library` the new FunctionDefs."""

    def __init__(self, graph, token):
        self.graph = graph
        self.token = token
        self.library = function_pb2.FunctionDefLibrary()
        self._names = {}       # (function, ((arg, dtype), ...), tower, variant) -> new name
        self._generated = {}   # new function name -> FunctionDef

    def rewrite_call(self, node, positions, where, tower, predicate):
        """Edits `node`, a call op's NodeDef, in place so that its inputs `positions`,
        {op input index: (DataType enum, TensorShape)} (maybe none: the functions are
        still copied), take values; `where` describes the weight and op for errors,
        `tower` is part of the new function names, `predicate()` the input reference of
        a boolean True (for a call turned into an If). Returns {output index: (DataType
        enum, TensorShape)} of the outputs that now carry the value (loop variables).
        """
        if node.op not in _CALLS:
            raise _context.error(ControlFlowError, (
                f"{where} reaches op {node.name!r} of type {node.op}, which towers cannot "
                f"give a weight copy to. Supported: {', '.join(sorted(_CALLS))}. Leave "
                "this weight out of `xs`."))
        function_attrs, offset, type_attr, loops = _CALLS[node.op]
        for i, (dtype, _) in positions.items():
            if i < offset or node.attr[type_attr].list.type[i - offset] != types_pb2.DT_RESOURCE:
                raise _context.error(ControlFlowError, f"{where}: input {i} of op "
                                     f"{node.name!r} ({node.op}) is not a resource "
                                     "argument of its functions.")
            node.attr[type_attr].list.type[i - offset] = dtype
        arguments = {i - offset: spec for i, spec in positions.items()}
        if (node.op in op_types.FUNCTION_CALL_OP_TYPES and compiled.XLA_ATTR in node.attr
                and node.attr[compiled.XLA_ATTR].b):   # compiled by XLA
            # one copy for all towers, none where no argument becomes a value: the
            # compiled calls' gradient edits neither the forward op nor its function
            if arguments:
                node.attr["f"].func.name = self._rewrite_function(
                    node.attr["f"].func.name, arguments, False, f"{where}, op {node.name!r}",
                    compiled.SHARED)
            _drop_stale_attrs(node, positions)
            node.attr["_gradient_op_type"].s = compiled.GRADIENT_OP_TYPE.encode()
            return {}
        for attr in function_attrs:
            old = node.attr[attr].func.name
            node.attr[attr].func.name = self._rewrite_function(
                old, arguments, loops and attr == "body", f"{where}, op {node.name!r}", tower)
        if node.op in op_types.FUNCTION_CALL_OP_TYPES:
            # a second copy of the function as the else branch, so that cond_v2's
            # rewrite of the two branches cannot give two functions one name
            else_branch = self._rewrite_function(old, arguments, False, where, tower, "_else")
            _call_to_if(node, else_branch, predicate)
            return {}
        _drop_stale_attrs(node, positions)
        if not loops:
            return {}
        for i, (_, shape) in positions.items():
            node.attr["output_shapes"].list.shape[i].CopyFrom(shape.as_proto())
        return dict(positions)

    def _definition(self, name):
        if name in self._generated:
            return self._generated[name]
        definition = _tf.function_definition(self.graph, name)
        if definition is None:
            raise _context.error(ControlFlowError, f"the function {name!r} is not in the "
                                 "graph's library, so towers cannot rewrite it.")
        return definition

    def _rewrite_function(self, name, arguments, loop_body, where, tower, variant=""):
        """The name of tower `tower`'s copy (`variant` tells copies apart) of the
        function `name`, with `arguments` {index: (dtype, shape)} turned into values."""
        key = (name, tuple(sorted((i, dtype) for i, (dtype, _) in arguments.items())), tower,
               variant)
        if key in self._names:
            return self._names[key]
        new_name = f"{name}_{self.token}_t{tower}{variant}"
        if arguments:
            new_name += "_a" + "_".join(str(i) for i in sorted(arguments))
        self._names[key] = new_name
        fdef = function_pb2.FunctionDef()
        fdef.CopyFrom(self._definition(name))
        fdef.signature.name = new_name
        where = f"{where}, function {name!r}"
        values = {}  # function-level tensor name -> (dtype, shape) of the weight value
        for i, (dtype, shape) in arguments.items():
            arg = fdef.signature.input_arg[i]
            if arg.type != types_pb2.DT_RESOURCE:
                raise _context.error(ControlFlowError,
                                     f"{where}: argument {arg.name!r} is not a resource.")
            arg.type = dtype
            # a signature read back from a meta graph keeps the handle's variable shape,
            # which TensorFlow would set on the value ("Shapes must be equal rank")
            del arg.handle_data[:]
            values[arg.name] = (dtype, shape)
            if i in fdef.arg_attr:
                attrs = fdef.arg_attr[i].attr
                for attr in ("_handle_dtypes", "_handle_shapes"):
                    if attr in attrs:
                        del attrs[attr]
                if "_output_shapes" in attrs:
                    del attrs["_output_shapes"].list.shape[:]
                    attrs["_output_shapes"].list.shape.add().CopyFrom(shape.as_proto())
            if i in fdef.resource_arg_unique_id:
                del fdef.resource_arg_unique_id[i]
        renames = {}  # output reference -> new reference (ReadVariableOp:value -> Identity:output)
        done, extra_nodes = set(), []
        progress = True
        while progress:  # FunctionDef nodes are not sorted; propagate to a fixed point
            progress = False
            for node in fdef.node_def:
                if node.name in done:
                    continue
                hits = {j: values[ref] for j, ref in enumerate(node.input)
                        if not ref.startswith("^") and ref in values}
                if not hits:
                    continue
                done.add(node.name)
                progress = True
                self._rewrite_node(node, hits, values, renames, extra_nodes, where, tower)
        for node in fdef.node_def:  # nested calls that read no weight: copy for the tower
            if node.name not in done and node.op in _CALLS:
                self.rewrite_call(node, {}, where, tower,
                                  lambda: _const_node(node.name, True, extra_nodes))
        fdef.node_def.extend(extra_nodes)
        for node in fdef.node_def:
            inputs = [renames.get(ref, ref) for ref in node.input]
            del node.input[:]
            node.input.extend(inputs)
        for out in fdef.signature.output_arg:
            ref = fdef.ret[out.name]
            if ref in values and out.type == types_pb2.DT_RESOURCE:
                if not loop_body:
                    raise _context.error(ControlFlowError, (
                        f"{where} returns the weight's handle as output {out.name!r}; "
                        "towers can only rewrite functions that read the weight. Leave "
                        "this weight out of `xs`."))
                out.type = values[ref][0]
                del out.handle_data[:]
            fdef.ret[out.name] = renames.get(ref, ref)
        if loop_body:  # a loop variable must come back as it went in
            for i in arguments:
                out = fdef.signature.output_arg[i]
                if out.type == types_pb2.DT_RESOURCE:
                    raise _context.error(ControlFlowError, (
                        f"{where}: the while loop body returns another resource than the "
                        f"weight as loop variable {i}; towers cannot rewrite it. Leave "
                        "this weight out of `xs`."))
        self._generated[new_name] = fdef
        self.library.function.add().CopyFrom(fdef)
        return new_name

    def _rewrite_node(self, node, hits, values, renames, extra_nodes, where, tower):
        """Rewrites one function node that consumes weight values at inputs `hits`."""
        dtype, shape = next(iter(hits.values()))  # one weight, except for call ops
        if node.op in op_types.VARIABLE_READ_OP_TYPES:
            node.op = "Identity"
            del node.attr["dtype"]
            node.attr["T"].type = dtype
            renames[f"{node.name}:value:0"] = f"{node.name}:output:0"
        elif node.op in op_types.HANDLE_GATHER_OP_TYPES and list(hits) == [0]:
            gather_from_value(node, dtype, lambda: _const_node(node.name, 0, extra_nodes))
        elif node.op == "Identity":
            node.attr["T"].type = dtype
            values[f"{node.name}:output:0"] = (dtype, shape)
        elif node.op in _CALLS:
            outputs = self.rewrite_call(node, hits, where, tower,
                                        lambda: _const_node(node.name, True, extra_nodes))
            for i, spec in outputs.items():
                values[f"{node.name}:output:{i}"] = spec
        else:
            raise _context.error(ControlFlowError, (
                f"{where} passes the weight to op {node.name!r} of type {node.op}; towers "
                "can only give their weight copies to ReadVariableOp, ResourceGather, "
                "Identity and nested While/If/function calls inside a function body (a "
                "body that writes or otherwise uses the variable cannot be replayed on a "
                "copy). Leave this weight out of `xs`."))


def _drop_stale_attrs(node, positions):
    """Removes from a call's NodeDef what no longer holds once its inputs `positions`
    carry values (`_read_only_resource_inputs` entries, the gradient override)."""
    if "_read_only_resource_inputs" in node.attr:
        kept = [i for i in node.attr["_read_only_resource_inputs"].list.i
                if i not in positions]
        del node.attr["_read_only_resource_inputs"].list.i[:]
        node.attr["_read_only_resource_inputs"].list.i.extend(kept)
    if op_types.GRADIENT_OVERRIDE_ATTR in node.attr:
        del node.attr[op_types.GRADIENT_OVERRIDE_ATTR]


def _call_to_if(node, else_branch, predicate):
    """Turns a function-call NodeDef (its function `f` already rewritten) into
    If(True, f, else_branch)."""
    stateful = node.op == "StatefulPartitionedCall"
    then_branch = node.attr["f"].func.name
    kept = {}  # the input and output types carry over
    for name in ("Tin", "Tout"):
        kept[name] = attr_value_pb2.AttrValue()
        kept[name].CopyFrom(node.attr[name])
    for attr in list(node.attr):
        del node.attr[attr]
    node.op = "If" if stateful else "StatelessIf"
    node.attr["Tcond"].type = types_pb2.DT_BOOL
    for name, value in kept.items():
        node.attr[name].CopyFrom(value)
    node.attr["then_branch"].func.name = then_branch
    node.attr["else_branch"].func.name = else_branch
    node.attr["output_shapes"].list.SetInParent()
    node.attr["_lower_using_switch_merge"].b = True
    node.input.insert(0, predicate())


def _const_node(name, value, extra_nodes):
    """Adds a Const `value` (True or int32 0) node to `extra_nodes`; its reference."""
    dtype = tf.bool if isinstance(value, bool) else tf.int32
    node = tf.compat.v1.NodeDef()
    node.name = f"{name}/pertower_{'true' if value is True else 'axis'}"
    node.op = "Const"
    node.attr["dtype"].type = dtype.as_datatype_enum
    node.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(value, dtype=dtype))
    extra_nodes.append(node)
    return f"{node.name}:output:0"


def gather_from_value(node, dtype, axis_input):
    """Rewrites a ResourceGather(handle, indices) or ResourceGatherNd NodeDef in place
    into GatherV2(value, indices, axis 0) or GatherNd(value, indices), for the replay
    and for function bodies; the caller makes input 0 name the weight value. `dtype`:
    the value's DataType enum; `axis_input()`: the input reference of an int32 0."""
    indices_type = node.attr["Tindices"].type
    batch_dims = node.attr["batch_dims"].i if "batch_dims" in node.attr else 0
    for attr in list(node.attr):
        if not attr.startswith("_"):
            del node.attr[attr]
    node.attr["Tparams"].type = dtype
    node.attr["Tindices"].type = indices_type
    if node.op == "ResourceGather":
        node.op = "GatherV2"
        node.attr["Taxis"].type = types_pb2.DT_INT32
        node.attr["batch_dims"].i = batch_dims
        node.input.insert(2, axis_input())
    else:
        node.op = "GatherNd"

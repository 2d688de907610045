"""XLA-compiled function calls in the towers: replayed compiled, differentiated compiled.

Notation:
    op    a function call (`PartitionedCall`, `StatefulPartitionedCall`) with the node
          attribute `_XlaMustCompile` = True, e.g. from `tf.function(jit_compile=True)`
    f     the function op calls (in the towers: one copy shared by all towers)
    u     op's inputs [u_0, ..., u_{n-1}]    v = f(u) its outputs    dv  their gradients

Some computations exist only under XLA (Keras `Conv2D(groups=2)` has no CPU kernel
without oneDNN), so a tower replays op as the same compiled call, not as the `If` other
calls become (`pertower._towers.functions`). TensorFlow's own gradient of op is attached
to the user's op (an imported copy lacks it) and rewrites the forward op; the copy gets
instead the gradient registered here (`GRADIENT_OP_TYPE`, via `_gradient_op_type`): one
more compiled call, of a function that recomputes v = f(u) and returns tf.gradients(v,
u, dv) (the chain rule, recomputed rather than stored: a body that draws random numbers
is refused). The backward call carries the same gradient, so it can be differentiated
again; one backward function serves every tower of a build, compiled once.
"""

import weakref

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

from pertower import _context
from pertower import _graph_walk as graph_walk
from pertower import _tf
from pertower._towers import replicate

__all__ = ["GRADIENT_OP_TYPE", "XLA_ATTR", "SHARED", "CompiledCallError"]

# The node attribute that makes TensorFlow compile a function call with XLA.
XLA_ATTR = "_XlaMustCompile"
# The name of the gradient registered below, set as a call's `_gradient_op_type`.
GRADIENT_OP_TYPE = "PertowerCompiledCall"
# The tower label of the one copy of a compiled call's function that all towers share.
SHARED = "all"


class CompiledCallError(NotImplementedError):
    """A compiled call's gradient cannot be built."""


def _differentiable(dtype):
    return dtype.is_floating or dtype.is_complex


def _body(graph, name):
    """(GraphDef of the function `name`'s body without its argument placeholders,
    argument names, output tensor names in the GraphDef)."""
    fdef = _tf.function_def(name, graph)
    if fdef is None:
        raise CompiledCallError(f"the function {name!r} is not in the graph's library")
    with graph.as_default():   # nested functions are looked up in the default graph
        body, flat = _tf.function_graph_def(
            fdef, include_library_functions=True)
    arguments = [arg.name for arg in fdef.signature.input_arg]
    placeholders = set(arguments)
    kept = [node for node in body.node if node.name not in placeholders]
    del body.node[:]
    body.node.extend(kept)
    for node in body.node:   # arguments are there when the body starts: no control edge
        replicate.drop_name_attrs(node)   # colocations with nodes outside the body
        inputs = [ref for ref in node.input
                  if not (ref.startswith("^") and ref[1:] in placeholders)]
        del node.input[:]
        node.input.extend(inputs)
    returns = [flat[fdef.ret[arg.name]] for arg in fdef.signature.output_arg]
    return body, arguments, returns


# The backward functions built so far, {graph: {(f, wrt, outs, input and output-gradient
# specs): backward function name}}: names only, graphs as weak keys.
_BACKWARDS = weakref.WeakKeyDictionary()


def _backward_function(op, wrt, outs, dv):
    """The name of the backward function of call `op` (added to op's graph on first
    use): inputs u then dv, outputs d/du_i for i in `wrt`."""
    forward = op.get_attr("f").name
    specs = [tf.TensorSpec(t.shape, t.dtype) for t in list(op.inputs) + dv]
    key = (forward, tuple(wrt), tuple(outs), tuple(specs))
    names = _BACKWARDS.setdefault(op.graph, {})
    if key in names:
        return names[key]
    try:
        body, arguments, returns = _body(op.graph, forward)
    except (CompiledCallError, ValueError) as error:
        raise _refusal(op, str(error)) from error
    # the random op types drawn in the body (its nodes and its library's functions)
    nodes = list(body.node) + [n for f in body.library.function for n in f.node_def]
    random = sorted({node.op for node in nodes if graph_walk.draws_random_numbers(node.op)})
    if random:
        raise _refusal(op, f"it draws random numbers ({', '.join(random)}), and the "
                           "gradient, which runs the call again, would draw others")
    n = len(op.inputs)

    def backward(*args):
        u, grad_v = args[:n], args[n:]
        v = tf.graph_util.import_graph_def(
            body, input_map={f"{a}:0": t for a, t in zip(arguments, u)},
            return_elements=[returns[j] for j in outs], name="forward")
        grads = tf.gradients(v, [u[i] for i in wrt], grad_ys=list(grad_v))
        return [tf.zeros_like(u[i]) if g is None else tf.convert_to_tensor(g)
                for g, i in zip(grads, wrt)]

    backward.__name__ = f"{forward}_pertower_gradient"
    try:
        # traced apart from the gradient's colocation with the forward call, which
        # would name an op outside the function
        with op.graph.colocate_with(None, ignore_existing=True):
            concrete = tf.function(backward, jit_compile=True, autograph=False,
                                   reduce_retracing=False).get_concrete_function(*specs)
    except LookupError as error:   # an op of the body without a gradient
        raise _refusal(op, str(error)) from error
    concrete.add_to_graph(op.graph)
    names[key] = concrete.name
    return concrete.name


def _refusal(op, why):
    return _context.error(
        CompiledCallError,
        f"the towers cannot differentiate the XLA-compiled "
        f"function call {op.name!r} ({op.type}): {why}. Leave the weights it reads out of "
        "`xs`, or compute them with method='rules' where a rule covers them "
        "(pertower.explain shows the plan).")


@tf.RegisterGradient(GRADIENT_OP_TYPE)
def _compiled_call_gradient(op, *dv):
    """d/du of a compiled call: a compiled call that recomputes f(u) and differentiates
    it (see the module docstring). Inputs that are not floating (or complex) get None."""
    n = len(op.inputs)
    wrt = [i for i, u in enumerate(op.inputs) if _differentiable(u.dtype)]
    outs = [j for j, v in enumerate(op.outputs) if _differentiable(v.dtype)]
    if not wrt or not outs:
        return [None] * n
    dv = [tf.zeros_like(op.outputs[j]) if dv[j] is None else tf.convert_to_tensor(dv[j])
          for j in outs]
    name = _backward_function(op, wrt, outs, dv)
    call = tf.raw_ops.StatefulPartitionedCall if op.type == "StatefulPartitionedCall" else (
        tf.raw_ops.PartitionedCall)
    grads = call(args=list(op.inputs) + dv, Tout=[op.inputs[i].dtype for i in wrt], f=name)
    backward_op = grads[0].op
    # compiled like the forward call, and differentiated (a second derivative) the same way
    _tf.set_attr(backward_op, XLA_ATTR, attr_value_pb2.AttrValue(b=True))
    _tf.set_attr(backward_op, "_gradient_op_type",
                 attr_value_pb2.AttrValue(s=GRADIENT_OP_TYPE.encode()))
    by_input = dict(zip(wrt, grads))
    return [by_input.get(i) for i in range(n)]

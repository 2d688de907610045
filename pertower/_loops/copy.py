"""The copy of a while loop that `pertower.rules._loops` plans: ε in, A_t out (where
`pertower.rules._loop_backward` cannot build the loop's own backward with dZ_t and A_t).

Notation (as in `_loops`):
    T   iterations the loop ran        k   rows per example of one step's A and Z
    ε   zeros [T, B*k, *z] added to a covered op's output Z_t at step t

`BuiltCopy` builds, with `while_v2`, a new loop over the loop variables the outputs
need, a step counter, one TensorList of A_t per covered read (pushed at each step)
and one of ε per covered read (reversed, popped at each step); its body imports the original
body's GraphDef (only the ops those outputs need) with each covered op's output
replaced by output + ε[t]. The user's loop computes what it computed (it gets only
the edit any `tf.gradients` through it makes, `pertower._towers.later_gradients`). Its
backward pass, `tf.gradients(copy outputs, ε, grad_ys=dL/dOut)`, gives every step's
dZ_t; the steps are laid out example-major ([T, B*k, ...] -> [B*k*T, ...]) for the
op's rule. `Slice` and `Placed` put a rule's result for one slice of a weight (an
`Unpack` of it, as Keras' GRU reads its [2, 3u] bias) into the weight's shape.
"""

import tensorflow as tf

from pertower import _tf
from pertower._tf import list_ops
from pertower._towers import later_gradients
from pertower.rules import registry as registry_lib

__all__ = ["BuiltCopy", "Placed", "Slice", "differentiated_before", "eps_gradients",
           "example_major", "graph_upstream", "stacked_uses"]


class BuiltCopy:
    """The loop's copy with ε inputs and A outputs; the concrete uses of its reads."""

    def __init__(self, loop):
        self.loop = loop
        op, body, request = loop.op, loop.body, loop.loops.request
        # the user's loop is only read here; edit it now as a tf.gradients through it
        # would, so that a training op built after the first run works (as the towers do)
        if not differentiated_before(op):
            later_gradients.prepare_for_later_gradients([op])
        steps = op.outputs[0]                                            # T
        B = (request.batch_size if request.batch_size is not None else
             tf.shape(request.batch[0])[request.batch_axes[0]])
        needed = loop.needed
        eps, eps_lists, a_lists, a_shapes = [], [], [], []
        for (target, _), use, k in zip(loop.targets, loop.uses, loop.step_rows):
            z, a = target.outputs[0], use.activation
            rest = z.shape.as_list()[1:]
            shape = tf.stack([steps, B * k] + rest)
            zeros = tf.zeros(shape, z.dtype)                             # ε [T, B*k, *z]
            eps.append(zeros)
            # step t pops ε[t] off the back of the reversed list (a pop's gradient is
            # one push; a read at an index needs the list's shape and length per step)
            eps_lists.append(list_ops.tensor_list_from_tensor(tf.reverse(zeros, [0]),
                                                              [-1] + rest))
            a_shape = [-1 if d is None else d for d in a.shape.as_list()[1:]]
            a_shapes.append([-1] + a_shape)
            a_lists.append(list_ops.empty_tensor_list([-1] + a_shape, a.dtype))
        J = len(loop.targets)
        body_def = _subgraph(body, [body.outputs[i] for i in needed]
                             + [u.activation for u in loop.uses])
        body_def = _perturbed(body_def, [t.name for t, _ in loop.targets])
        # a variable the body receives unchanged at every step (no op of the copy writes
        # one) is read once, before the loop: a read inside the body is a per-step
        # intermediate, which the copy's backward would accumulate at every step
        invariant = {body.inputs[i].name: op.inputs[i] for i in needed
                     if body.inputs[i].dtype == tf.resource and body.outputs[i] is body.inputs[i]}
        body_def, reads = _hoisted_reads(body_def, invariant)
        cond_def = _subgraph(loop.cond, loop.cond.outputs)
        # such a variable no op of the copy reads any more is not carried through it
        unread = _unread(body_def, [body.inputs[i].name for i in needed
                                    if body.inputs[i].name in invariant])
        needed = [i for i in needed if body.inputs[i].name not in unread
                  or _consumes(cond_def, loop.cond.inputs[i].name)]
        body_def = _without(body_def, {body.inputs[i].name for i in needed}, unread)
        n = len(needed)
        inner_names = [body.inputs[i].name for i in needed]
        cond_names = [loop.cond.inputs[i].name for i in needed]

        def cond(*values):
            mapping = _present(cond_def, dict(zip(cond_names, values[:n])))
            return tf.graph_util.import_graph_def(
                cond_def, input_map=mapping, return_elements=[loop.cond.outputs[0].name],
                name="cond")[0]

        def step(*values):
            s = values[n]
            mapping = dict(zip(inner_names, values[:n]))
            body_graph = tf.compat.v1.get_default_graph()   # the copy's body (a FuncGraph)
            mapping.update((name, body_graph.capture(read)) for name, read in reads.items())
            popped = []
            for j in range(J):
                z = loop.targets[j][0].outputs[0]
                rest_list, mapping[f"{_EPS_PREFIX}{j}:0"] = list_ops.tensor_list_pop_back(
                    values[n + 1 + J + j], element_shape=[-1] + z.shape.as_list()[1:],
                    element_dtype=z.dtype)
                popped.append(rest_list)
            returned = tf.graph_util.import_graph_def(
                body_def, input_map=_present(body_def, mapping),
                return_elements=([body.outputs[i].name for i in needed]
                                 + [u.activation.name for u in loop.uses]), name="body")
            outs, activations = list(returned[:n]), returned[n:]
            written = [list_ops.tensor_list_push_back(values[n + 1 + j], activations[j])
                       for j in range(J)]
            return outs + [s + 1] + written + popped

        loop_vars = ([op.inputs[i] for i in needed] + [tf.constant(0, tf.int32)]
                     + a_lists + eps_lists)
        results = _tf.while_loop(cond, step, loop_vars, name="copy")
        self.outputs = {needed[i]: results[i] for i in range(n)}
        self.eps = eps
        self.uses = stacked_uses(loop.uses, results[n + 1:], a_shapes, eps)

    def output_gradients(self, d_outputs, unconnected, others=(), stops=()):
        """({id(ε_j): dZ_all_j, [B*k*T, *z]}, [gradient at each of `others`, or None])
        from one backward pass of the copy, given the gradients `d_outputs` at
        `loop.reached_outputs` (None where unconnected), stopping at `stops`."""
        copied = [self.outputs[original.value_index] for original in self.loop.reached_outputs]
        return eps_gradients(copied, d_outputs, self.eps, unconnected, others, stops)


def differentiated_before(op):
    """Whether a gradient through the While op `op` has already edited it: TensorFlow's
    While gradient (while_v2.py `_WhileGrad`) renames the body it gives accumulator
    outputs to "..._rewritten" and leaves `_num_original_outputs` equal to the op's
    output count. In graph mode every such gradient differentiates the same outputs
    (every trainable one, unreached ones with zeros) with respect to every input, so a
    further gradient finds every accumulator it reads and leaves the op as it is (a
    loop that needed no accumulator is edited again, at no harm)."""
    try:
        return (op.get_attr("body").name.endswith("_rewritten")
                and op.get_attr("_num_original_outputs") == len(op.outputs))
    except ValueError:
        return False


def stacked_uses(uses, a_lists, a_shapes, eps):
    """The built `Use` of each loop use: A_all example-major, [B*k*T, *a], from the
    copy's TensorList of A_t, and ε as the key of dZ_all."""
    built = []
    for use, a_list, a_shape, e in zip(uses, a_lists, a_shapes, eps):
        stacked = list_ops.tensor_list_stack(a_list, use.activation.dtype,
                                             element_shape=a_shape)
        built.append(registry_lib.Use(use.op, use.slot, use.rule, example_major(stacked), e,
                                      use.weight_shape, use.rows))
    return built


def eps_gradients(copied, d_outputs, eps, unconnected, others=(), stops=()):
    """One backward pass of a copy from its outputs `copied` with the gradients
    `d_outputs` (None where unconnected), to `eps` and to `others` (tensors before the
    loop: the gradients along the paths through it), stopping at `stops`.

    Returns:
      ({id(ε_j): dZ_all_j, [B*k*T, *z]}, [the gradient at each of `others`, or None]).
    """
    ys = [c for c, d in zip(copied, d_outputs) if d is not None]
    grad_ys = [d for d in d_outputs if d is not None]
    others = list(others)
    grads = (tf.gradients(ys, list(eps) + others, grad_ys=grad_ys, stop_gradients=list(stops),
                          unconnected_gradients=tf.UnconnectedGradients.NONE)
             if ys else [None] * (len(eps) + len(others)))
    found = {}
    for e, g in zip(eps, grads):
        if g is None and unconnected == tf.UnconnectedGradients.ZERO:
            g = tf.zeros_like(e)
        found[id(e)] = None if g is None else example_major(g)
    return found, grads[len(eps):]


_EPS_PREFIX = "pertower_loop_eps_"


class Slice:
    """Slice `index` along `axis` of a weight of static `shape` (an Unpack's output)."""

    def __init__(self, axis, index, shape):
        self.axis, self.index, self.shape = axis, index, shape.as_list()

    def place(self, piece, grouped):
        """The gradient of the slice, [G, *slice] (or [*slice] when not `grouped`),
        as the gradient of the whole weight: zeros elsewhere, [G, *shape]."""
        lead = 1 if grouped else 0
        inner = self.shape[:self.axis] + self.shape[self.axis + 1:]
        piece = tf.reshape(piece, ([-1] if grouped else []) + inner)
        piece = tf.expand_dims(piece, self.axis + lead)
        paddings = [[0, 0]] * (lead + self.axis) + [
            [self.index, self.shape[self.axis] - 1 - self.index]] + [[0, 0]] * (
                len(self.shape) - 1 - self.axis)
        return tf.pad(piece, paddings)


class Placed(registry_lib.Rule):
    """A rule whose weight input is a slice of the weight (`Slice`s, outermost last):
    its results are placed in the weight's shape (zeros elsewhere); the other slices'
    reads add theirs. A zero-padded gradient has the norm of the slice's."""

    def __init__(self, rule, placements, piece_shape):
        self.rule, self.placements, self.piece_shape = rule, placements, piece_shape

    def _place(self, result, grouped):
        for placement in reversed(self.placements):
            result = placement.place(result, grouped)
        return result

    def match(self, op, slot, analysis):
        return self.rule.match(op, slot, analysis)

    def per_group(self, use, dZ, G):
        return self._place(self.rule.per_group(use, dZ, G), True)

    def squared_norms(self, use, dZ, B):
        own = getattr(self.rule, "squared_norms", None)
        return own(use, dZ, B) if callable(own) else None

    def clipped_sum(self, use, dZ, factors):
        own = getattr(self.rule, "clipped_sum", None)
        total = (own(use, dZ, factors) if callable(own) else
                 registry_lib.default_clipped_sum(self.rule, use, dZ, factors))
        return self._place(total, False)


def example_major(stacked):
    """[T, B*k, ...] -> [B*k*T, ...]: example i's rows of every step contiguous."""
    rank = stacked.shape.rank
    moved = tf.transpose(stacked, [1, 0] + list(range(2, rank)))       # [B*k, T, ...]
    rest = [d if d is not None else -1 for d in stacked.shape.as_list()[2:]]
    if -1 in rest:
        rest_t = tf.shape(stacked)[2:]
        return tf.reshape(moved, tf.concat([[-1], rest_t], axis=0))
    return tf.reshape(moved, [-1] + rest)


def graph_upstream(tensors):
    """The ops `tensors` depend on (data and control inputs), inside one graph."""
    seen, stack = set(), [t.op for t in tensors]
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    return seen


def _subgraph(graph, tensors):
    """The GraphDef of the ops of `graph` that `tensors` depend on."""
    keep = {op.name for op in graph_upstream(tensors)}
    full = graph.as_graph_def()
    part = tf.compat.v1.GraphDef()
    part.versions.CopyFrom(full.versions)
    part.node.extend(node for node in full.node if node.name in keep)
    return part


def _perturbed(graph_def, names):
    """`graph_def` with the output of each node in `names` (j-th) replaced by
    output + a new placeholder `pertower_loop_eps_<j>` (the node renamed, an AddV2 in
    its place under its name, so that its consumers read the sum)."""
    result = tf.compat.v1.GraphDef()
    result.CopyFrom(graph_def)
    by_name = {node.name: node for node in result.node}
    for j, name in enumerate(names):
        node = by_name[name]
        inner = f"{name}/pertower_inner"
        node.name = inner
        dtype = node.attr["T"].type
        placeholder = result.node.add()
        placeholder.name = f"{_EPS_PREFIX}{j}"
        placeholder.op = "Placeholder"
        placeholder.attr["dtype"].type = dtype
        add = result.node.add()
        add.name = name
        add.op = "AddN"   # its gradient passes dZ to both inputs, without shape ops
        add.input.extend([inner, placeholder.name])
        add.attr["T"].type = dtype
        add.attr["N"].i = 2
    return result


def _hoisted_reads(graph_def, invariant):
    """(`graph_def` with each `ReadVariableOp` of a resource input named in `invariant`
    replaced by a placeholder of its name, {its output name: a read of the outer
    resource `invariant[...]`, made here, outside the loop})."""
    result = tf.compat.v1.GraphDef()
    result.CopyFrom(graph_def)
    reads = {}
    for node in result.node:
        source = f"{node.input[0]}:0" if node.op == "ReadVariableOp" and node.input else None
        if source not in invariant:
            continue
        dtype = tf.dtypes.as_dtype(node.attr["dtype"].type)
        reads[f"{node.name}:0"] = tf.raw_ops.ReadVariableOp(resource=invariant[source], dtype=dtype)
        node.op = "Placeholder"
        del node.input[:]
        for key in list(node.attr):
            if key != "dtype":
                del node.attr[key]
    return result, reads


def _input_names(graph_def):
    """The tensors the nodes of `graph_def` read, "node:index" (control inputs apart)."""
    return {name if ":" in name else f"{name}:0"
            for node in graph_def.node for name in node.input if not name.startswith("^")}


def _consumes(graph_def, name):
    """Whether a node of `graph_def` reads the tensor `name` ("node:index")."""
    return name in _input_names(graph_def)


def _unread(graph_def, names):
    """The tensors among `names` that no node of `graph_def` reads."""
    read = _input_names(graph_def)
    return {name for name in names if name not in read}


def _without(graph_def, kept, names):
    """`graph_def` without the nodes of the tensors `names` not in `kept`."""
    dropped = {name.split(":")[0] for name in names if name not in kept}
    if not dropped:
        return graph_def
    result = tf.compat.v1.GraphDef()
    result.versions.CopyFrom(graph_def.versions)
    result.node.extend(node for node in graph_def.node if node.name not in dropped)
    return result


def _present(graph_def, mapping):
    """The entries of `mapping` whose node is in `graph_def`."""
    names = {node.name for node in graph_def.node}
    return {key: value for key, value in mapping.items() if key.split(":")[0] in names}

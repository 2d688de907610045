"""The copy of a loop (a TF2 `While` or a TF1 frame): ε in, A_t out (see `pertower._loops`).

`BuiltCopy` builds with `while_v2` a loop over the plan's copy variables
(`LoopPlan.copy_variables`) whose condition and body replay the plan's ops (same type,
attributes and inputs, mapped to the copy's tensors), each covered op's output Z_t
replaced by Z_t + ε[t]; per covered read it carries a TensorList of A_t (pushed at each
step) and one of ε (reversed, popped at each step: a pop's gradient is one push).
"""

import dataclasses

import tensorflow as tf

from pertower import _tf
from pertower._tf import list_ops
from pertower._towers import later_gradients
from pertower.rules import registry as registry_lib

__all__ = ["BuiltCopy", "CopyVariable", "built_use", "element_shape", "example_major",
           "replay", "row_shape", "stacked"]

# attributes not copied: colocation with ops outside the copy's function
_DROPPED_ATTRS = frozenset({"_class"})


@dataclasses.dataclass
class CopyVariable:
    """A loop variable of the copy: its `initial` value and `shape` invariant; the
    original tensors whose value it is in the condition (`cond`) and in the body
    (`body`), and whose value it takes next (`next`: None passes it on unchanged)."""

    initial: object
    shape: object
    cond: object
    body: object
    next: object = None


class BuiltCopy:
    """The loop's copy with ε inputs and A outputs; the concrete uses of its reads."""

    def __init__(self, loop):
        request = loop.loops.request
        if loop.edits_user_op:
            # edit the user's loop as a tf.gradients through it would, so that a training
            # op built after the first run works (as the towers do)
            later_gradients.prepare_for_later_gradients([loop.op])
        B = (request.batch_size if request.batch_size is not None else
             tf.shape(request.batch[0])[request.batch_axes[0]])
        variables = loop.copy_variables()
        eps, eps_lists, a_lists = [], [], []
        for (target, _), use, k, lead in zip(loop.targets, loop.uses, loop.step_rows,
                                             loop.z_leads):
            z, a = target.outputs[0], use.activation
            dims = z.shape.as_list()
            dims[lead] = B * k
            zeros = tf.zeros(tf.stack([loop.steps] + dims), z.dtype)   # ε [T, B*k, *z]
            eps.append(zeros)
            eps_lists.append(list_ops.tensor_list_from_tensor(tf.reverse(zeros, [0]),
                                                              element_shape(z, lead)))
            a_lists.append(list_ops.empty_tensor_list(element_shape(a, use.rows.lead), a.dtype))
        n, J = len(variables), len(loop.targets)

        def cond(*values):
            mapping = {v.cond.ref(): x for v, x in zip(variables, values) if v.cond is not None}
            replay(loop, loop.cond_ops, mapping)
            return mapping[loop.cond_output.ref()]

        def body(*values):
            mapping = {v.body.ref(): x for v, x in zip(variables, values) if v.body is not None}
            popped, perturbations = [], {}
            for j, (target, _) in enumerate(loop.targets):
                z = target.outputs[0]
                rest, perturbations[target] = list_ops.tensor_list_pop_back(
                    values[n + J + j], element_shape=element_shape(z, loop.z_leads[j]),
                    element_dtype=z.dtype)
                popped.append(rest)
            replay(loop, loop.body_ops, mapping, perturbations)
            nexts = [x if v.next is None else mapping[v.next.ref()]
                     for v, x in zip(variables, values)]
            written = [list_ops.tensor_list_push_back(values[n + j], mapping[u.activation.ref()])
                       for j, u in enumerate(loop.uses)]
            return nexts + written + popped

        results = _tf.while_loop(
            cond, body, [v.initial for v in variables] + a_lists + eps_lists,
            shape_invariants=[v.shape for v in variables] + [tf.TensorShape([])] * (2 * J),
            name="copy")
        self.loop = loop
        self.outputs = loop.copied_outputs(results[:n])
        self.eps = eps
        self.uses = [built_use(use, stacked(a_list, use.activation, use.rows.lead), e)
                     for use, a_list, e in zip(loop.uses, results[n:n + J], eps)]

    def output_gradients(self, d_outputs, unconnected, others=(), stops=()):
        """One backward pass of the copy, given the gradients `d_outputs` at
        `loop.reached_outputs` (None where unconnected), to ε and to `others` (tensors
        before the loop: the gradients along the paths through it), stopping at `stops`.

        Returns:
          ({id(ε_j): dZ_all_j, [B*k*T, *z]}, [the gradient at each of `others`, or None]).
        """
        ys = [c for c, d in zip(self.outputs, d_outputs) if d is not None]
        grad_ys = [d for d in d_outputs if d is not None]
        others = list(others)
        grads = (tf.gradients(ys, self.eps + others, grad_ys=grad_ys,
                              stop_gradients=list(stops),
                              unconnected_gradients=tf.UnconnectedGradients.NONE)
                 if ys else [None] * (len(self.eps) + len(others)))
        found = {}
        for e, g, lead in zip(self.eps, grads, self.loop.z_leads):
            if g is None and unconnected == tf.UnconnectedGradients.ZERO:
                g = tf.zeros_like(e)
            found[id(e)] = None if g is None else example_major(g, lead)
        return found, grads[len(self.eps):]


def replay(loop, ops, mapping, perturbations=None):
    """Re-creates `ops` (in creation order) in the current graph, reading
    mapping[tensor.ref()] for the loop's tensors and `loop.outer[tensor.ref()]` for a
    value read before the loop; adds each op's outputs to `mapping` (a covered op's
    output Z as Z + perturbations[op]). A TF1 frame's TensorArray reads and writes
    (`loop.reads`, `loop.writes`) become TensorList items (mapping[scattered.ref()] is
    the list of the tensor scattered into an input TensorArray)."""
    graph = tf.compat.v1.get_default_graph()

    def read(tensor):
        found = mapping.get(tensor.ref())
        return found if found is not None else loop.outer[tensor.ref()]

    for op in ops:
        if op in loop.reads:      # an input TensorArray's element at the step's index
            scattered = loop.reads[op]
            outputs = [list_ops.tensor_list_get_item(
                mapping[scattered.ref()], read(op.inputs[1]), scattered.dtype,
                element_shape=row_shape(scattered))]
        elif op in loop.writes:   # an output TensorArray's element: a TensorList item
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
            if perturbations and op in perturbations:
                outputs[0] = tf.math.add_n([outputs[0], perturbations[op]])
        for original, value in zip(op.outputs, outputs):
            mapping[original.ref()] = value


def row_shape(tensor):
    """The shape of one row of `tensor` as a TensorList element shape (-1 where unknown)."""
    if tensor.shape.rank is None:
        return -1
    return [-1 if d is None else d for d in tensor.shape.as_list()[1:]]


def element_shape(tensor, lead=0):
    """The shape of one step's `tensor` (its batch axis `lead`) as a TensorList element
    shape (-1 where unknown, and on the batch axis)."""
    if tensor.shape.rank is None:
        return -1
    dims = [-1 if d is None else d for d in tensor.shape.as_list()]
    dims[lead] = -1
    return dims


def stacked(tensor_list, like, lead=0):
    """The TensorList of the steps' values of the body tensor `like` (its batch axis
    `lead`), [T, B*k, ...], stacked example-major: [B*k*T, ...]."""
    return example_major(list_ops.tensor_list_stack(
        tensor_list, like.dtype, element_shape=element_shape(like, lead)), lead)


def built_use(use, activation, key):
    """The built `Use` of the loop use `use`: A_all `activation`, and `key` the tensor
    whose id keys dZ_all."""
    return registry_lib.Use(use.op, use.slot, use.rule, activation, key, use.weight_shape,
                            use.rows)


def example_major(stacked, lead=0):
    """[T, B*k, ...] -> [B*k*T, ...]: example i's rows of every step contiguous; with
    the batch on axis `lead` of a step, [T, ..., B*k, ...] -> [..., B*k*T, ...]."""
    rank = stacked.shape.rank
    moved = tf.transpose(stacked, list(range(1, lead + 2)) + [0] + list(
        range(lead + 2, rank)))                                        # [..., B*k, T, ...]
    dims = [d if d is not None else -1 for d in stacked.shape.as_list()[1:]]
    dims[lead] = -1
    if dims.count(-1) > 1:
        sizes = tf.shape(stacked)
        return tf.reshape(moved, tf.concat([sizes[1:lead + 1], [-1], sizes[lead + 2:]], 0))
    return tf.reshape(moved, dims)

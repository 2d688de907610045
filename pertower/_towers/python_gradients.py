"""Gradients written in Python, replayed with each tower's own tensors.

Notation as in `pertower._towers.build`; op an op of S whose gradient the user replaced
(`tf.custom_gradient`, `gradient_override_map`: `_gradient_op_type`), dy the gradients
at its outputs, [B/T, ...] in a tower.

The user's function may read the ORIGINAL graph's tensors (a `tf.custom_gradient`
closure captures its forward tensors, [B, ...]) where a tower holds B/T examples. So the
backward of op is built once on dy placeholders in a scratch graph (the template,
`pertower._overrides`), and each tower's copy of op gets a gradient that copies the
template (`replicate`) with dy and every captured tensor replaced by the tower's: the
user's function on tower t's tensors alone. Forward tensors captured off the way to
`ys` (a closure's `s = tf.sigmoid(h)`) are recomputed for the tower first.

Refused, naming op: an override that cannot be built on its own, one that takes a
variable's handle (its gradient would go to the variable), and a captured TF1 loop.
"""

import uuid

import tensorflow as tf

from pertower import _context
from pertower import _graph_walk as graph_walk
from pertower import _op_types as op_types
from pertower import _overrides
from pertower import _tf
from pertower._towers import replicate as replicate_lib

__all__ = ["ReplayedGradients"]


class ReplayedGradients:
    """One build's gradient functions for the towers' copies of overridden ops: the
    replay calls `prepare` (a refusal comes before any tower op is added), then
    `edit_node` on every copied NodeDef; the gradient is registered under `name`."""

    def __init__(self, graph, replay_prefix, inputs):
        """`inputs[t]`: {tensor name: tower t's tensor} for the batch tensors and weight
        reads; tower t's copy of op is named replay_prefix + f"t{t}/" + op.name."""
        self.graph = graph
        self.replay_prefix = replay_prefix
        self._inputs = inputs
        # TensorFlow's gradient registry is the process's: a name no other build has
        self.name = f"PertowerReplayedGradient_{uuid.uuid4().hex}"
        self._templates = {}   # op name -> OverrideBackward (in its scratch graph)
        self._recomputed = {}  # op name -> the user's forward ops each tower recomputes
        self._copies = {}      # copied op name -> (original op, tower)
        self._replayed = frozenset()
        self._built = _overrides.Templates()   # one scratch graph per computation
        tf.RegisterGradient(self.name)(self._gradient)

    def prepare(self, replayed, batch, on_weights):
        """Builds the template of every overridden op of `on_weights` (the ops of
        `replayed` a weight's gradient flows through; not call ops) and finds the ops it
        reads that are computed from the `batch` tensors outside `replayed`."""
        self._replayed = frozenset(replayed)
        overridden = [op for op in on_weights if _overrides.OVERRIDE_ATTR in op.node_def.attr
                      and op.type not in op_types.CALL_OP_TYPES]
        for op in sorted(overridden, key=_tf.op_order_key()):
            if any(t.dtype == tf.resource for t in op.inputs):
                raise _context.error(
                    ValueError, f"the gradient of op {op.name!r} ({op.type}) is "
                    f"overridden ({_overrides.kind(op)!r}) and takes a variable's handle "
                    "(tf.custom_gradient with `variables`): its gradient goes to the "
                    "variable, not to a tower's copy. Pass the variable's value into the "
                    "function as an argument, or leave it out of `xs`.")
            template = _overrides.override_backward(op, templates=self._built)
            outside = [outer for _, outer in template.captured if outer.op not in self._replayed]
            # forward ops the backward captured off the way to `ys`: each tower recomputes
            captured = graph_walk.downstream_ops(batch, graph_walk.upstream_ops(outside))
            captured -= self._replayed | {b.op for b in batch}
            for c_op in captured:
                if c_op.type in op_types.V1_LOOP_OP_TYPES:
                    raise _context.error(
                        ValueError, f"the overridden gradient of op {op.name!r} "
                        f"({op.type}) reads {c_op.name!r} ({c_op.type}), a TF1 loop op "
                        "computed from the batch off the way to `ys`, which the towers "
                        "cannot recompute for their own examples. Leave the weights "
                        "behind this op out of `xs`.")
            self._templates[op.name] = template
            self._recomputed[op.name] = tuple(sorted(captured, key=_tf.op_order_key()))

    def edit_node(self, node, op, t):
        """Gives tower t's copy `node` of an overridden `op` this build's gradient."""
        if op.name in self._templates:
            node.attr[_overrides.OVERRIDE_ATTR].s = self.name.encode()
            self._copies[node.name] = (op, t)

    def _gradient(self, copy, *dys):
        """The gradient function of tower t's copy of op: the template with dy and the
        user's tensors replaced by tower t's."""
        op, t = self._copies[copy.name]
        template = self._templates[op.name]
        tower_prefix = f"{self.replay_prefix}t{t}/"
        # an output no gradient reaches (None) reads as zeros, never as the placeholder
        dys = [tf.zeros_like(out) if dy is None else dy for dy, out in zip(dys, copy.outputs)]
        dy_of = {id(p): dy for p, dy in zip(template.dys, dys)}
        dy_op_of = {id(p.op): dy.op for p, dy in zip(template.dys, dys)}
        outer_of = {id(inner): outer for inner, outer in template.captured}

        def tower_tensor(tensor):
            """Tower t's version of the user's `tensor`, or None when the towers share it."""
            if tensor.name in self._inputs[t]:
                return self._inputs[t][tensor.name]
            if tensor.op in self._replayed:
                return self.graph.get_tensor_by_name(tower_prefix + tensor.name)
            return None

        def forward_counterpart(item, _):
            if isinstance(item, tf.Tensor):
                return tower_tensor(item)
            if item in self._replayed:
                return self.graph.get_operation_by_name(tower_prefix + item.name)
            return None

        with tf.name_scope("replayed") as scope:
            pass
        # the user's forward tensors the backward reads, as tower t computes them
        own = {}
        if self._recomputed[op.name]:
            inside = set(self._recomputed[op.name])
            wanted = [outer for _, outer in template.captured if outer.op in inside]
            (versions,) = replicate_lib.replicate(
                self._recomputed[op.name], [0], lambda name, _: scope + "forward/" + name,
                forward_counterpart, self.graph, wanted)
            own = {id(r): v for r, v in zip(wanted, versions)}

        def counterpart(item, _):
            if isinstance(item, tf.Tensor):
                if id(item) in dy_of:
                    return dy_of[id(item)]
                outer = outer_of[id(item)]   # a capture: the user's tensor
                if id(outer) in own:
                    return own[id(outer)]
                replacement = tower_tensor(outer)
                return outer if replacement is None else replacement
            if id(item) in dy_op_of:   # a control input on dy (swish's backward has one)
                return dy_op_of[id(item)]
            raise _context.error(
                ValueError, f"the overridden gradient of op {op.name!r} ({op.type}) has a "
                f"control input on {item.name!r}, which the towers cannot copy. Leave "
                "the weights behind this op out of `xs`.")

        returned = [g for g in template.grads if isinstance(g, tf.Tensor)]
        for g in template.grads:
            if isinstance(g, tf.IndexedSlices):
                returned += [g.values, g.indices]
        placeholders = {p.op for p in template.dys}
        library = template.graph.as_graph_def().library
        (versions,) = replicate_lib.replicate(
            [o for o in template.ops if o not in placeholders], [0],
            lambda name, _: scope + name, counterpart, self.graph, returned,
            library=library if library.function else None)
        version = dict(zip((id(g) for g in returned), versions))
        result = []
        for g in template.grads:
            if isinstance(g, tf.IndexedSlices):
                result.append(tf.IndexedSlices(version[id(g.values)], version[id(g.indices)],
                                               g.dense_shape))
            else:
                result.append(None if g is None else version[id(g)])
        return result

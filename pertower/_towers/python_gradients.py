"""Gradients written in Python, replayed with each tower's own tensors.

Notation:
    T   towers                      S   the replayed ops (`Request.replay_region`)
    op  an op of S whose gradient the user replaced (`tf.custom_gradient`,
        `gradient_override_map`: its `_gradient_op_type` attribute names a Python
        function in TensorFlow's gradient registry)
    dy  the gradients arriving at op's outputs, one per output, [B/T, ...] in a tower

A copied op keeps `_gradient_op_type`, so `tf.gradients` through tower t's copy calls
the user's function. That function may read the ORIGINAL graph's tensors: a
`tf.custom_gradient` closure captures the forward tensors it was traced with (tf_keras'
swish captures its input `features`, [B, d]), and would compute with the whole batch's
values where the tower holds B/T examples ("Incompatible shapes", or, for a backward
that broadcasts, numbers of other examples).

So the backward of op is built once, as `tf.gradients` would build it, on fresh dy
placeholders of op's output shapes, in a scratch graph (the template, never run and
never in the user's graph: `pertower._overrides`), and each tower's copy of op gets a
gradient function of its own that copies the template into the graph
(`pertower._towers.replicate`) with dy -> the tower's dy and every captured tensor of S
-> the tower's replay of it (batch tensors -> the tower's slices, weight reads -> the tower's
copies). Tower t's backward through op is then the user's function applied to tower
t's tensors alone: exactly what the one-example loop (T = B) or the microbatch loop runs.

Forward tensors the backward captured off the way to `ys` (a closure's `s =
tf.sigmoid(h)`, computed from the batch but not replayed) are recomputed for the tower
from the tower's tensors, ahead of the copy. Refused, naming op: an override that is not registered or
cannot be built on its own, one that takes a variable's handle (its gradient would go
to the variable, not to the tower's copy), and a captured TF1 loop.
"""

import uuid

import tensorflow as tf

from pertower import _context
from pertower import _graph_walk as graph_walk
from pertower import _op_types as op_types
from pertower import _overrides
from pertower import _tf
from pertower._towers import replicate as replicate_lib

__all__ = ["overridden_ops", "ReplayedGradients"]

def overridden_ops(ops):
    """The ops of `ops` with a gradient registered in Python by the user (not call ops,
    whose `_gradient_op_type` the function rewrite handles), in creation order."""
    return sorted((op for op in ops if _overrides.OVERRIDE_ATTR in op.node_def.attr
                   and op.type not in op_types.CALL_OP_TYPES),
                  key=_tf.op_order_key())


class ReplayedGradients:
    """One build's gradient functions for the towers' copies of overridden ops.

    The replay calls `register_tower` with what tower t reads in place of the user's
    tensors, then `prepare` (builds each template; a refusal comes before any tower op
    is added), then `edit_node` on every copied NodeDef. The gradient is registered
    in TensorFlow's registry under `name`, unique to the build, and called by
    `tf.gradients` for each tower's copy.
    """

    def __init__(self, graph, replay_prefix):
        self.graph = graph
        self.replay_prefix = replay_prefix   # tower t's copy of op is prefix + f"t{t}/" + name
        # TensorFlow's gradient registry is the process's: a name no other build has
        self.name = f"PertowerReplayedGradient_{uuid.uuid4().hex}"
        self._templates = {}   # op name -> OverrideBackward (in its scratch graph)
        self._recomputed = {}  # op name -> the user's forward ops each tower recomputes
        self._copies = {}      # copied op name -> (original op, tower)
        self._inputs = {}      # tower -> {tensor name: tower's tensor}
        self._replayed = frozenset()
        self._built = _overrides.Templates()   # one scratch graph per computation
        tf.RegisterGradient(self.name)(self._gradient)

    def prepare(self, replayed, batch, on_weights):
        """Builds the template of every overridden op of `on_weights` (the ops of
        `replayed` a weight's gradient flows through), with the ops it reads that are
        computed from the `batch` tensors outside `replayed`; refuses (named op) an op
        that takes a variable's handle, and a captured TF1 loop. The other overrides
        keep their function: no gradient the towers ask for goes through them."""
        self._replayed = frozenset(replayed)
        for op in overridden_ops(on_weights):
            if any(t.dtype == tf.resource for t in op.inputs):
                raise _context.error(
                    ValueError, f"the gradient of op {op.name!r} ({op.type}) is "
                    f"overridden ({_overrides.kind(op)!r}) and takes a variable's handle "
                    "(tf.custom_gradient with `variables`): its gradient goes to the "
                    "variable, not to a tower's copy. Pass the variable's value into the "
                    "function as an argument, or leave it out of `xs`.")
            template = _overrides.override_backward(op, templates=self._built)
            outside = [outer for _, outer in template.captured if outer.op not in self._replayed]
            # forward ops the backward captured off the way to `ys` (a closure's
            # tf.sigmoid(h)): computed from the batch, so each tower recomputes them
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

    def register_tower(self, t, inputs):
        """{tensor name: tower t's tensor} for the batch tensors and weight reads."""
        self._inputs[t] = inputs

    def _tower_tensor(self, tensor, t):
        """Tower t's version of the user's `tensor`, or None when the towers share it."""
        if tensor.name in self._inputs.get(t, {}):
            return self._inputs[t][tensor.name]
        if tensor.op in self._replayed:
            return self.graph.get_tensor_by_name(f"{self.replay_prefix}t{t}/{tensor.name}")
        return None

    def _gradient(self, copy, *dys):
        """The gradient function of tower t's copy of op: the template with dy and the
        user's tensors replaced by tower t's."""
        op, t = self._copies[copy.name]
        template = self._templates[op.name]
        # an output no gradient reaches (None) reads as zeros, never as the placeholder
        dys = [tf.zeros_like(out) if dy is None else dy for dy, out in zip(dys, copy.outputs)]
        dy_of = {id(p): dy for p, dy in zip(template.dys, dys)}

        dy_op_of = {id(p.op): dy.op for p, dy in zip(template.dys, dys)}
        outer_of = {id(inner): outer for inner, outer in template.captured}

        def tower_tensor(tensor):
            return self._tower_tensor(tensor, t)

        def forward_counterpart(item, _):
            if isinstance(item, tf.Tensor):
                return tower_tensor(item)
            if item in self._replayed:
                return self.graph.get_operation_by_name(f"{self.replay_prefix}t{t}/{item.name}")
            return None

        with tf.name_scope("replayed") as scope:
            pass
        # the user's forward tensors the backward reads, as tower t computes them
        recomputed = self._recomputed[op.name]
        read = [outer for _, outer in template.captured]
        own = {}
        if recomputed:
            inside = set(recomputed)
            wanted = [r for r in read if r.op in inside]
            (versions,) = replicate_lib.replicate(
                recomputed, [0], lambda name, _: scope + "forward/" + name,
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
        ops = [o for o in template.ops if o not in placeholders]
        library = template.graph.as_graph_def().library
        (versions,) = replicate_lib.replicate(
            ops, [0], lambda name, _: scope + name, counterpart, self.graph, returned,
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

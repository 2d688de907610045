"""The plan of a loop's weights, shared by TF2 `While` loops and TF1 frames.

`LoopPlan` follows a weight from where the body receives it to the ops that read it, and
checks each read against what the loop's per-step A_t and dZ_t can carry
(`step_rule_reason`). Each step of that walk that changes the weight is a placement: an
`Unpack` slice (`Slice`), or a function of the weights alone (`Function`: a Cast, a Split
into gates, tanh(W)); the rule's result for the piece read is placed back into the
weight's shape (`Placed`). A covered read is a `LoopUse`; the engine asks for the tensors
to differentiate (`differentiated`), the per-step output gradients (`output_gradients`)
and the built uses (`concrete_uses`). Notation and identity: `pertower._loops`.
"""

import dataclasses

import tensorflow as tf

from pertower import _batch_axis
from pertower import _op_types as op_types
from pertower import _tf
from pertower._loops import copy
from pertower._loops.placements import Function, Placed, Slice
from pertower._loops import step_rules
from pertower._loops.step_rules import StepBroadcast, StepConvolution
from pertower.rules import _weight_functions as weight_functions
from pertower.rules import registry as registry_lib

__all__ = ["Function", "LoopPlan", "LoopUse", "Placed", "Slice", "StepBroadcast",
           "StepConvolution", "concrete_uses", "differentiated", "output_gradients",
           "step_rule_reason", "unreplayable_reason"]

# The op types whose own rules read only A, dZ, the weight's shape and the op's
# attributes (not the op's inputs, which a loop body's op cannot hand out of the loop).
_STEP_RULE_OP_TYPES = frozenset({"MatMul", "BiasAdd", "Einsum"}) | op_types.BATCH_MATMUL_OP_TYPES
_STEP_RULE_MODULES = frozenset({"pertower.rules.matmul", "pertower.rules.bias_add",
                                "pertower.rules.einsum"})
# A two-input broadcast op (`rules.broadcast`) is rebuilt on A_all, its other input
# (the batch carrier), and the weight's value before the loop (`StepBroadcast`); a
# convolution on A_all (`StepConvolution`).
_BROADCAST_MODULE = "pertower.rules.broadcast"
# The stateful ops a copy replays: reads of a variable's value or rows.
_READS = op_types.VARIABLE_READ_OP_TYPES | op_types.HANDLE_GATHER_OP_TYPES


def unreplayable_reason(op, stateful_allowed):
    """Why a loop's copy cannot re-create the body op `op` (it calls a function, or is
    stateful and not of `stateful_allowed`), or None."""
    if op.type in op_types.WHILE_OP_TYPES:
        return f"its body holds a nested while loop ({op.name!r}), which no copy follows"
    if any(value.HasField("func") or (value.HasField("list") and value.list.func)
           for value in op.node_def.attr.values()):
        return f"its body calls functions ({op.name!r}, {op.type})"
    if op.op_def.is_stateful and op.type not in stateful_allowed:
        return (f"its body has the stateful op {op.name!r} ({op.type}), which a copy of the "
                "loop would not reproduce")
    return None


def step_rule_reason(target, rule):
    """Why `rule` cannot compute a read by `target` inside a loop from the copy's
    per-step A and dZ (it reads the op's inputs), or None."""
    if target.type in _STEP_RULE_OP_TYPES and type(rule).__module__ in _STEP_RULE_MODULES:
        return None
    if len(target.inputs) == 2 and type(rule).__module__ == _BROADCAST_MODULE:
        return None
    if _step_convolution(target, rule):
        return None
    return (f"its body reads it by {target.name!r} ({target.type}), whose rule reads the "
            "op's own inputs, which do not leave the loop (the rules of "
            f"{', '.join(sorted(_STEP_RULE_OP_TYPES | step_rules.STEP_CONVOLUTION_OP_TYPES))}"
            " and of a two-input broadcast op do, per step)")


def _step_convolution(target, rule):
    return (target.type in step_rules.STEP_CONVOLUTION_OP_TYPES
            and type(rule).__module__ in step_rules.STEP_CONVOLUTION_MODULES)


@dataclasses.dataclass(frozen=True)
class LoopUse(registry_lib.Use):
    """A covered read of a weight inside a loop body: `op`, `activation` and `output`
    are the body's (A_t, Z_t); `loop` the `LoopPlan` that builds A_all and dZ_all;
    `index` the read's position among the loop's covered reads."""

    loop: object = None
    index: int = 0

    @property
    def label(self):
        """How `explain` names the read: the body op and the loop."""
        return f"{self.op.name} ({self.op.type}) in {self.loop.where} per step"

    def concrete(self):
        """The `Use` of A_all, [B*k*T, *a], and the key tensor of dZ_all (built once)."""
        return dataclasses.replace(self.loop.built().uses[self.index], rule=self.rule)


def concrete_uses(uses):
    """`uses` with every `LoopUse` replaced by its built `Use` (builds the copies)."""
    return [u.concrete() if isinstance(u, LoopUse) else u for u in uses]


def differentiated(use):
    """The tensors whose gradients the engine's one `tf.gradients` call takes for `use`:
    its output Z, or for a read inside a loop the loop's outputs."""
    return use.loop.reached_outputs if isinstance(use, LoopUse) else [use.output]


def output_gradients(ys, targets, loop_uses, grad_ys, unconnected):
    """The gradients of sum(grad_ys * ys) the rules need, each loop differentiated ONCE
    (its own backward or its copy's, never through `tf.gradients` of the user's loop).

    Args:
      ys: the outputs, [B, ...].
      targets: the tensors whose gradients are wanted (uses' Z, and for a read inside a
        loop the loop's `reached_outputs`: `differentiated`).
      loop_uses: the `LoopUse`s among the uses.
      grad_ys: as for `tf.gradients` (None for ones).
      unconnected: a `tf.UnconnectedGradients`.

    Returns:
      {id(t): gradient} for `targets` and {id(ε_j): dZ_all_j, [B*k*T, *z]} for the
      loop uses.

    One `tf.gradients` of ys stops at the loops' outputs. Then, downstream loops first
    (the gradients at their outputs are then complete), one backward pass of each loop
    gives dZ_t of every step and the gradients at the targets before the loop along the
    paths through it, added to theirs: a target's gradient is the sum over its paths.
    """
    order = _tf.op_order_key()
    loops = sorted(dict.fromkeys(use.loop for use in loop_uses),
                   key=lambda loop: -max(order(t.op) for t in loop.reached_outputs))
    if not loops:
        grads = tf.gradients(ys, targets, grad_ys=grad_ys, unconnected_gradients=unconnected)
        return {id(t): g for t, g in zip(targets, grads)}
    wanted = {id(t): t for t in targets}
    for loop in loops:
        wanted.update((id(t), t) for t in loop.reached_outputs)
    stops = {id(t): t for loop in loops for t in loop.reached_outputs}
    grads = tf.gradients(ys, list(wanted.values()), grad_ys=grad_ys,
                         stop_gradients=list(stops.values()),
                         unconnected_gradients=tf.UnconnectedGradients.NONE)
    found = dict(zip(wanted, grads))
    results = {}
    for loop in loops:   # downstream first: the gradients at its outputs are complete
        own = {id(t) for t in loop.reached_outputs}
        others = [t for key, t in wanted.items() if key not in own]
        eps, more = loop.built().output_gradients(
            [found[id(t)] for t in loop.reached_outputs], unconnected, others,
            [t for key, t in stops.items() if key not in own])
        results.update(eps)
        for t, g in zip(others, more):
            if g is not None:
                found[id(t)] = g if found[id(t)] is None else tf.math.add_n(   # dense sum
                    [tf.convert_to_tensor(found[id(t)]), tf.convert_to_tensor(g)])
    for key, t in wanted.items():
        if found[key] is None and unconnected == tf.UnconnectedGradients.ZERO:
            found[key] = tf.zeros_like(t)
    results.update(found)
    return results


class LoopPlan:
    """What planning a loop's weights does for both kinds (`while_v2.WhileLoop`,
    `frames.Frame`): `targets` ((body op, slot) of each covered read), `uses` and
    `step_rows` (k of each) and `z_leads` (the batch axis of each Z_t, A_t's is its
    rows' lead) are filled here; the kinds set `reason` and define:

      where: how `explain` names the loop
      _in_body(op), _in_cond(op): whether the copy replays `op` in its body, condition
      _use_analysis: the analysis a body op's rule is matched with
      _invariant_input(tensor): the tensor before the loop whose value a body input is
        at every step (a loop invariant), or None
      _body_outputs: the body's values of the loop variables for the next step
      _steps_rows(use): k*T, the rows per example of A_all, or None when not static
      _make_copy(): what `built` returns (a `copy.BuiltCopy` or `backward.OwnBackward`)
    and, for the copy (`copy.BuiltCopy`): steps (T), cond_ops, body_ops, cond_output,
    outer, edits_user_op, copy_variables(), copied_outputs(results).
    """

    def __init__(self, loops):
        self.loops = loops
        self.targets, self.uses, self.step_rows = [], [], []
        self.z_leads = []      # the batch axis of each covered read's Z_t
        # a TF1 frame's body TensorArray reads (op -> the scattered tensor) and writes
        # (op -> index of its loop variable)
        self.reads, self.writes = {}, {}
        self._built = None
        self._outside = {}     # body tensor ref -> its value built before the loop
        self._same_alone = None

    def _reached(self, tensor):
        """Whether `ys` is `tensor` or reads it."""
        request = self.loops.request
        return tensor is request.ys or any(c in request.ys_upstream for c in tensor.consumers())

    def weight_uses_from(self, tensor):
        """The `LoopUse`s of the weight the body receives as `tensor` (its resource
        handle or its value), or a reason."""
        if self.reason is not None:
            return self.reason
        root, stack, terminals = tensor, [(tensor, ())], []   # the handle, or the value
        while stack:
            tensor, placements = stack.pop()
            if tensor is not root and any(tensor is t for t in self._body_outputs):
                return "its body passes the weight, or a function of it, to the next step"
            for consumer in tensor.consumers():
                if self._in_cond(consumer):
                    return "its condition reads the weight"
                if not self._in_body(consumer):
                    continue
                slots = [j for j, t in enumerate(consumer.inputs) if t is tensor]
                if tensor.dtype == tf.resource and self._weight_side(consumer, slots):
                    # a gather of rows every example reads (a position table's range(T))
                    stack.append((consumer.outputs[0], placements + (
                        Function(self, tensor, consumer.outputs[0]),)))
                    continue
                if tensor.dtype == tf.resource:   # the handle: read, never passed on
                    if consumer.type not in op_types.VARIABLE_READ_OP_TYPES:
                        return (f"its body passes the weight to {consumer.name!r} "
                                f"({consumer.type})")
                    stack.append((consumer.outputs[0], ()))
                    continue
                if weight_functions.is_reorder(consumer, slots):   # a re-layout
                    stack.append((consumer.outputs[0], placements))
                    continue
                if consumer.type == "Unpack" and tensor.shape.is_fully_defined():
                    # a weight [.., N, ..] read as its N slices along `axis`
                    axis = consumer.get_attr("axis") % tensor.shape.rank
                    stack.extend((out, placements + (Slice(axis, i, tensor.shape),))
                                 for i, out in enumerate(consumer.outputs))
                    continue
                if self._weight_side(consumer, slots):
                    stack.extend((out, placements + (Function(self, tensor, out),))
                                 for out in consumer.outputs)
                    continue
                terminals.extend((consumer, j, placements) for j in slots)
        found = []
        for target, slot, placements in sorted(terminals, key=lambda p: (p[0].name, p[1])):
            use = self._target_use(target, slot, placements)
            if isinstance(use, str):
                return use
            found.append(use)
        return found

    def _target_use(self, target, slot, placements):
        """The `LoopUse` of the read of input `slot` of the body op `target`, or why the
        copy cannot carry it."""
        where = f"{target.name!r} ({target.type})"
        rule = self.loops.registry.lookup(target.type)
        if rule is None:
            return f"its body reads it by {where}, which has no rule"
        reason = step_rule_reason(target, rule)
        if reason is not None:
            return reason
        use = rule.match(target, slot, self._use_analysis)
        if isinstance(use, str):
            return f"its body reads it by {where}: {use}"
        if any(self._in_body(c) for out in target.outputs[1:] for c in out.consumers()):
            return f"the body reads other outputs of {where}"
        z_shape, z_lead = target.outputs[0].shape, self._lead(target.outputs[0])
        if z_lead is None or self._lead(use.activation) != use.rows.lead:
            return (f"the batch of {where} is not on the first axis of its input and output "
                    "(or the second of a matrix)")
        if not all(d is not None for j, d in enumerate(z_shape.as_list()) if j != z_lead):
            return f"the shape of {target.outputs[0].name} past its rows is not static"
        if use.weight_shape is None or not use.weight_shape.is_fully_defined():
            return f"its shape at {where} ({use.weight_shape}) is not static"
        if use.output is not target.outputs[0] or type(use) is not registry_lib.Use or use.through:
            return (f"the rule of {where} reads it through a view or another output, which "
                    "the loop's copy does not carry")
        # a read already planned (for this weight, or another one of the same function)
        # shares its A_all and dZ_all
        index = (self.targets.index((target, slot)) if (target, slot) in self.targets
                 else len(self.targets))
        fields = {f.name: getattr(use, f.name) for f in dataclasses.fields(registry_lib.Use)}
        if type(rule).__module__ == _BROADCAST_MODULE:
            if self.outside(target.inputs[slot]) is None:
                return f"the weight's value at {where} is not computable before the loop"
            rule = StepBroadcast(rule, self, target.inputs[slot])
        elif _step_convolution(target, rule):
            rule = StepConvolution(rule)
        fields.update(rule=Placed(rule, placements) if placements else rule,
                      rows=use.rows._replace(k=self._steps_rows(use)))
        loop_use = LoopUse(**fields, loop=self, index=index)
        if index == len(self.targets):
            self.targets.append((target, slot))
            self.uses.append(loop_use)
            self.step_rows.append(use.rows.k)
            self.z_leads.append(z_lead)
        return loop_use

    def _lead(self, tensor):
        """The batch axis of the body tensor `tensor`: 0, or 1 for a matrix whose columns
        are examples (a product with the weight on the left); None otherwise."""
        value = self._use_analysis.value(tensor)
        lead = value.lead if isinstance(value, _batch_axis.Rows) else None
        return lead if lead == 0 or (lead == 1 and tensor.shape.rank == 2) else None

    def _weight_side(self, op, slots):
        """Whether the body op `op`, reading the weight at `slots`, is a function of the
        weights alone by the criterion outside loops (`_weight_functions.follow`: its
        inputs the same for one example alone as for the batch, sizes of other axes
        included) and the same at every step: its inputs computable before the loop
        (`outside`), its outputs static. An op that mixes the weight with batch data is
        a read (so is an op without a registered gradient)."""
        try:
            _tf.gradient_function(op)
        except LookupError:
            return False
        if self._same_alone is None:
            self._same_alone = weight_functions.SameAlone(self._use_analysis)
        return (weight_functions.follow(op, slots, self._same_alone) == "function"
                and all(t.dtype.is_floating and t.shape.is_fully_defined() for t in op.outputs)
                and all(self.outside(t) is not None for t in op.inputs))

    def outside(self, tensor, build=False):
        """The value before the loop of the body tensor `tensor` when it is a function of
        constants and the loop's invariant inputs (`_invariant_input`), else None; its
        ops are copied before the loop when `build` (once), else True is returned."""
        found = self._invariant_input(tensor)
        if found is not None:
            return found if build else True
        op = tensor.op
        if (not self._in_body(op) or (not op.inputs and op.type != "Const")
                or op.op_def.is_stateful and op.type not in _READS):
            return None
        if not build:
            return True if all(self.outside(t) for t in op.inputs) else None
        if tensor.ref() not in self._outside:
            mapping = {t.ref(): self.outside(t, build=True) for t in op.inputs}
            copy.replay(self, [op], mapping)
            self._outside.update((t.ref(), mapping[t.ref()]) for t in op.outputs)
        return self._outside[tensor.ref()]

    def built(self):
        """The loop's copy (built once, on first use)."""
        if self._built is None:
            with tf.name_scope("loop_weights"):
                self._built = self._make_copy()
        return self._built


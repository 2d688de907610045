"""Rule for a weight passed to a function call whose body applies one covered op to it.

Notation (as in `rules.registry`): call a PartitionedCall or StatefulPartitionedCall
(`tf.function`) in the graph of `ys`; body the called function's graph; `inner` its op
that reads the weight. (tf_keras builds a Conv2D with groups > 1 as a call of a
`tf.function(jit_compile=True)` whose body is `Conv2D(inputs, kernel) -> Identity`.)

Identity (the chain rule does not see a function's boundary): when `inner` takes every
input from an argument of the function, nothing else in the body reads the weight's
argument, and `inner`'s only output reaches exactly one output j of the function, each
through re-layouts only (`_call_layouts`: Identity, ExpandDims, Squeeze, Reshape, as in
Keras' Conv1D(groups > 1) body), then Z_inner and A_inner are reshapes of the call's
output j and input, so `inner`'s own rule computes grad_i(w) from the call's tensors
(re-laid-out: `Relaid`), whose rows the batch-axis analysis of the call proves. Anything
else (other ops on the paths, more uses of the weight or of inner's output, several
outputs, a body constant) leaves the weight on its fallback.
"""

import dataclasses

import tensorflow as tf

from pertower import _batch_axis
from pertower import _op_types as op_types
from pertower import _tf
from pertower.rules import _call_layouts as layouts
from pertower._layout import _rows
from pertower.rules import registry as registry_lib

__all__ = ["CallView", "CallUse", "Relaid", "FunctionCallRule", "register"]


class CallView:
    """A body op seen from the graph of its call: `type` and attributes (`get_attr`,
    `node_def`, ...) are the body op's; `inputs` are the call's inputs that feed the body
    op's inputs, `outputs` the one output of the call that is the body op's output."""

    def __init__(self, call, inner, inputs, output):
        self._inner = inner
        self.call = call
        self.inputs = tuple(inputs)
        self.outputs = (output,)
        self.type = inner.type
        self.name = f"{call.name}/{inner.name}"
        self.graph = call.graph

    def __getattr__(self, name):   # get_attr, node_def, op_def, ...: the body op's
        return getattr(self._inner, name)

    def __repr__(self):
        return f"<CallView {self.name!r} ({self.type})>"


@dataclasses.dataclass(frozen=True)
class CallUse(registry_lib.Use):
    """A read of a weight by a call whose body's op `inner.op` has a rule: `op` is the
    call, `inner` the body rule's `Use` of the `CallView` (the same A, Z and rows), and
    `relaid` None when the body op reads the call's tensors as they are, else the
    `Relaid` re-layouts between them (`inner` then holds the body's tensors, and each
    method rebuilds it on the call's tensors re-laid-out)."""

    inner: object = None
    relaid: object = None


class FunctionCallRule(registry_lib.ForwardingRule):
    """Delegates to the rule of the one body op that reads the weight (see the module
    docstring); holds the graphs of the functions it has read."""

    def __init__(self, registry=None):
        self.registry = registry
        self._bodies = {}

    def _body(self, call):
        """The graph of the function `call` runs, or None when it cannot be read."""
        try:
            name = call.get_attr("f").name
        except (ValueError, AttributeError):
            return None
        key = (id(call.graph), name)
        if key not in self._bodies:
            self._bodies[key] = _tf.called_function_graph(call, "f")
        return self._bodies[key]

    def match(self, op, slot, analysis):
        body = self._body(op)
        if body is None or len(body.inputs) != len(op.inputs):
            return f"its function {op.name!r} could not be read"
        reads = layouts.consumers(body.inputs[slot])
        if len(reads) != 1:
            return (f"its function reads the weight {len(reads)} times (a rule covers a "
                    "body that reads it once)")
        inner, inner_slot = reads[0]
        registry = self.registry if self.registry is not None else analysis.registry
        rule = None if registry is None else registry.lookup(inner.type)
        if rule is None or inner.type in op_types.CALL_OP_TYPES:
            return (f"its function reads the weight by {inner.name!r} ({inner.type}), which "
                    "has no rule")
        if len(inner.outputs) != 1:
            return f"its function's {inner.name!r} ({inner.type}) has several outputs"
        sources = [layouts.source(t, body) for t in inner.inputs]
        if None in sources:
            other = layouts.past_relayouts(inner.inputs[sources.index(None)]).op
            return (f"its function's {inner.name!r} ({inner.type}) reads a tensor that is "
                    f"not an argument of the function (from {other.name!r}, {other.type})")
        returned = _returned(op, inner, body, analysis)
        if isinstance(returned, str):
            return returned
        chains = [chain for _, chain in sources] + [returned[1]]
        for chain in chains:
            why = chain.mappable()
            if why is not None:
                return f"its function re-lays out a tensor of {inner.name!r}: {why}"
        if all(chain.identity for chain in chains):   # the body op on the call's tensors
            view = CallView(op, inner, [op.inputs[a] for a, _ in sources],
                            op.outputs[returned[0]])
            use = rule.match(view, inner_slot, analysis)
            relaid = None
        else:                                         # on its body tensors, mapped
            relaid = Relaid(tuple(sources), returned, inner_slot, inner)
            view = CallView(op, inner, inner.inputs, inner.outputs[0])
            use = rule.match(view, inner_slot,
                             layouts.MappedAnalysis(analysis, relaid.mapping(op, analysis)))
            if not isinstance(use, str) and relaid.input_index(use.activation) is None:
                return (f"its function's {inner.name!r} ({inner.type}): the rule reads an "
                        "activation that is not one of the op's inputs")
        if isinstance(use, str):
            return f"its function reads it by {inner.name!r} ({inner.type}): {use}"
        if use.rule is not rule:
            use = dataclasses.replace(use, rule=rule)
        if relaid is None:
            return CallUse(op, slot, self, use.activation, use.output, use.weight_shape,
                           use.rows, inner=use)
        activation = op.inputs[sources[relaid.input_index(use.activation)][0]]
        return CallUse(op, slot, self, activation, op.outputs[returned[0]],
                       op.inputs[slot].shape, use.rows, inner=use, relaid=relaid)

    # every quantity: the body rule's, on the call's tensors re-laid-out (`Relaid`)
    def inner(self, use, dZ):
        if use.relaid is None:
            return use.inner, dZ
        return use.relaid.inner(use, dZ)

    def inner_columns(self, use, dZ_columns):
        if use.relaid is None:
            return use.inner, dZ_columns
        return use.relaid.inner(use, None)[0], use.relaid.inner_columns(dZ_columns)

    def outward(self, result, use, leading):
        return result if use.relaid is None else use.relaid.to_weight(result, leading)

    def sum_squared_size(self, use, C, per_example=False):
        # (asked when planning: the body rule's `Use` as matched, no op built)
        return use.inner.rule.sum_squared_size(use.inner, C, per_example)


@dataclasses.dataclass(frozen=True)
class Relaid:
    """The re-layouts between a call's tensors and its body op `inner`
    (`rules._call_layouts`): `sources` (argument index, `Chain`) per input of `inner`,
    `returned` (output index, `Chain`) of its output, `slot` the weight's input,
    `body_op` the body op `inner`."""

    sources: tuple
    returned: tuple
    slot: int
    body_op: object = None

    def mapping(self, call, analysis):
        """{body tensor's ref(): the call's tensor} for the batch-preserving chains (None
        for another chain from a batch-dependent call tensor), for `MappedAnalysis`."""
        mapping = {}
        pairs = [(chain.end, call.inputs[a], chain) for a, chain in self.sources]
        index, chain = self.returned
        pairs.append((chain.start, call.outputs[index], chain))
        for body_tensor, call_tensor, chain in pairs:
            if chain.keeps_batch:
                mapping[body_tensor.ref()] = call_tensor
            elif analysis.value(call_tensor) is not _batch_axis.INDEPENDENT:
                mapping[body_tensor.ref()] = None
        return mapping

    def input_index(self, tensor):
        """The index of the body op's input that is `tensor`, or None."""
        for j, (_, chain) in enumerate(self.sources):
            if chain.end is tensor:
                return j
        return None

    def inner(self, use, dZ):
        """(the body rule's `Use` with the call's tensors re-laid-out as the body op's,
        dZ [B*k, ...] at the call's output in the layout of the body op's output)."""
        call, body_use = use.op, use.inner
        inputs = [layouts.relayout(call.inputs[a], chain.end, chain)
                  for a, chain in self.sources]
        index, chain = self.returned
        output = layouts.relayout(call.outputs[index], chain.start, chain)
        view = CallView(call, self.body_op, inputs, output)
        inner = dataclasses.replace(body_use, op=view,
                                    activation=inputs[self.input_index(body_use.activation)],
                                    output=output)
        return inner, (None if dZ is None else layouts.relayout(dZ, chain.start, chain))

    def inner_columns(self, dZ_columns):
        """[C, B*k, ...] gradient columns at the call's output in the body op's output
        layout, [C, B*k', ...]."""
        _, chain = self.returned
        if chain.identity:
            return dZ_columns
        shape = chain.start.shape.as_list()
        if chain.keeps_batch:
            shape = [-1] + shape[1:]
        return tf.reshape(dZ_columns, _rows.group_shape(_rows.dim(dZ_columns, 0), shape))

    def to_weight(self, gradients, leading):
        """Gradients [*leading, *w_inner] of the body op's weight input as [*leading,
        *w] (the call's weight argument's layout)."""
        _, chain = self.sources[self.slot]
        if chain.identity:
            return gradients
        return layouts.per_group_to(gradients, chain.start, leading)


def _returned(call, inner, body, analysis):
    """(output index, `Chain`) of the one output of `call` that returns `inner`'s output
    (past re-layouts) and is read by an op between the batch and `ys`; the others that
    return it (TensorFlow's rewrite for a gradient of the call) must not be; else why not."""
    found = layouts.returned(inner.outputs[0], body)
    region = getattr(analysis, "region", None)   # the ops between the batch and `ys`
    if found and len(found) > 1 and region is not None:
        found = [(k, chain) for k, chain in found
                 if any(op in region for op in call.outputs[k].consumers())]
    if not found or len(found) != 1:
        return (f"its function does more with the output of {inner.name!r} "
                f"({inner.type}) than return it once")
    return found[0]


def register(registry):
    """Adds the function-call rule to `registry` for both call op types (it looks up
    the body op's rule in the registry the analysis was made with)."""
    registry_lib.register_each(registry, op_types.FUNCTION_CALL_OP_TYPES, FunctionCallRule())

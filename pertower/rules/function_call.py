"""Rule for a weight passed to a function call whose body applies one covered op to it.

Notation (as in `rules.registry`):
    B, G  examples, groups        A  the op's batch-side input       Z  its output
    call  a PartitionedCall or StatefulPartitionedCall (`tf.function`) in the graph of `ys`
    body  the called function's graph; `inner` its op that reads the weight

tf_keras builds a Conv2D with groups > 1 (ConvNeXt's 7x7 depthwise stages with
groups = channels, RegNet's grouped 3x3 convolutions) as a call of a
`tf.function(jit_compile=True)` whose body is `Conv2D(inputs, kernel) -> Identity`: the
weight's value enters the call as an argument, and no rule sees an op reading it.

Identity (the chain rule does not see a function's boundary): when the body's `inner` op
takes every input from an argument of the function (through Identity ops), nothing else
in the body reads the weight's argument, and `inner`'s only output reaches exactly one
output j of the function through Identity ops only (and reaches nothing else), then
    Z_inner = call.outputs[j],   A_inner = the call's input for that argument,
so `inner`'s own rule computes grad_i(w) from the call's tensors and
dZ = d sum(ys) / d call.outputs[j], exactly as for the same op outside a function. The
rule is given a `CallView` of `inner`: its type and attributes are the body op's, its
inputs and output the call's tensors (the body's own tensors are never used), so the
batch-axis analysis of the call (`pertower._batch_axis`, which follows function bodies)
proves the rows of A and Z.

Covered: the reads above, inner any op with a registered rule but a call. Not covered
(the weight falls back, with the reason): a body that does more with the weight or with
inner's output (a bias added inside the function, a second read), or whose inner op has
several outputs or reads a body constant.
"""

import dataclasses

from tensorflow.python.framework import function_def_to_graph  # pylint: disable=no-name-in-module

from pertower import _op_types as op_types
from pertower.rules import registry as registry_lib

__all__ = ["CallView", "CallUse", "FunctionCallRule", "register"]

_PASS_THROUGH = frozenset({"Identity"})


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

    def get_attr(self, name):
        """The body op's attribute `name`."""
        return self._inner.get_attr(name)

    def __getattr__(self, name):   # node_def, op_def, device, ...: the body op's
        return getattr(self._inner, name)

    def __repr__(self):
        return f"<CallView {self.name!r} ({self.type})>"


@dataclasses.dataclass(frozen=True)
class CallUse(registry_lib.Use):
    """A read of a weight by a call whose body's op `inner.op` has a rule: `op` is the
    call, `inner` the body rule's `Use` of the `CallView` (the same A, Z and rows)."""

    inner: object = None


def _through_identities(tensor):
    """The (consumer op, input index) pairs of `tensor` past Identity ops."""
    found = []
    for op in tensor.consumers():
        if op.type in _PASS_THROUGH:
            found.extend(_through_identities(op.outputs[0]))
        else:
            found.extend((op, j) for j, t in enumerate(op.inputs) if t is tensor)
    return found


def _argument_of(tensor, body):
    """The index of the body argument that `tensor` is (past Identity ops), or None."""
    while tensor.op.type in _PASS_THROUGH:
        tensor = tensor.op.inputs[0]
    for index, argument in enumerate(body.inputs):
        if tensor is argument:
            return index
    return None


class FunctionCallRule(registry_lib.Rule):
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
            try:
                function = call.graph._get_function(name)  # pylint: disable=protected-access
                self._bodies[key] = function_def_to_graph.function_def_to_graph(
                    function.cached_definition)
            except (AttributeError, ValueError, TypeError, KeyError):
                self._bodies[key] = None
        return self._bodies[key]

    def match(self, op, slot, analysis):
        body = self._body(op)
        if body is None or len(body.inputs) != len(op.inputs):
            return f"its function {op.name!r} could not be read"
        reads = _through_identities(body.inputs[slot])
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
        arguments = [_argument_of(t, body) for t in inner.inputs]
        if None in arguments:
            return (f"its function's {inner.name!r} ({inner.type}) reads a tensor that is "
                    "not an argument of the function")
        outputs = _through_identities(inner.outputs[0])
        returned = [k for k, t in enumerate(body.outputs)
                    if any(t is o for o in _identity_chain(inner.outputs[0]))]
        if len(returned) != 1 or outputs:
            return (f"its function does more with the output of {inner.name!r} "
                    f"({inner.type}) than return it once")
        view = CallView(op, inner, [op.inputs[a] for a in arguments], op.outputs[returned[0]])
        use = rule.match(view, inner_slot, analysis)
        if isinstance(use, str):
            return f"its function reads it by {inner.name!r} ({inner.type}): {use}"
        if use.rule is not rule:
            use = dataclasses.replace(use, rule=rule)
        return CallUse(op, slot, self, use.activation, use.output, use.weight_shape,
                       use.rows, inner=use)

    def per_group(self, use, dZ, G):
        return use.inner.rule.per_group(use.inner, dZ, G)

    # the optional methods of `Rule`: the body rule's, or the defaults where it has none
    def squared_norms(self, use, dZ, B):
        own = getattr(use.inner.rule, "squared_norms", None)
        return own(use.inner, dZ, B) if callable(own) else None

    def formed_norms(self, use, dZ, G):
        own = getattr(use.inner.rule, "formed_norms", None)
        return own(use.inner, dZ, G) if callable(own) else None

    def sum_squared(self, use, dZ_columns, B, per_example=False):
        own = getattr(use.inner.rule, "sum_squared", None)
        return own(use.inner, dZ_columns, B, per_example) if callable(own) else None

    def sum_squared_size(self, use, C, per_example=False):
        """Numbers per example the body rule's `sum_squared` holds, or None."""
        own = getattr(use.inner.rule, "sum_squared_size", None)
        return own(use.inner, C, per_example) if callable(own) else None

    def clipped_sum(self, use, dZ, factors):
        own = getattr(use.inner.rule, "clipped_sum", None)
        if callable(own):
            return own(use.inner, dZ, factors)
        return registry_lib.default_clipped_sum(use.inner.rule, use.inner, dZ, factors)


def _identity_chain(tensor):
    """`tensor` and every tensor Identity ops make of it."""
    chain = [tensor]
    for op in tensor.consumers():
        if op.type in _PASS_THROUGH:
            chain.extend(_identity_chain(op.outputs[0]))
    return chain


def register(registry):
    """Adds the function-call rule to `registry` for both call op types (it looks up
    the body op's rule in the registry the analysis was made with)."""
    rule = FunctionCallRule()
    for op_type in sorted(op_types.FUNCTION_CALL_OP_TYPES):
        registry.register(op_type, rule)

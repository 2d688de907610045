"""Reads of a weight inside a while loop body, as the engine sees them.

A `LoopUse` is a covered read inside a TF2 `While` body (or a TF1 frame: `FrameUse`
in `pertower.rules._v1_loops`); the engine asks for the tensors to differentiate
(`differentiated`), the loops' per-step output gradients (`output_gradients`) and the
built uses (`concrete_uses`). Both loop kinds import this module; it imports neither.
"""

import dataclasses

from pertower import _op_types as op_types
from pertower.rules import registry as registry_lib

__all__ = ["LoopUse", "concrete_uses", "differentiated", "output_gradients",
           "step_rule_reason"]

# The op types whose own rules read only A, dZ, the weight's shape and the op's
# attributes (not the op's inputs, which a loop body's op cannot hand out of the loop).
_STEP_RULE_OP_TYPES = frozenset({"MatMul", "BiasAdd", "Einsum"}) | op_types.BATCH_MATMUL_OP_TYPES
_STEP_RULE_MODULES = frozenset({"pertower.rules.matmul", "pertower.rules.bias_add",
                                "pertower.rules.einsum", "pertower.rules.batch_matmul"})


def step_rule_reason(target, rule):
    """Why `rule` cannot compute a read by `target` inside a loop from the copy's
    per-step A and dZ (it reads the op's inputs), or None."""
    if target.type in _STEP_RULE_OP_TYPES and type(rule).__module__ in _STEP_RULE_MODULES:
        return None
    return (f"its body reads it by {target.name!r} ({target.type}), whose rule reads the "
            "op's own inputs, which do not leave the loop (the rules of "
            f"{', '.join(sorted(_STEP_RULE_OP_TYPES))} do, per step)")


@dataclasses.dataclass(frozen=True)
class LoopUse(registry_lib.Use):
    """A covered read of a weight inside a while loop body: `op`, `activation` and
    `output` are the body's (A_t, Z_t); `loop` the `LoopCopy` that builds A_all and
    dZ_all; `index` the read's position among the loop's covered reads."""

    loop: object = None
    index: int = 0

    @property
    def label(self):
        """How `explain` names the read: the body op and the loop op."""
        return f"{self.op.name} ({self.op.type}) in {self.loop.op.name!r} per step"

    def concrete(self):
        """The `Use` of A_all, [B*k*T, *a], and the key tensor of dZ_all (built once)."""
        return self.loop.built().uses[self.index]


def concrete_uses(uses):
    """`uses` with every `LoopUse` replaced by its built `Use` (builds the copies)."""
    return [u.concrete() if isinstance(u, LoopUse) else u for u in uses]


def differentiated(use):
    """The tensors whose gradients the engine's one `tf.gradients` call takes for `use`:
    its output Z, or for a read inside a loop the loop's outputs."""
    return use.loop.reached_outputs if isinstance(use, LoopUse) else [use.output]


def output_gradients(loop_uses, found, unconnected):
    """{id(key): dZ_all} for the loop uses, from one backward pass of each loop's copy;
    `found` maps id(t) to the gradient of sum(ys) at t for the loops' outputs (None
    where unconnected)."""
    results = {}
    for loop in dict.fromkeys(use.loop for use in loop_uses):
        results.update(loop.built().output_gradients(
            [found[id(t)] for t in loop.reached_outputs], unconnected))
    return results

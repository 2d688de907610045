"""The loops of one plan whose weights the rules may cover (see `pertower._loops`)."""

from pertower import _context
from pertower import _op_types as op_types
from pertower._loops import frames
from pertower._loops import while_v2

__all__ = ["Loops"]

_UNCHANGED = frozenset({"Identity", "Snapshot"})
# Public functions that read the plan's uses themselves (not through the engine), where a
# TF1 frame's weights keep their row passes.
_CURVATURE_CALLERS = frozenset({"sum_grad_squared", "diag_ggn", "kfac_factors"})


class Loops:
    """The loops of one plan whose weights the rules may cover (one `WhileLoop` per
    While op and one `Frame` per TF1 frame, each analysed once)."""

    def __init__(self, request, analysis, registry):
        self.request = request
        self.analysis = analysis
        self.registry = registry
        self._while_loops = {}
        self._frames = {}      # by frame name

    def frame_uses(self, enter, fallback):
        """The uses of the weight that the TF1 loop op `enter` (Enter) takes into its
        frame, or `fallback` (why the weight is not covered) with the frame's reason."""
        if _context.name() in _CURVATURE_CALLERS:   # they read plan.uses' A and Z directly
            return (f"{fallback}: {_context.name()} does not take a loop's per-step reads "
                    "(row passes)")
        name = enter.get_attr("frame_name").decode()
        if name not in self._frames:
            self._frames[name] = frames.Frame(enter, name, self)
        found = self._frames[name].weight_uses(enter)
        return f"{fallback}: {found}" if isinstance(found, str) else found

    def uses(self, reads, fallback):
        """The `LoopUse`s of the weight of `reads` (a `WeightReads`) inside the loops
        it is passed to as a resource handle (TF2 loops, and TF1 frames: `fallback(op)`
        gives the reason the weight is not covered in those), or a string saying why
        they are not covered."""
        found = []
        for enter in reads.loop_inputs:
            uses = self.frame_uses(enter, fallback(enter))
            if isinstance(uses, str):
                return uses
            found.extend(uses)
        for op, index in reads.call_inputs:
            if op.type not in op_types.WHILE_OP_TYPES:
                return (f"it is read inside the function body of {op.name!r} ({op.type}), "
                        "where no rule looks")
            uses = self._loop_uses(op, index)
            if isinstance(uses, str):
                return uses
            found.extend(uses)
        return found

    def inner_uses(self, exit_, fallback):
        """For a weight's value passed to a loop (an exit edge of its weight-only region,
        `rules._weight_functions.Exit`, into a TF1 Enter or a TF2 While): its uses inside,
        or a string saying why they are not covered; None for any other op."""
        op = exit_.op
        # a reference variable's value comes through its snapshot (Identity)
        changed = [o for o in exit_.through if o.type not in _UNCHANGED]
        if op.type in op_types.V1_ENTER_OP_TYPES:
            return fallback(op) if changed else self.frame_uses(op, fallback(op))
        if op.type in op_types.WHILE_OP_TYPES:
            if changed:
                return (f"it is passed to the while loop {op.name!r} ({op.type}) through "
                        + ", ".join(f"{o.name!r} ({o.type})" for o in exit_.through))
            return self._loop_uses(op, exit_.slot)
        return None

    def _loop_uses(self, op, index):
        if op not in self._while_loops:
            self._while_loops[op] = while_v2.WhileLoop(op, self)
        uses = self._while_loops[op].weight_uses(index)
        if isinstance(uses, str):
            return f"it is read inside the while loop {op.name!r} ({op.type}): {uses}"
        return uses

"""Graph walking: what `ys` depends on, where the batch enters, what a replay must copy
(where weights are read: `pertower._weight_reads`).

Notation (used in every core module):
    B   examples in the batch          T   towers (B per-example, M microbatches)
    P   weights (scalar parameters)    ys  per-example values, [B, ...]
    x   one entry of `xs` (a weight)   S   the ops replayed in every tower

S is every op that `ys` depends on (through data edges) and that depends on a batch
tensor or on a read of a weight (gathers and function calls of its handle included);
the other ops are shared by all towers as they are.
"""

import tensorflow as tf

from pertower import _context
from pertower import _op_types as op_types
from pertower import _tf

__all__ = ["OpRegion", "static_batch_size", "upstream_ops", "downstream_ops",
           "find_batch_tensors", "v1_loop_frames", "check_replayable",
           "draws_random_numbers", "random_ops", "placeholders_left_out"]


def placeholders_left_out(ops, batch):
    """The placeholders among `ops` with a non-static axis 0 that are not in `batch`, by
    name: labels left out of `batch=` (or side inputs such as class weights)."""
    given = {b.name for b in batch}
    return sorted((op.outputs[0] for op in ops if op.type == "Placeholder"
                   and op.outputs[0].name not in given and op.outputs[0].shape.rank
                   and op.outputs[0].shape.as_list()[0] is None), key=lambda t: t.name)


def static_batch_size(tensor, axis=0):
    """The static size of axis `axis` as an int, or None (also for TF1 Dimensions)."""
    if tensor.shape.rank is None or tensor.shape.rank <= axis:
        return None
    return tf.compat.dimension_value(tensor.shape[axis])


def upstream_ops(tensors):
    """All ops that `tensors` depend on through data edges, their own ops included."""
    seen = set()
    stack = [t.op for t in tensors]
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        stack.extend(t.op for t in op.inputs)
    return seen


class OpRegion(frozenset):
    """A frozen set of ops (those `ys` depends on) that indexes each member's consumers
    among its members the first time a walk asks (one index for every weight's walk)."""

    def consumers_within(self):
        """{op: (its consumers that are members, ...)} for every member."""
        index = self.__dict__.get("_consumers")
        if index is None:
            index = {op: tuple(c for out in op.outputs for c in out.consumers() if c in self)
                     for op in self}
            self.__dict__["_consumers"] = index
        return index



def downstream_ops(tensors, within):
    """Ops in `within` that consume `tensors`, directly or through other such ops (with
    the index of an `OpRegion` when `within` is one)."""
    index = within.consumers_within() if isinstance(within, OpRegion) else None
    seen = set()
    stack = [op for t in tensors for op in t.consumers()]
    while stack:
        op = stack.pop()
        if op in seen or op not in within:
            continue
        seen.add(op)
        stack.extend(index[op] if index is not None
                     else [c for out in op.outputs for c in out.consumers()])
    return seen


def find_batch_tensors(ys, ys_upstream):
    """The placeholders and iterator outputs of rank >= 1 that `ys` depends on (one of
    unknown rank only when it is the only candidate). Raises ValueError when there are
    none, when their static batch sizes disagree, or for a `sparse_placeholder`."""
    candidates, shapeless, sparse_parts = [], [], {}
    names = {op.name for op in ys_upstream if op.type in op_types.BATCH_SOURCE_OP_TYPES}
    for op in ys_upstream:
        if op.type not in op_types.BATCH_SOURCE_OP_TYPES:
            continue
        head, _, tail = op.name.rpartition("/")
        if (op.type.startswith("Placeholder") and tail in ("indices", "values", "shape")
                and {f"{head}/indices", f"{head}/values"} <= names):
            sparse_parts.setdefault(head, []).append(op.outputs[0])
            continue
        for out in op.outputs:
            rank = out.shape.rank
            if out.dtype == tf.resource:
                continue
            if rank is None:
                shapeless.append(out)
            elif rank >= 1:
                candidates.append(out)
    if sparse_parts:
        head = sorted(sparse_parts)[0]
        raise _context.error(
            ValueError, f"`ys` ({ys.name}) depends on the sparse placeholder {head!r} (its "
            f"{head}/indices and {head}/values), whose axis 0 counts the non-zero entries, "
            "not the examples, so the batch cannot be split by example. Feed its ids as a "
            "dense [B, n] placeholder (padded, e.g. with -1) and build the SparseTensor in "
            "the graph (tf.sparse.from_dense, or tf.sparse.retain of the non-padding "
            "entries); then pass `batch=` that dense placeholder and the other per-example "
            "tensors.")
    order = _tf.op_order_key()
    key = lambda t: (order(t.op), t.value_index)
    candidates.sort(key=key)
    shapeless.sort(key=key)
    if shapeless and candidates:
        listing = ", ".join(t.name for t in shapeless)
        raise _context.error(
            ValueError, f"`ys` ({ys.name}) depends on the placeholder(s) {listing} of unknown "
            "shape, besides the batch tensors "
            f"({', '.join(t.name for t in candidates)}); whether they carry the batch "
            "cannot be told. Pass `batch=` the tensor(s) that carry the batch on axis 0, "
            "or give those placeholders a shape (shape=[] for a scalar).")
    if shapeless and not candidates:
        candidates = shapeless
    if not candidates:
        raise _context.error(
            ValueError, f"`ys` ({ys.name}) depends on no placeholder or tf.data iterator "
            "output with a batch axis, so the batch could not be found. Pass "
            "`batch=` the tensor(s) that carry the batch on axis 0.")
    sizes = {static_batch_size(t) for t in candidates} - {None}
    if len(sizes) > 1:
        listing = ", ".join(f"{t.name} {t.shape}" for t in candidates)
        raise _context.error(
            ValueError, f"the batch is ambiguous: `ys` depends on inputs whose first axes "
            f"differ ({listing}). Pass `batch=` the tensor(s) that carry the batch on "
            "axis 0 (and `batch_axis=` for one whose batch is on another axis).")
    return candidates


def _outermost_loop(op):
    """The outermost TF1 while loop context `op` was built in, or None."""
    context = _tf.control_flow_context(op)
    found = None
    while context is not None:
        if context.IsWhileContext():
            found = context
        context = context.outer_context
    return found


def v1_loop_frames(replayed_ops, ys_upstream):
    """The ops of `ys_upstream` in the TF1 (v1) while loops that `replayed_ops` touch,
    whole frames (known by their while context or their Enter ops' frame names), the
    ops these read as control inputs, and the TensorArrays they write."""
    if not any(op.type in op_types.V1_LOOP_OP_TYPES for op in replayed_ops):
        return set()
    contexts = {_outermost_loop(op) for op in replayed_ops} - {None}
    names = {op.get_attr("frame_name") for op in replayed_ops
             if op.type in op_types.V1_ENTER_OP_TYPES}
    frames = set()
    for op in ys_upstream:
        if _outermost_loop(op) in contexts:
            frames.add(op)
        elif op.type in op_types.V1_ENTER_OP_TYPES and op.get_attr("frame_name") in names:
            frames.add(op)
    # A constant in a TF1 cond inside the loop reads the cond's pivot (switch_t) as a
    # control input only: its copy must read the copied pivot, or it stays in the
    # original frame ("has inputs from different frames").
    stack = [c for op in frames for c in op.control_inputs]
    while stack:
        op = stack.pop()
        if op in frames or _outermost_loop(op) not in contexts:
            continue
        frames.add(op)
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    # A TensorArray of a size that does not depend on the batch (raw_rnn's inputs
    # unstacked into tf.TensorArray(size=T)) is not downstream of the batch, but each
    # copy must write its own: one array written by every copy fails ("already read").
    frames |= {t.op for op in set(replayed_ops) | frames for t in op.inputs
               if t.op.type in op_types.TENSOR_ARRAY_OP_TYPES}
    return frames


def check_replayable(replayed_ops, forward_only=False):
    """Raises for TF1 (v1) while loops among the replayed ops, unless the replay is
    `forward_only` (no gradient is built through it)."""
    if forward_only:
        return
    for op in sorted(replayed_ops, key=_tf.op_order_key()):
        if op.type in op_types.V1_LOOP_OP_TYPES:
            raise _context.error(
                NotImplementedError, f"`ys` depends on the TF1 (v1) while loop around op "
                f"{op.name!r} ({op.type}), between the batch and `ys`. Towers with weight "
                "copies cannot replay v1 while loops: their gradients need the Python-side "
                "loop context that tf.while_loop attached to the original ops, which a "
                "replayed copy does not have. pertower.per_example_gradients (and the "
                "other gradient functions) compute such weights with one backward pass of "
                "the original graph per example instead; or build the model with control "
                "flow v2 (tf.compat.v1.enable_control_flow_v2() before building it) to "
                "use towers.")


def draws_random_numbers(op_type):
    """Whether ops of type `op_type` draw new random numbers on every run."""
    op_def = _tf.op_def(op_type)
    return op_def is not None and op_def.is_stateful and "Random" in op_type


def random_ops(replayed_ops):
    """Stateful random ops among the replayed ops (for example dropout in training)."""
    return sorted((op for op in replayed_ops if draws_random_numbers(op.type)),
                  key=_tf.op_order_key())

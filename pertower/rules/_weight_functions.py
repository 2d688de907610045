"""Weights read through functions of the weights alone, pulled back from a rule's op.

Notation: G groups (as in `rules.registry`); x one weight (entry of xs); u the tensor at
a rule's weight input, u = f(x, other weights, constants); P the rule's per-group
gradients with respect to u, [G, *u.shape].

Between a variable and the op a rule covers there may be ops whose other inputs are the
same for one example alone as for the batch (`SameAlone`: INDEPENDENT, or sizes of axes
other than the batch's): `mixed_float16`'s Cast, weight normalization's g·v/||v||, a
non-fused batch norm's scale and shift, a partitioned weight's ConcatV2, tanh(W),
Transpose, Reshape, a learned position table's gather(W, range(T)) or W[:T]. `exits`
follows x's reads through such ops to the edges where they reach an op that takes the
batch ("exits"); `WeightFunctionRule` wraps the rule of each exit.

Identity (the chain rule across the cut of the exit edges): every path from x to `ys`
leaves the weight-only region through exactly one exit edge e, so with u_e its tensor
    grad_i(x) = sum_e (du_e/dx)^T rule_e(example i) = sum_e VJP_e(P_e[i]),
VJP_e(p) = tf.gradients(u_e, reads of x, grad_ys=p). The [G] pull-backs are the inverse
of each op applied to [G, ...] (re-layouts, Casts, ConcatV2 slices, gathers), or one
`tf.gradients` of the chain rebuilt on [G, ...] copies of x (elementwise chains), or a
`tf.vectorized_map` of the VJP. The clipped sum is ONE VJP of the rule's clipped sum
(linearity). Squared norms: a chain of re-layouts keeps the entries, so the rule's cheap
norm is exact; any other chain forms the pulled-back gradients.

Not covered (the weight falls back, with the reason): a weight-only op that is stateful,
random or depends on one (DropConnect's mask: the one-example loop would draw it once
per example), that calls functions or is v1 control flow, or has no registered gradient.
"""

import dataclasses

import tensorflow as tf

from pertower import _batch_axis
from pertower import _op_types as op_types
from pertower import _tf
from pertower._batch_axis import static
from pertower._layout import _rows
from pertower.rules import broadcast
from pertower.rules import registry as registry_lib

__all__ = ["Exit", "SameAlone", "exits", "follow", "is_reorder", "WeightFunctionRule", "wrap"]

# Ops that pass a weight on with the same entries in the same order (one weight input,
# slot 0, the others static): the rule's result is only reshaped.
_REORDER_FREE = op_types.WEIGHT_LAYOUT_OP_TYPES
# Ops inverted directly on [G, ...] (else: the vectorized VJP).
_DIRECT = _REORDER_FREE | {"Transpose", "Cast", "ConcatV2"}
# Ops computed entry by entry (with broadcasting): pulled back by `_batched_vjp`. Not
# AddN, Betainc or the *Grad ops, whose inputs must have equal shapes.
_UNARY_ELEMENTWISE = op_types.ELEMENTWISE_OP_TYPES - {"EnsureShape", "PlaceholderWithDefault"}
_BROADCASTING = frozenset(broadcast.OP_TYPES)
# Ops that read a variable: the one stateful kind allowed upstream of a weight-only op.
_VARIABLE_OP_TYPES = frozenset({"ReadVariableOp", "VarHandleOp", "VariableV2", "Variable"})
_READS = _VARIABLE_OP_TYPES | op_types.HANDLE_GATHER_OP_TYPES
# Ops never followed: functions and v1 control flow (their gradients need more than the op)
_NOT_FOLLOWED = (op_types.CALL_OP_TYPES | op_types.V1_LOOP_OP_TYPES
                 | op_types.V1_SWITCH_OP_TYPES | op_types.V1_MERGE_OP_TYPES)


@dataclasses.dataclass(frozen=True)
class Exit:
    """One edge out of a weight's weight-only region: input `slot` of `op` holds u;
    `through` the weight-only ops between x's reads and u (by creation), `sources` the
    reads of x that u depends on (values, or the handles of ResourceGathers),
    `reorder_only` whether `through` only re-lays-out x, `shape` x's shape."""

    op: tf.Operation
    slot: int
    through: tuple
    sources: tuple
    reorder_only: bool
    shape: tf.TensorShape


def is_reorder(op, slots):
    """Whether `op` (reading the weight at `slots`) passes its entries on unchanged."""
    return (op.type in _REORDER_FREE and slots == [0] and
            op.outputs[0].shape.is_fully_defined() and
            all(_batch_axis.static_value(t) is not None for t in op.inputs[1:]))


def _unfollowable(op, graph_inputs):
    """Why the weight-only op `op` cannot be pulled back through, or None."""
    if op.op_def.is_stateful and op.type not in op_types.HANDLE_GATHER_OP_TYPES:
        return "is stateful"
    try:
        _tf.gradient_function(op)
    except LookupError:
        return "has no registered gradient"
    stack, seen = list(graph_inputs), set()
    while stack:                       # what the op's other inputs are computed from
        source = stack.pop().op
        if source in seen:
            continue
        seen.add(source)
        if source.type in _VARIABLE_OP_TYPES or source.type in op_types.SHAPE_OP_TYPES:
            continue
        if source.type in op_types.RANDOM_OP_TYPES or source.op_def.is_stateful:
            return (f"depends on {source.name!r} ({source.type}), a random or stateful op "
                    "(the one-example loop would run it once per example)")
        stack.extend(source.inputs)
    return None


class SameAlone:
    """Whether a tensor has the same value for one example alone as for the batch (the
    weight side): INDEPENDENT, or SIZE computed from shape entries that do not follow B
    (the sequence length T of `tf.range(tf.shape(x)[1])`)."""

    def __init__(self, analysis):
        self.analysis = analysis
        self.shape_value = static.ShapeEvaluator(analysis.value)
        self.memo = {}

    def __call__(self, tensor):
        value = self.analysis.value(tensor)
        if value is _batch_axis.INDEPENDENT:
            return True
        if value is not _batch_axis.SIZE:
            return False
        if tensor.ref() not in self.memo:
            self.memo[tensor.ref()] = False   # guards against cycles
            entries = self.shape_value(tensor) if tensor.dtype.is_integer else None
            op = tensor.op
            self.memo[tensor.ref()] = (
                entries is not None and all(power == 0 for _, power in entries)) or (
                op.type not in op_types.SHAPE_OP_TYPES and bool(op.inputs) and
                (op.type in _READS or not op.op_def.is_stateful) and
                all(self(t) for t in op.inputs))
        return self.memo[tensor.ref()]


def follow(op, slots, same_alone):
    """How a weight read at inputs `slots` of `op` goes on: "reorder" (a re-layout,
    `is_reorder`), "function" (a function of the weights alone: every input the same for
    one example alone as for the batch, `same_alone` a `SameAlone`, and pulled back
    through), "exit" (an op that takes the batch, a function call or v1 control flow: a
    rule reads the weight there), or a string saying why a function of the weights alone
    cannot be pulled back. The one criterion of the weight side, here and in loop bodies
    (`pertower._loops.uses`)."""
    if is_reorder(op, slots):
        return "reorder"
    if op.type in _NOT_FOLLOWED or not all(same_alone(t) for t in op.inputs):
        return "exit"
    why = _unfollowable(op, [t for j, t in enumerate(op.inputs) if j not in slots])
    return "function" if why is None else why


def exits(reads, ys_upstream, analysis):
    """The exit edges of the weight of `reads` (a `WeightReads`): a list of `Exit`, or
    a string saying why the weight cannot be followed. A ResourceGather by ids that are
    the same for one example alone (a learned position table's `tf.range(T)`) is a
    weight-only op read through the handle; by the batch's ids, an exit."""
    sources = list(reads.read_tensors)
    shape = tf.TensorShape(reads.x.shape)
    same_alone = SameAlone(analysis)
    followed = set()               # weight-only ops reached from x's reads
    reorder = set()                # those of them that only re-lay-out
    found = {}                     # (op, slot) -> None, in discovery order
    stack, seen = list(sources), set()
    for op in reads.gather_ops:
        if isinstance(reads.x, tf.Variable) and follow(op, [0], same_alone) == "function":
            sources.append(op.inputs[0])
            followed.add(op)
            stack.append(op.outputs[0])
        else:
            found[(op, 0)] = None
    while stack:
        tensor = stack.pop()
        if tensor.ref() in seen:
            continue
        seen.add(tensor.ref())
        for op in tensor.consumers():
            if op not in ys_upstream or op in followed:
                continue
            slots = [j for j, t in enumerate(op.inputs) if t is tensor]
            how = follow(op, slots, same_alone)
            if how == "reorder":
                reorder.add(op)
            elif how == "exit":
                for j in slots:
                    found.setdefault((op, j), None)
                continue
            elif how != "function":
                return (f"it is read by {op.name!r} ({op.type}), a function of the "
                        f"weights alone that {how}")
            followed.add(op)
            stack.extend(t for t in op.outputs if t.dtype.is_floating or t.dtype.is_complex)
    result = []
    for op, slot in found:
        through, used = _region(op.inputs[slot], followed, sources)
        result.append(Exit(op, slot, through, tuple(used),
                           all(o in reorder for o in through), shape))
    return result


def _region(u, followed, sources):
    """(the followed ops u is computed from, sorted; the reads of x among its inputs)."""
    through, used, stack, seen = set(), [], [u], set()
    while stack:
        tensor = stack.pop()
        if tensor.ref() in seen:
            continue
        seen.add(tensor.ref())
        if any(tensor is s for s in sources):
            used.append(tensor)
        elif tensor.op in followed:
            through.add(tensor.op)
            stack.extend(tensor.op.inputs)
    return tuple(sorted(through, key=_tf.op_order_key())), used


def wrap(use, exit_):
    """The `Use` of x through the exit `exit_` whose rule's `Use` (of u) is `use`."""
    rule = WeightFunctionRule(use, exit_)
    return registry_lib.Use(use.op, use.slot, rule, use.activation, use.output, exit_.shape,
                            use.rows, through=exit_.through)


class WeightFunctionRule(registry_lib.ForwardingRule):
    """The rule of one exit, pulled back to x through the weight-only ops before it.
    Made per use by `wrap` (it holds the inner use), or with `u` given for a pull-back
    alone (`pertower._loops.placements.Function`); never registered."""

    def __init__(self, inner, exit_, u=None):
        self.inner_use, self.exit = inner, exit_
        self.u = exit_.op.inputs[exit_.slot] if u is None else u
        self.steps = _direct_steps(self.u, exit_)
        self.elementwise = None if self.steps is not None else _elementwise_rank(exit_)

    def match(self, op, slot, analysis):   # made by `wrap`, never matched
        raise NotImplementedError

    def inner_per_group(self, dZ, G):
        """The wrapped rule's [G, *u.shape], before the pull-back to x."""
        return self.inner_use.rule.per_group(self.inner_use, dZ, G)      # [G, *u.shape]

    def inner(self, use, dZ):
        return self.inner_use, dZ

    def outward(self, result, use, leading):
        if leading:                                  # [G, *u.shape] -> [G, *x.shape]
            return self.pull_back(result)
        u_shape = self.inner_use.weight_shape
        part = tf.reshape(result, u_shape.as_list() if u_shape.is_fully_defined()
                          else tf.shape(self.u))                            # [*u.shape]
        if self.steps is not None:
            return self.pull_back(part[None])[0]
        return self._vjp(part)                                              # [*x.shape]

    def pull_back(self, P):
        """[G, *u.shape] -> [G, *x.shape]: the VJP of each row."""
        if self.steps is not None:
            for step in self.steps:
                P = step(P)
            return P
        if self.elementwise is not None:
            return self._batched_vjp(P)
        return tf.vectorized_map(self._vjp, P)

    def _batched_vjp(self, P):
        """[G, *u.shape] -> [G, *x.shape] for an elementwise chain: the chain rebuilt on
        G copies of each read of x, [G, 1, ..., *x.shape] (the other inputs broadcast
        against the trailing axes), and ONE tf.gradients with P as grad_ys."""
        R, G = self.elementwise, _rows.dim(P, 0)
        batched = {}
        for source in self.exit.sources:
            dims = source.shape.as_list()
            pad = [1] * (R - len(dims))
            batched[source.ref()] = tf.broadcast_to(
                tf.reshape(source, [1] + pad + dims),
                _rows.group_shape(G, pad + dims))                     # [G, 1.., *x.shape]
        for op in self.exit.through:
            inputs = [batched.get(t.ref(), t) for t in op.inputs]
            copy = broadcast.copy_op(op, inputs)
            batched[op.outputs[0].ref()] = copy.outputs[0]
        u_b = batched[self.u.ref()]                                   # [G, 1.., *u.shape]
        sources = [batched[s.ref()] for s in self.exit.sources]
        grads = tf.gradients(u_b, sources, grad_ys=tf.reshape(P, tf.shape(u_b)))
        x_shape = _rows.group_shape(G, self.exit.sources[0].shape.as_list())
        parts = [tf.reshape(g, x_shape) for g in grads if g is not None]
        return tf.add_n(parts) if parts else tf.zeros(x_shape, self.exit.sources[0].dtype)

    def _vjp(self, p):
        """[*u.shape] -> [*x.shape]: d<p, u>/dx over every read of x."""
        grads = tf.gradients(self.u, self.exit.sources, grad_ys=p)
        parts = [tf.convert_to_tensor(g) for g in grads if g is not None]
        return tf.add_n(parts) if parts else tf.zeros_like(self.exit.sources[0])

    def squared_norms(self, use, dZ, B):
        # a re-layout keeps the norms; another function of x does not
        if not all(op.type in _REORDER_FREE | {"Transpose"} for op in self.exit.through):
            return None
        return super().squared_norms(use, dZ, B)

    # squares do not pull back through a linear map: formed from `per_group` instead
    def formed_norms(self, use, dZ, G):
        return None

    def sum_squared(self, use, dZ_columns, B, per_example=False):
        return None

    def sum_squared_size(self, use, C, per_example=False):
        return None


def _elementwise_rank(exit_):
    """R, the largest rank in an elementwise chain (every op of `through` elementwise
    with broadcasting, one output, static ranks), or None."""
    ranks = [0]
    for op in exit_.through:
        if len(op.outputs) != 1 or not (
                op.type in _BROADCASTING or
                (op.type in _UNARY_ELEMENTWISE and len(op.inputs) == 1)):
            return None
        for t in list(op.inputs) + list(op.outputs):
            if t.shape.rank is None:
                return None
            ranks.append(t.shape.rank)
    if not all(s.shape.is_fully_defined() for s in exit_.sources):
        return None
    return max(ranks)


def _direct_steps(u, exit_):
    """The inverses, applied in order to P [G, *u.shape], of a chain of re-layouts,
    Casts and ConcatV2 slices from one read of x to u; None when u is another
    function of x (or a shape is not static)."""
    steps, tensor = [], u
    inside = set(exit_.through)
    while not any(tensor is s for s in exit_.sources):
        op = tensor.op
        if op not in inside or op.type not in _DIRECT:
            return None
        from_x = [j for j, t in enumerate(op.inputs)
                  if t.op in inside or any(t is s for s in exit_.sources)]
        if len(from_x) != 1 or not op.inputs[from_x[0]].shape.is_fully_defined():
            return None
        step = _inverse(op, from_x[0], exit_.shape)
        if step is None:
            return None
        steps.append(step)
        tensor = op.inputs[from_x[0]]
    return steps


def _inverse(op, slot, x_shape):
    """[G, *op.outputs[0].shape] -> [G, *op.inputs[slot].shape] (x_shape for a
    resource handle), or None."""
    source = op.inputs[slot]
    dims = (x_shape if source.dtype == tf.resource else source.shape).as_list()
    if op.type in ("GatherV2", "ResourceGather"):
        if (slot != 0 or ("batch_dims" in op.node_def.attr and op.get_attr("batch_dims"))
                or (op.type == "GatherV2" and _batch_axis.static_value(op.inputs[2]) != 0)):
            return None
        ids = tf.reshape(op.inputs[1], [-1])                                 # [n]
        swap = [1, 0] + list(range(2, len(dims) + 1))
        return lambda P: tf.transpose(tf.math.unsorted_segment_sum(
            tf.transpose(tf.reshape(P, [_rows.dim(P, 0), -1] + dims[1:]), swap),  # [n, G, ..]
            ids, dims[0]), swap)                    # [G, *ids, *rest] -> [G, V, *rest]
    if op.type in _REORDER_FREE:
        return lambda P: tf.reshape(P, [-1] + dims)
    if op.type == "Cast":
        if not (source.dtype.is_floating and op.outputs[0].dtype.is_floating):
            return None
        return lambda P: tf.cast(P, source.dtype)
    if op.type == "Transpose":
        perm = _batch_axis.static_value(op.inputs[1])
        if perm is None or slot != 0:
            return None
        inverse = sorted(range(len(perm)), key=lambda i: int(perm[i]))   # perm's argsort
        return lambda P: tf.transpose(P, [0] + [1 + i for i in inverse])
    if op.type == "ConcatV2":
        axis = _batch_axis.static_value(op.inputs[-1])
        if axis is None or slot == len(op.inputs) - 1:
            return None
        rank = len(dims)
        axis = int(axis) % rank
        before = op.inputs[:slot]
        if not all(t.shape.is_fully_defined() for t in before):
            return None
        offset = sum(t.shape.as_list()[axis] for t in before)
        begin = [0] * (rank + 1)
        begin[axis + 1] = offset
        return lambda P: tf.slice(P, begin, [-1] + dims)
    return None

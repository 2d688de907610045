"""Gradients the user wrote in Python (`tf.custom_gradient`, `gradient_override_map`):
build one on its own, and prove it keeps the examples' rows apart.

Notation: op an op whose `_gradient_op_type` attribute names the user's function in
TensorFlow's gradient registry; dy the gradients at op's outputs, [B, ...] each.

`override_backward` builds op's backward once (the function called with op and dy
placeholders) in a scratch `FuncGraph` whose outer graph is op's (the user's graph is
not changed; the tensors it reads are captured as placeholders). The towers copy it
(`pertower._towers.python_gradients`); `not_row_wise` runs the batch-axis analysis on
it with the batch and dy as the examples' rows: when row i of each input's gradient
depends on example i alone (swish's backward), rules may serve the weights behind op.
"""

import dataclasses
import dis
import types

import tensorflow as tf

from pertower import _batch_axis
from pertower import _context
from pertower import _graph_walk as graph_walk
from pertower import _op_types as op_types
from pertower import _tf

__all__ = ["OVERRIDE_ATTR", "OverrideBackward", "Templates", "override_backward", "kind",
           "not_row_wise"]

# The attribute `gradient_override_map` (and `tf.custom_gradient`) sets on an op.
OVERRIDE_ATTR = op_types.GRADIENT_OVERRIDE_ATTR


@dataclasses.dataclass(frozen=True)
class OverrideBackward:
    """The backward pass of an overridden op, built on dy placeholders in a scratch
    graph (never run): `op`, the scratch `graph`, `dys` (one placeholder per output),
    `grads` (one tensor, IndexedSlices or None per input), `ops` (those the function
    added), `captured` ((scratch placeholder, the user's tensor) pairs)."""

    op: tf.Operation
    graph: object
    dys: tuple
    grads: tuple
    ops: tuple
    captured: tuple


def kind(op):
    """The name op's gradient is registered under."""
    name = op.get_attr(OVERRIDE_ATTR)
    return name.decode(errors="replace") if isinstance(name, bytes) else str(name)


def _said(op):
    return (f"the gradient of op {op.name!r} ({op.type}) is overridden ({kind(op)!r}, by "
            "gradient_override_map or tf.custom_gradient)")


def override_backward(op, scope="pertower_python_gradient", templates=None):
    """The `OverrideBackward` of `op` (built, or reused from `templates`); raises
    ValueError when the function is not registered or building it raised."""
    try:
        return (templates or Templates()).backward(op, scope)
    except _Unbuilt as error:
        raise _context.error(ValueError, str(error)) from error.__cause__


class _Unbuilt(Exception):
    """An override that could not be built on its own (the message says why)."""


def _build(op, scope):
    """Builds op's `OverrideBackward`; raises `_Unbuilt`."""
    try:
        gradient_function = _tf.registered_gradient(kind(op))
    except LookupError as error:
        raise _Unbuilt(f"{_said(op)} by a function that is not registered; register it "
                       "with tf.RegisterGradient.") from error
    with op.graph.as_default():   # the scratch graph's outer graph is op's
        scratch = _tf.FuncGraph(scope)
    try:
        with scratch.as_default():
            dys = tuple(tf.compat.v1.placeholder(t.dtype, t.shape, name="dy")
                        for t in op.outputs)
            grads = gradient_function(op, *dys)
    except Exception as error:  # pylint: disable=broad-except  # the user's code may raise anything
        raise _Unbuilt(f"{_said(op)}, and building it on its own failed "
                       f"({type(error).__name__}: {error}). Leave the weights behind this op "
                       "out of `xs`.") from error
    grads = tuple(grads) if isinstance(grads, (list, tuple)) else (grads,)
    captured = tuple((inner, outer) for outer, inner in scratch.captures)
    if any(not isinstance(outer, tf.Tensor) or outer.graph is not op.graph
           for _, outer in captured):
        raise _Unbuilt(f"{_said(op)}, and its backward reads something other than the "
                       "tensors of op's graph. Leave the weights behind this op out of "
                       "`xs`.")
    placeholders = {inner.op for inner, _ in captured}
    made = tuple(o for o in scratch.get_operations() if o not in placeholders)
    return OverrideBackward(op=op, graph=scratch, dys=dys, grads=grads, ops=made,
                            captured=captured)


class Templates:
    """The backward passes of overridden ops, each computation built once.

    `tf.custom_gradient` registers one function per call (tf_keras' swish: one per
    activation), closures over the same code. Two ops share a scratch graph when their
    functions never read `op` and are, through closures and defaults, the same code over
    the same values (a tensor stands for its position among op's inputs and outputs),
    and the ops have the same type, dtypes and static shapes; the second op's backward
    is the first's with its own tensors in `captured`. `built` counts the builds.
    """

    def __init__(self):
        self._by_key = {}   # key -> (OverrideBackward of the first op, capture positions)
        self.built = 0
        # (id(grad), ids of the seeds, their axes, B) -> (grad, why not row-wise or None)
        self.verdicts = {}

    def backward(self, op, scope):
        """op's `OverrideBackward`, built or reused. Raises `_Unbuilt`."""
        where, seen = _positions_of(op), set()
        key = _template_key(op, seen)
        if key is not None and key in self._by_key:
            first, positions = self._by_key[key]
            own = {"in": op.inputs, "out": op.outputs}
            captured = tuple((inner, outer if at is None else own[at[0]][at[1]])
                             for (inner, outer), at in zip(first.captured, positions))
            return dataclasses.replace(first, op=op, captured=captured)
        backward = _build(op, scope)
        self.built += 1
        positions = tuple(where.get(id(outer)) for _, outer in backward.captured)
        # a capture at a position reached otherwise than through the closures (a
        # global, a walk of the graph) would not move with the op: built per op
        if key is not None and all(at is None or id(outer) in seen for (_, outer), at
                                   in zip(backward.captured, positions)):
            self._by_key[key] = (backward, positions)
        return backward


class _NoKey(Exception):
    """A value `_template_key` cannot compare by content."""


_SCALARS = (type(None), bool, int, float, complex, str, bytes)
_MAX_KEY_DEPTH = 8


def _positions_of(op):
    """{id(tensor): ("in", i) or ("out", i)} for op's inputs and outputs (first one)."""
    where = {}
    for side, tensors in (("in", op.inputs), ("out", op.outputs)):
        for i, t in enumerate(tensors):
            where.setdefault(id(t), (side, i))
    return where


def _template_key(op, seen):
    """A key equal for two ops exactly when `Templates` may share their backward, or
    None; `seen` gets the ids of the tensors the closures hold."""
    try:
        function = _tf.registered_gradient(kind(op))
    except LookupError:
        return None
    if not isinstance(function, types.FunctionType) or _reads_op(function.__code__):
        return None
    where = _positions_of(op)
    tensors = list(op.inputs) + list(op.outputs)
    signature = tuple((where[id(t)], t.dtype.name, None if t.shape.rank is None
                       else tuple(t.shape.as_list())) for t in tensors)
    try:
        return (op.type, len(op.inputs), signature, _value_key(function, where, 0, seen))
    except _NoKey:
        return None


def _reads_op(code):
    """Whether a registered gradient function may read its first argument (`op`)."""
    if code.co_argcount == 0 or "locals" in code.co_names or "vars" in code.co_names:
        return True
    first = code.co_varnames[0]
    return first in code.co_cellvars or any(
        ins.argval == first for ins in dis.get_instructions(code)
        if ins.opname.startswith(("LOAD_FAST", "STORE_FAST", "DELETE_FAST")))


def _value_key(value, where, depth, seen):
    """`value` compared by content: code, tensors by position among op's tensors
    (`where`) or by identity, scalars, sequences; raises `_NoKey` for anything else."""
    if depth > _MAX_KEY_DEPTH:
        raise _NoKey()
    if isinstance(value, _SCALARS):
        return (type(value).__name__, value)
    if isinstance(value, tf.DType):
        return ("dtype", value.name)
    if isinstance(value, tf.Tensor):
        seen.add(id(value))
        return where.get(id(value)) or ("tensor", id(value))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__,) + tuple(_value_key(v, where, depth + 1, seen)
                                        for v in value)
    if isinstance(value, types.ModuleType):
        return ("module", value.__name__)
    if isinstance(value, types.FunctionType):
        try:
            cells = tuple(c.cell_contents for c in value.__closure__ or ())
        except ValueError as error:   # an empty cell
            raise _NoKey() from error
        defaults = tuple(sorted((value.__kwdefaults__ or {}).items()))
        return ("function", value.__code__, id(value.__globals__),
                _value_key(cells, where, depth + 1, seen),
                _value_key(value.__defaults__, where, depth + 1, seen),
                _value_key(defaults, where, depth + 1, seen))
    raise _NoKey()


def not_row_wise(op, on_path, request, templates=None):
    """None when the overridden gradient of `op` is proven row-wise for each of its
    inputs `on_path` (where a weight's gradient flows); else a clause saying why not.
    The dy of each output `ys` reads holds the examples' rows; the others get dy = 0.
    `templates`: shared by the overrides of one plan, or None."""
    read = [any(c in request.ys_upstream for c in t.consumers()) for t in op.outputs]
    if any(r and (t.shape.rank in (None, 0) or not t.dtype.is_floating)
           for r, t in zip(read, op.outputs)):
        return "its outputs are not all float tensors with a batch axis"
    try:
        templates = templates or Templates()
        backward = templates.backward(op, "pertower_gradient_probe")
    except _Unbuilt as error:
        return f"it could not be read ({error})"
    seeds = _captured_rows(backward, request)
    if isinstance(seeds, str):
        return seeds
    rows = [dy for r, dy in zip(read, backward.dys) if r]
    batch = [inner for inner, _ in seeds] + rows
    axes = [axis for _, axis in seeds] + [0] * len(rows)
    for j in on_path:
        grad = backward.grads[j] if j < len(backward.grads) else None
        if grad is None:
            continue
        if not isinstance(grad, tf.Tensor):
            return f"the gradient of its input {j} is not a dense tensor"
        if not batch:
            return "its backward pass reads neither dy nor any example's tensor"
        # a shared scratch graph read with the same seeds gives the same verdict
        key = (id(grad), tuple(id(t) for t in batch), tuple(axes), request.batch_size)
        if key not in templates.verdicts:
            analysis = _batch_axis.analyze(grad, batch, graph_walk.upstream_ops([grad]),
                                           request.batch_size, batch_axes=axes)
            templates.verdicts[key] = (grad, _why_not(analysis, "its backward pass"))
        why = templates.verdicts[key][1]
        if why:
            return why
    return None


def _why_not(analysis, what):
    """None when `analysis` proves the rows apart; else a clause about `what`."""
    if analysis.verdict == "coupled":
        first = analysis.couplings[0]
        return (f"{what} mixes the examples: {first.op.name!r} "
                f"({first.op.type}) {first.reason}")
    if analysis.verdict != "independent":
        lost = analysis.lost_at
        where = f" (lost at {lost[0].name!r} ({lost[0].type}): {lost[1]})" if lost else ""
        return f"{what} could not be proven to keep the examples' rows apart{where}"
    return None


def _captured_rows(backward, request):
    """(scratch placeholder, batch axis) for each user tensor the backward reads that
    holds the examples' rows (batch tensors and those computed from them), or a clause
    saying why not when one lacks one row per example."""
    batch_ops = {b.op for b in request.batch}
    outers = [o for _, o in backward.captured]
    main = request.analysis
    if main is None or main.verdict != "independent" or main.segments is not None:
        main = None
    on_path = [o for o in outers if main is not None and o.op in request.ys_upstream]
    rest = [o for o in outers if not any(o is p for p in on_path)]
    from_batch = (graph_walk.downstream_ops(request.batch, graph_walk.upstream_ops(rest))
                  if rest else set())
    computed = [o for o in rest if o.op in from_batch and o.op not in batch_ops]
    analysis = None
    if computed:   # one analysis of the forward up to every such tensor
        analysis = _batch_axis.analyze(computed[0], request.batch,
                                       graph_walk.upstream_ops(computed),
                                       request.batch_size, batch_axes=request.batch_axes)
        if analysis.couplings or (analysis.verdict != "independent" and analysis.lost_at
                                  and analysis.lost_at[0] is not computed[0].op):
            return _why_not(analysis, "the forward pass its backward reads")
    rows_of = {}
    for outer in on_path:   # (between the batch and `ys`: batch_downstream)
        if outer.op in request.batch_downstream and outer.op not in batch_ops:
            rows_of[id(outer)] = main.rows(outer)
    for outer in computed:
        rows_of[id(outer)] = analysis.rows(outer)
    seeds = []
    for inner, outer in backward.captured:
        axis = next((a for b, a in zip(request.batch, request.batch_axes) if b is outer),
                    None)
        if axis is None and id(outer) in rows_of:
            rows = rows_of[id(outer)]
            if rows is None or rows.lead != 0 or rows.k != 1:
                return (f"its backward reads {outer.name!r} ({outer.op.type}), computed "
                        "from the batch without one row per example on axis 0")
            axis = 0
        if axis is not None:
            seeds.append((inner, axis))
    return seeds

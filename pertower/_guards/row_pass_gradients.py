"""Row passes and gradients written in Python: prove the backward row-wise, or refuse.

Notation (as in `pertower._row_passes`):
    B   examples in the batch       x   one weight computed by row passes
    dy  the gradient arriving at an op's outputs in the backward pass, [B, ...]
    m_i the indicator of example i's rows, [B]

A row pass computes d sum(m_i * ys) / dx with ONE backward pass of the batched graph:
dy is zero outside example i's rows, and example i's gradient comes out only if every
op's backward keeps dy's rows apart. TensorFlow's registered gradients do (the rules
rely on the same fact, `pertower.rules._engine`). A gradient the user replaced
(`gradient_override_map`, `tf.custom_gradient`) or written in Python (`tf.py_func`,
`tf.py_function`) may not: `dy - mean(dy over the batch)` spreads row i over every
row, and example i's pass then collects the other examples' contributions too.

So for a weight computed by row passes, each such op on a path from the weight's reads
to `ys` is proven or refused:

* an override is built once more on fresh dy placeholders [B, ...] (its registered
  gradient function, called as `tf.gradients` would) and the gradient of each input on
  the path is read by the batch-axis analysis, with the batch and the dy placeholders as
  the examples' rows: "independent" (row i of the input's gradient depends on example i
  and dy's row i alone, as for swish's elementwise backward) proves it;
* anything else (a coupling such as the mean over the batch, a proof lost, a Python
  function's gradient, an override inside a called function) refuses the weight, naming
  the op.

As for any gradient, the backward pass is taken to be linear in dy (zero rows of dy give
zero rows of the inputs' gradients).
"""

import tensorflow as tf
from tensorflow.python.framework import ops as framework_ops

from pertower import _batch_axis
from pertower import _graph_walk as graph_walk
from pertower import _op_types as op_types

__all__ = ["unproven_gradient"]


def unproven_gradient(request, reads, cache=None):
    """The first op whose gradient row passes may not assume, for one weight.

    Args:
      request: the checked request (`_request.Request`).
      reads: the weight's `graph_walk.WeightReads`.
      cache: a dict kept across the weights of one request ((op, inputs) -> verdict), so
        that each override's backward is built and read once.

    Returns:
      None when every op on the paths from the weight's reads to `ys` has TensorFlow's
      registered gradient or a backward proven row-wise; else (op, why), `why` a clause
      saying what its gradient is and why it is not proven.
    """
    starts = list(reads.read_tensors)
    for op in list(reads.gather_ops) + list(reads.loop_inputs) + [o for o, _ in reads.call_inputs]:
        starts.extend(op.outputs)
    path = graph_walk.downstream_ops(starts, request.ys_upstream)
    for op in sorted(path, key=lambda o: o._id):  # pylint: disable=protected-access
        if op.type in op_types.PYTHON_OP_TYPES:
            return op, ("its gradient is a Python function, which the analysis cannot read "
                        "to prove it keeps the examples' rows apart")
        if op_types.GRADIENT_OVERRIDE_ATTR in op.node_def.attr:
            # the inputs through which the weight's gradient flows
            on_path = tuple(j for j, t in enumerate(op.inputs)
                            if t.op in path or any(t is start for start in starts))
            cache = {} if cache is None else cache
            if (op, on_path) not in cache:
                cache[(op, on_path)] = _override_not_row_wise(op, on_path, request)
            why = cache[(op, on_path)]
            if why is not None:
                return op, why
        if _calls_unassumed(op):
            return op, ("it calls a function whose body holds an op with an overridden or "
                        "Python gradient, which the analysis does not prove row-wise")
    return None


def _calls_unassumed(op):
    """Whether a function called by `op` holds an op with an overridden or Python
    gradient (searched one level deep)."""
    for value in op.node_def.attr.values():
        names = [value.func.name] if value.HasField("func") else (
            [f.name for f in value.list.func] if value.HasField("list") else [])
        for name in names:
            function = op.graph._get_function(name)  # pylint: disable=protected-access
            if function is None:
                continue
            definition = getattr(function, "cached_definition", None) or function.definition
            if any(node.op in op_types.PYTHON_OP_TYPES or op_types.GRADIENT_OVERRIDE_ATTR in node.attr
                   for node in definition.node_def):
                return True
    return False


def _override_not_row_wise(op, on_path, request):
    """None when the overridden gradient of `op` is proven row-wise for each of its
    inputs `on_path` (indices); else why not."""
    kind = op.get_attr(op_types.GRADIENT_OVERRIDE_ATTR)
    kind = kind.decode(errors="replace") if isinstance(kind, bytes) else str(kind)
    said = f"its gradient is overridden ({kind!r}, by gradient_override_map or tf.custom_gradient)"
    try:
        gradient_function = framework_ops._gradient_registry.lookup(kind)  # pylint: disable=protected-access
    except LookupError:
        return f"{said} by a function that is not registered"
    float_outputs = [t for t in op.outputs if t.dtype.is_floating]
    if len(float_outputs) != len(op.outputs) or any(t.shape.rank in (None, 0)
                                                    for t in op.outputs):
        return f"{said}; its outputs are not all float tensors with a batch axis"
    try:
        with op.graph.as_default(), tf.name_scope("pertower_gradient_probe"):
            dys = [tf.compat.v1.placeholder(t.dtype, t.shape, name="dy") for t in op.outputs]
            grads = gradient_function(op, *dys)
    except Exception as error:  # pylint: disable=broad-except  # the user's code may raise anything
        return f"{said}; building it on its own failed ({type(error).__name__}: {error})"
    grads = list(grads) if isinstance(grads, (list, tuple)) else [grads]
    batch = list(request.batch) + dys
    axes = list(request.batch_axes) + [0] * len(dys)
    for j in on_path:
        grad = grads[j] if j < len(grads) else None
        if grad is None:
            continue
        if not isinstance(grad, tf.Tensor):
            return f"{said}; the gradient of its input {j} is not a dense tensor"
        analysis = _batch_axis.analyze(grad, batch, graph_walk.upstream_ops([grad]),
                                       request.batch_size, batch_axes=axes)
        if analysis.verdict == "coupled":
            first = analysis.couplings[0]
            return (f"{said}, and its backward pass mixes the examples: {first.op.name!r} "
                    f"({first.op.type}) {first.reason}")
        if analysis.verdict != "independent":
            lost = analysis.lost_at
            where = f" (lost at {lost[0].name!r} ({lost[0].type}): {lost[1]})" if lost else ""
            return (f"{said}, and its backward pass could not be proven to keep the "
                    f"examples' rows apart{where}")
    return None

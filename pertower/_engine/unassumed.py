"""Which weights' gradients flow through ops whose gradient the rules cannot assume.

The rules assume TensorFlow's registered gradients, which keep the examples apart. An op
whose gradient the user replaced (`gradient_override_map`, `tf.custom_gradient`) or is
Python code (`tf.py_func` and the like), on a path from a weight's reads to `ys` (in
called functions too), may mix them: such a weight is left to the towers, unless the op
is in the graph itself and its backward is proven row-wise (`pertower._overrides`).
"""

from pertower import _graph_walk as graph_walk
from pertower import _op_types as op_types
from pertower import _overrides
from pertower import _tf

__all__ = ["UnassumedGradients"]

# How deep nested function bodies are searched for such ops.
_MAX_FUNCTION_DEPTH = 8


def _unassumed_reason(node_op, attrs, where):
    """Why the gradient of a node (type `node_op`, attributes `attrs`) cannot be
    assumed, or None."""
    if node_op in op_types.PYTHON_OP_TYPES:
        return (f"its gradient flows through {where} ({node_op}), a Python function whose "
                "gradient the rules cannot assume keeps the examples apart")
    if op_types.GRADIENT_OVERRIDE_ATTR in attrs:
        kind = attrs[op_types.GRADIENT_OVERRIDE_ATTR].s.decode(errors="replace")
        return (f"its gradient flows through {where} ({node_op}), whose gradient is "
                f"overridden ({kind!r}, by gradient_override_map or tf.custom_gradient); "
                "the rules assume TensorFlow's registered gradients, which keep the "
                "examples apart")
    return None


class UnassumedGradients:
    """Finds the ops with such gradients on a weight's paths to `ys`; one per plan
    (function bodies and overrides read once)."""

    def __init__(self, request):
        self.request = request
        self.graph = request.graph
        self._functions = {}   # function name -> reason or None
        self._overrides = {}   # (op, input indices on the path) -> reason or None
        self.templates = _overrides.Templates()   # overrides' backward passes, shared
        self._op_reasons = {}  # (op, in its functions) -> reason or None
        self._flagged = None   # the ops `ys` depends on that have a reason, in order

    def _has_reason(self, op):
        """Whether op (or a function it calls) has a reason."""
        return (self._op_reason(op) is not None
                or self._op_reason(op, functions=True) is not None)

    def reason(self, k):
        """Why the rules may not compute xs[k] (the first op with a reason, in creation
        order), or None."""
        reads, ys_upstream = self.request.reads[k], self.request.ys_upstream
        entries = (list(reads.gather_ops) + list(reads.loop_inputs)
                   + [op for op, _ in reads.call_inputs])
        if self._flagged is None:
            self._flagged = sorted(filter(self._has_reason, ys_upstream),
                                   key=_tf.op_order_key())
        flagged_entries = [op for op in entries
                           if op not in ys_upstream and self._has_reason(op)]
        if not self._flagged and not flagged_entries:
            return None   # nothing on any path has an unassumed gradient
        starts = list(reads.read_tensors)
        for op in entries:
            starts.extend(op.outputs)
        if reads.loop_inputs:
            path = graph_walk.downstream_ops(starts, ys_upstream) | set(entries)
        else:   # (walked once per request)
            path = self.request.weight_regions[k]
        candidates = [op for op in self._flagged if op in path] + flagged_entries
        for op in sorted(candidates, key=_tf.op_order_key()):
            found = self._op_reason(op)
            if found is not None and op.type not in op_types.PYTHON_OP_TYPES:
                found = self._override(op, path, starts, found)
            if found is None:
                found = self._op_reason(op, functions=True)
            if found is not None:
                return found
        return None

    def _op_reason(self, op, functions=False):
        """The reason of `op` itself (functions: in the functions it calls), once per plan."""
        if (op, functions) not in self._op_reasons:
            attrs = op.node_def.attr
            self._op_reasons[op, functions] = (
                self._in_functions(attrs.values(), op.name, 0) if functions
                else _unassumed_reason(op.type, attrs, repr(op.name)))
        return self._op_reasons[op, functions]

    def _override(self, op, path, starts, found):
        """None when the override of `op` is proven row-wise for the inputs a weight's
        gradient flows through; else `found`, with why the proof failed."""
        on_path = tuple(j for j, t in enumerate(op.inputs)
                        if t.op in path or any(t is start for start in starts))
        if (op, on_path) not in self._overrides:
            self._overrides[(op, on_path)] = _overrides.not_row_wise(
                op, on_path, self.request, self.templates)
        why = self._overrides[(op, on_path)]
        return None if why is None else f"{found}; {why}"

    def _in_functions(self, attr_values, where, depth):
        """The reason found in the functions named by the attribute values, or None."""
        for value in attr_values:
            names = []
            if value.HasField("func"):
                names.append(value.func.name)
            elif value.HasField("list"):
                names.extend(f.name for f in value.list.func)
            for name in names:
                found = self._function(name, depth)
                if found is not None:
                    return f"{found} inside the function {name!r} called by {where!r}"
        return None

    def _function(self, name, depth):
        """The reason found in the function `name` (or the functions it calls), or None."""
        if name in self._functions:
            return self._functions[name]
        self._functions[name] = None   # a recursive reference adds nothing
        definition = _tf.function_definition(self.graph, name)
        if definition is None:
            found = f"its gradient flows through the function {name!r}, which could not be read"
        elif depth >= _MAX_FUNCTION_DEPTH:
            found = f"its gradient flows through functions nested more than {depth} deep"
        else:
            found = None
            for node in definition.node_def:
                found = (_unassumed_reason(node.op, node.attr, repr(node.name))
                         or self._in_functions(node.attr.values(), node.name, depth + 1))
                if found is not None:
                    break
        self._functions[name] = found
        return found

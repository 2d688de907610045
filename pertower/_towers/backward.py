"""The towers' backward pass: each tower's gradient with respect to its own copies.

Notation as in `pertower._towers.build`; y_t tower t's output, [B/T, ...], and
g_t = d sum(grad_ys_t * y_t) / d c_t, [*x.shape].

One `tf.gradients` call over every tower's copies returns the T gradients g_t (see
`pertower._towers.build`). The towers being identical but for their inputs, the call's
ops are built for tower 0 only and copied for towers 1 ... T-1 with one import
(`pertower._towers.replicate`). Towers that run graph functions (their gradients
rewrite the forward op) or Python functions (an `EagerPyFunc`'s gradient reads its own
forward op's tape) make the one joint call instead.
"""

import collections

import tensorflow as tf

from pertower import _checks
from pertower import _context
from pertower import _graph_walk as graph_walk
from pertower import _op_types as op_types
from pertower._towers import replicate as replicate_lib
from pertower._towers import slicing
from pertower._towers import sparse as sparse_lib

__all__ = ["gradients", "joint_gradients", "replicated_gradients", "BatchedMatMul"]


@_context.public("Towers.gradients", inner=False)
def gradients(towers, grad_ys=None, unconnected_gradients="zero", name=None, sparse=False):
    """`Towers.gradients` (see there) of the `towers` record, for all T towers."""
    unconnected = _checks.unconnected_gradients_value(unconnected_gradients)
    T = towers.num_towers
    with tf.name_scope(name or "tower_gradients"):
        grad_outputs = [None] * T
        if grad_ys is not None:
            grad_ys = tf.convert_to_tensor(grad_ys, dtype=towers.ys.dtype)
            if not towers.stacked.shape.is_compatible_with(grad_ys.shape):
                raise _context.error(
                    ValueError,
                    "`grad_ys` must have the shape of `ys`, "
                    f"{towers.stacked.shape}, but has shape {grad_ys.shape}.")
            # [B, ...] -> T x [B/T, ...]
            grad_outputs = tf.split(grad_ys, T, axis=0)
        connected = [k for k, copies in enumerate(towers.copies) if copies is not None]
        per_tower = replicated_gradients(towers, connected, grad_outputs, unconnected,
                                         sparse)
        if per_tower is None:
            per_tower = joint_gradients(towers, connected, grad_outputs, unconnected)
        results = []
        for k, x in enumerate(towers.xs):
            if k not in per_tower:
                results.append(_zeros_per_tower(x, T)
                               if unconnected == tf.UnconnectedGradients.ZERO else None)
            elif per_tower[k] is None:
                results.append(None)
            elif isinstance(per_tower[k], BatchedMatMul):
                results.append(per_tower[k].stacked())
            elif sparse and all(isinstance(g, tf.IndexedSlices) for g in per_tower[k]):
                results.append(sparse_lib.stack_tower_slices(per_tower[k], towers.copies[k]))
            else:
                # T x [*x.shape] -> [T, *x.shape]
                results.append(tf.stack([_dense(g, c) for g, c in zip(
                    per_tower[k], towers.copies[k])], axis=0))
        return results


def joint_gradients(towers, connected, grad_outputs, unconnected):
    """One `tf.gradients` call over every tower's copies: {k: T gradients of xs[k], or
    None when no tower reaches it} for k in `connected`."""
    T = towers.num_towers
    flat_copies = [c for k in connected for c in towers.copies[k]]
    flat_grads = tf.gradients(
        list(towers.outputs), flat_copies,
        grad_ys=None if grad_outputs[0] is None else list(grad_outputs),
        unconnected_gradients=unconnected) if flat_copies else []
    per_tower = {}
    for position, k in enumerate(connected):
        grads = flat_grads[position * T:(position + 1) * T]
        per_tower[k] = None if all(g is None for g in grads) else grads
    return per_tower


def _calls_functions(ops, python=True):
    """True when an op in `ops` runs a graph function (While, If, PartitionedCall...)
    or, with `python`, a Python function (`tf.py_function`, `tf.compat.v1.py_func`)."""
    for op in ops:
        if python and op.type in op_types.PYTHON_OP_TYPES:
            return True
        for value in op.node_def.attr.values():
            if value.HasField("func") or (value.HasField("list") and value.list.func):
                return True
    return False


def replicated_gradients(towers, connected, grad_outputs, unconnected, sparse=False):
    """Tower 0's backward pass built once by `tf.gradients`, then copied for towers
    1 ... T-1: tower t's forward ops are tower 0's with t's slices and copies in place
    of 0's, and so are its backward ops. Returns `joint_gradients`' dict (an entry may
    be a `BatchedMatMul`), or None when the towers run graph or Python functions.
    Gradients are dense unless `sparse` keeps an IndexedSlices."""
    if not connected:
        return {}
    T = towers.num_towers
    graph = towers.ys.graph
    copies_0 = [towers.copies[k][0] for k in connected]
    tower_0 = graph_walk.downstream_ops(
        list(towers.slices[0]) + copies_0, graph_walk.upstream_ops([towers.outputs[0]]))
    if _calls_functions(tower_0):
        return None
    # Tower 0's tensors that the backward pass may read, with every tower's.
    known = {}
    for t0, per_t in [(towers.outputs[0], towers.outputs), (grad_outputs[0], grad_outputs)]:
        if t0 is not None:
            known[t0.name] = per_t
    for j in range(len(towers.batch)):
        known[towers.slices[0][j].name] = [s[j] for s in towers.slices]
    for k in connected:
        known[towers.copies[k][0].name] = towers.copies[k]
    scope = towers.stacked.op.name[:-len("stacked")]   # "<towers scope>/"
    replay_0 = f"{scope}replay/t0/"

    device_0 = towers.devices[0] if towers.devices else None
    with tf.name_scope("t0") as template_prefix, tf.device(device_0):
        first_new = len(graph.get_operations())
        grads = tf.gradients(
            [towers.outputs[0]], copies_0,
            grad_ys=None if grad_outputs[0] is None else [grad_outputs[0]],
            unconnected_gradients=unconnected)
        grads_0 = [g if g is None or (sparse and isinstance(g, tf.IndexedSlices))
                   else _dense(g, c) for g, c in zip(grads, copies_0)]
        template = graph.get_operations()[first_new:]
    if _calls_functions(template, python=False):
        return None

    def counterpart(item, t):
        """Tower t's version of tower 0's `item` (a tensor or a control-input op),
        or None when the towers share it."""
        op = item if isinstance(item, tf.Operation) else item.op
        if item.name in known:
            return known[item.name][t]
        if op not in tower_0:
            return None  # shared by all towers
        if not item.name.startswith(replay_0):
            raise _NoCounterpart(item.name)
        name = f"{scope}replay/t{t}/" + item.name[len(replay_0):]
        if isinstance(item, tf.Operation):
            return graph.get_operation_by_name(name)
        return graph.get_tensor_by_name(name)

    # A weight's gradient that is one MatMul (a dense kernel's a^T dz) is taken from the
    # towers' inputs to it by one batched matmul, rather than from T MatMuls and a stack
    # of their T results: the same numbers, with the [T, *x.shape] result written once.
    batched = {g.op for g in grads_0 if _batchable_matmul(g, template)}
    template = [op for op in template if op not in batched]
    template_ops = set(template)
    # What each tower must return: IndexedSlices as (values, indices), a batched
    # MatMul as its two inputs.
    needed = []
    for g in grads_0:
        if g is None:
            continue
        if isinstance(g, tf.IndexedSlices):
            needed += [g.values, g.indices]
        elif g.op in batched:
            needed += list(g.op.inputs)
        else:
            needed.append(g)
    returned = [t for t in needed if t.op in template_ops]
    stem = template_prefix[:-len("t0/")]
    try:
        replicas = replicate_lib.replicate(
            template, range(1, T),
            lambda op_name, r: f"{stem}t{r}/{op_name[len(template_prefix):]}",
            counterpart, graph, returned,
            device=slicing.device_function(towers.devices))
        in_replicas = {id(t): [replica[i] for replica in replicas]
                       for i, t in enumerate(returned)}

        def per_tower_versions(tensor):
            """T tensors: tower t's version of tower 0's `tensor`."""
            if id(tensor) in in_replicas:
                return [tensor] + in_replicas[id(tensor)]
            versions = [counterpart(tensor, t) for t in range(1, T)]
            return [tensor] + [tensor if v is None else v for v in versions]

        per_tower = {}
        for k, g_0 in zip(connected, grads_0):
            if g_0 is None:
                per_tower[k] = None
            elif isinstance(g_0, tf.IndexedSlices):
                per_tower[k] = [tf.IndexedSlices(values, indices, g_0.dense_shape)
                                for values, indices in zip(
                                    per_tower_versions(g_0.values),
                                    per_tower_versions(g_0.indices))]
            elif g_0.op in batched:
                per_tower[k] = BatchedMatMul(
                    per_tower_versions(g_0.op.inputs[0]),
                    per_tower_versions(g_0.op.inputs[1]),
                    g_0.op.get_attr("transpose_a"), g_0.op.get_attr("transpose_b"))
            else:
                per_tower[k] = per_tower_versions(g_0)
    except _NoCounterpart:
        return None
    return per_tower


class BatchedMatMul(collections.namedtuple(
        "BatchedMatMul", ["a", "b", "transpose_a", "transpose_b"])):
    """Tower t's gradient is matmul(a[t], b[t]) with the transposes given."""

    def stacked(self):
        """[T, *x.shape]: one batched matmul over the towers."""
        a, b = tf.stack(self.a), tf.stack(self.b)  # T x [.., ..] -> [T, .., ..]
        if self.transpose_a and not self.transpose_b and a.shape[1] == 1:
            # a^T b of one row each (one example per tower): an outer product,
            # [T, 1, k] x [T, 1, n] -> [T, k, 1] * [T, 1, n] -> [T, k, n]
            return tf.transpose(a, [0, 2, 1]) * b
        return tf.linalg.matmul(a, b, transpose_a=self.transpose_a,
                                transpose_b=self.transpose_b)  # -> [T, *x.shape]


def _batchable_matmul(gradient, template):
    """Whether `gradient` (tower 0's dense gradient of a weight) is the output of a
    MatMul built by tf.gradients that nothing else in the backward pass reads."""
    if gradient is None or isinstance(gradient, tf.IndexedSlices):
        return False
    op = gradient.op
    return (op.type == "MatMul" and op in template and not gradient.consumers()
            and gradient.shape.is_fully_defined()
            and all(t.shape.is_fully_defined() for t in op.inputs))


class _NoCounterpart(Exception):
    """A tensor of tower 0 whose tower-t version cannot be named."""


def _zeros_per_tower(x, T):
    """[T, *x.shape] zeros of x's dtype."""
    dtype = x.dtype.base_dtype
    if x.shape.is_fully_defined():
        return tf.zeros([T] + x.shape.as_list(), dtype=dtype)
    return tf.zeros(tf.concat([[T], tf.shape(x)], axis=0), dtype=dtype)


def _dense(gradient, like):
    """A tower's gradient as a dense tensor shaped like its copy (None -> zeros)."""
    if gradient is None:
        return tf.zeros_like(like)
    return sparse_lib.dense_rows(gradient, like)

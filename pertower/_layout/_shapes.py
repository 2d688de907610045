"""Reshape targets and constants for the engine and the rules, static wherever the sizes
are known, each built once per build.

Notation: G groups, B (per example) or M (microbatches): an int, or a scalar tensor when
B is known only at run time; x one weight (entry of `xs`).

A target stacked out of a tensor G costs a `Pack` and a constant per size, per use; when
every size but G's is a known positive int, [-1, d1, d2, ...] says the same with one
constant, and while the engine builds (`ShapeCache.active()`), `constant(value)` gives
ONE `Const` per (value, dtype, graph, control-flow context).
"""

import contextlib
import contextvars

import tensorflow as tf

from pertower import _tf

__all__ = ["ShapeCache", "constant", "group_shape", "group_sum", "rows_are_groups",
           "strided_slice", "group_target",
           "groups_target", "to_groups", "as_per_x", "as_weight_shape", "static_sizes"]

# The ShapeCache of the build running in this context (`ShapeCache.active`), or None.
_ACTIVE = contextvars.ContextVar("pertower_shape_cache", default=None)


def constant(value, dtype=tf.int32):
    """`tf.constant(value, dtype)`, shared: while a `ShapeCache` is active, one `Const`
    per (value, dtype) in each graph and control-flow context for the whole build."""
    cache = _ACTIVE.get()
    if cache is None:
        return tf.constant(value, dtype)
    return cache.constant(value, dtype)


def group_shape(G, dims):
    """[G, *dims] as a reshape target: a shared constant where `group_target` makes
    one, else stacked out of G."""
    static = group_target(G, dims)
    if static is not None:
        return constant(static)
    return tf.stack([tf.convert_to_tensor(d, tf.int32) for d in [G, *dims]])


def strided_slice(tensor, index):
    """`tensor[index]` for a tuple of Python slices (one per leading axis), its begin,
    end and strides shared constants: one op, not four."""
    begin, end, strides, begin_mask, end_mask = [], [], [], 0, 0
    for axis, part in enumerate(index):
        if part.start is None:
            begin_mask |= 1 << axis
        if part.stop is None:
            end_mask |= 1 << axis
        begin.append(part.start or 0)
        end.append(part.stop or 0)
        strides.append(1 if part.step is None else part.step)
    return tf.strided_slice(tensor, constant(begin), constant(end), constant(strides),
                            begin_mask=begin_mask, end_mask=end_mask)


def rows_are_groups(tensor, G, k):
    """Whether each group of `tensor`'s [G*k, ...] rows is one row: k = 1 and G is B (a
    tensor G is always B: a microbatch count M is an int) or the int G."""
    if k != 1 or tensor.shape.rank is None or tensor.shape.rank < 1:
        return False
    if isinstance(G, int):
        return tf.compat.dimension_value(tensor.shape[0]) == G
    return True


def group_sum(tensor, G, k, keep):
    """[G*k, ...] -> [G, n]: each group's sum over its rows and every axis but `keep`
    (>= 1, of size n); one `Sum` when each group is one row."""
    rank = tensor.shape.rank
    if rows_are_groups(tensor, G, k):
        axes = [a for a in range(1, rank) if a != keep]
        return tf.reduce_sum(tensor, axis=constant(axes)) if axes else tensor
    if keep != rank - 1:                              # [G*k, ..., n, ...] -> [G*k, ..., n]
        tensor = tf.reduce_sum(tensor, axis=constant(list(range(keep + 1, rank))))
    return tf.reduce_sum(to_groups(tensor, G, k, 1), axis=constant(1))


def static_sizes(dims):
    """`dims` as Python ints when every entry is a known int >= 0, else None."""
    if any(isinstance(d, tf.Tensor) or d is None for d in dims):
        return None
    sizes = [int(d) for d in dims]
    return sizes if all(d >= 0 for d in sizes) else None


def group_target(G, dims):
    """[G, *dims] as a static reshape target: a list when G is an int, [-1, *dims]
    when every size in `dims` is a known positive int (so -1 can only be G); else None."""
    dims = list(dims)
    if isinstance(G, int) and not any(isinstance(d, tf.Tensor) for d in dims):
        return [G] + dims
    sizes = static_sizes(dims)
    if sizes is not None and all(d > 0 for d in sizes):
        return [-1] + sizes
    return None


def groups_target(tensor, G, k, tail):
    """A static reshape target [G*T, ...] -> [G, T*prod(middle), *tail] (the last `tail`
    axes kept), or None: [G, -1, *tail] for an int G; for a tensor G (always B, so
    T = k) [-1, k*prod(middle), *tail]."""
    dims = tensor.shape.as_list() if tensor.shape.rank is not None else None
    if dims is None or tail > len(dims) - 1:
        return None
    tail_dims = dims[len(dims) - tail:]
    if any(d is None or d <= 0 for d in tail_dims):
        return None
    if isinstance(G, int):
        return [G, -1] + tail_dims
    middle = dims[1:len(dims) - tail]
    if not isinstance(k, int) or k <= 0 or any(d is None or d <= 0 for d in middle):
        return None
    rows = k
    for d in middle:
        rows *= d
    return [-1, rows] + tail_dims


def to_groups(tensor, G, k=None, tail=1):
    """[G*T, ...] -> [G, T*prod(middle), *tail] (static target where one exists; k the
    rows per example, where known)."""
    target = groups_target(tensor, G, k, tail)
    if target is None:
        rank = tensor.shape.rank
        target = tf.stack([tf.convert_to_tensor(d, tf.int32) for d in [G, -1] + [
            tf.compat.dimension_value(tensor.shape[a]) if tf.compat.dimension_value(
                tensor.shape[a]) is not None else tf.shape(tensor)[a]
            for a in range(rank - tail, rank)]])
    else:
        target = constant(target)
    return tf.reshape(tensor, target)


class ShapeCache:
    """The reshape targets and constants of one build, each made once (G: the group
    count, an int or a scalar int32 tensor)."""

    def __init__(self, G):
        self.G = G
        self._targets = {}   # tuple of sizes (ints, -1) -> [1 + len] int32 tensor
        self._constants = {}   # (graph, context, dtype, value) -> (graph, Const tensor)

    @contextlib.contextmanager
    def active(self):
        """While the body runs, `constant` shares this cache's constants."""
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)

    def constant(self, value, dtype=tf.int32):
        """One `Const` of `value` (a number or a nested list of numbers) per (value,
        dtype) in each graph and control-flow context."""
        graph = tf.compat.v1.get_default_graph()
        context = _tf.graph_control_flow_context(graph)
        dtype = tf.as_dtype(dtype)
        key = (id(graph), id(context), dtype, repr(value))
        found = self._constants.get(key)
        if found is None:
            found = (graph, context, tf.constant(value, dtype))   # (held: ids stay unique)
            self._constants[key] = found
        return found[-1]

    def group_shape(self, dims):
        """[G, *dims] as a reshape target (`dims` ints, at most one -1, or scalar
        tensors), shared by every caller asking for the same sizes."""
        static = group_target(self.G, dims)
        if static is not None:
            return self.constant(static)
        if any(isinstance(d, tf.Tensor) for d in dims):   # sizes only known at run time
            return tf.stack([tf.convert_to_tensor(d, tf.int32) for d in [self.G, *dims]])
        key = tuple(int(d) for d in dims)
        if key not in self._targets:
            self._targets[key] = tf.concat(
                [tf.reshape(tf.cast(self.G, tf.int32), [1]), tf.constant(key, tf.int32)], 0)
        return self._targets[key]


def as_per_x(part, x, G, cache=None):
    """A rule's [G, *w.shape at the op] as [G, *x.shape] (no op when it already is)."""
    x_shape = x.shape
    if (x_shape.is_fully_defined() and part.shape.rank is not None
            and part.shape[1:].is_fully_defined()
            and part.shape[1:].as_list() == x_shape.as_list()):
        return part
    if x_shape.is_fully_defined():
        dims = x_shape.as_list()
        target = cache.group_shape(dims) if cache is not None else (
            group_target(G, dims) or tf.stack(
                [tf.convert_to_tensor(d, tf.int32) for d in [G, *dims]]))
        return tf.reshape(part, target)
    return tf.reshape(part, tf.concat([tf.reshape(tf.cast(G, tf.int32), [1]),
                                       tf.shape(x)], axis=0))


def as_weight_shape(part, x):
    """A rule's [*w.shape at the op] as [*x.shape] (no op when it already is)."""
    if not x.shape.is_fully_defined():
        return tf.reshape(part, tf.shape(x))
    if part.shape.is_fully_defined() and part.shape.as_list() == x.shape.as_list():
        return part
    return tf.reshape(part, constant(x.shape.as_list()))

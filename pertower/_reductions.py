"""Reductions of gradients to vectors, norms and similarities (all graph ops).

Notation:
    gradient              a tensor or a list of tensors, as `tf.gradients` returns
    per-example gradient  a list of [B, ...] tensors, as `per_example_gradients` returns
    P                     the total number of entries of a gradient (all tensors)

A gradient is compared as one flattened vector: its tensors reshaped to [-1] and
concatenated in order, so the dot product of two gradients is the sum of the dot
products of their matching tensors.
"""

import tensorflow as tf

from pertower import _checks
from pertower import _context

__all__ = ["flatten", "flatten_per_example", "dot", "cosine_similarity", "global_norms",
           "pairwise_dot", "pairwise_cosine"]


def checked_tensors(gradient, argument, per_example=False):
    """The gradient's tensors, checked: no None, one floating dtype, ranks >= 1 for
    per-example gradients."""
    tensors = _checks.as_list(gradient)
    if not tensors:
        raise _context.error(ValueError, f"`{argument}` is empty.")
    converted = []
    for k, g in enumerate(tensors):
        if g is None:
            raise _context.error(
                ValueError, f"`{argument}[{k}]` is None (a weight the value "
                "does not reach, from unconnected_gradients='none'); drop it or use "
                "unconnected_gradients='zero'.")
        g = tf.convert_to_tensor(g)   # (IndexedSlices made dense)
        if per_example and g.shape.rank == 0:
            raise _context.error(
                ValueError, f"`{argument}[{k}]` is a scalar, but a "
                "per-example gradient has the batch on axis 0 ([B, ...]); pass what "
                "per_example_gradients returns.")
        converted.append(g)
    dtypes = {g.dtype for g in converted}
    if len(dtypes) > 1:
        raise _context.error(
            TypeError, f"the tensors of `{argument}` have different dtypes "
            f"({', '.join(sorted(d.name for d in dtypes))}); cast them to one dtype first.")
    return converted


@_context.public("flatten")
def flatten(gradient):
    """A gradient as one vector: [P], its tensors flattened and concatenated in order.

    Example:
      g = tf.gradients(loss, weights)
      vector = pertower.flatten(g)                                   # [P]
    """
    tensors = checked_tensors(gradient, "gradient")
    return tf.concat([tf.reshape(g, [-1]) for g in tensors], axis=0)  # each -> [P_k]


@_context.public("flatten_per_example")
def flatten_per_example(gradient):
    """A per-example gradient as a matrix: [B, P], one flattened gradient per row.

    Example:
      per_example = pertower.per_example_gradients(cost, weights, batch_size=32)
      matrix = pertower.flatten_per_example(per_example)             # [32, P]
    """
    tensors = checked_tensors(gradient, "gradient", per_example=True)
    rows = []
    for g in tensors:
        if g.shape[1:].is_fully_defined():
            rows.append(tf.reshape(g, [-1, g.shape[1:].num_elements()]))  # [B, ...] -> [B, P_k]
        else:
            rows.append(tf.reshape(g, tf.stack([tf.shape(g)[0], -1])))  # [B, ...] -> [B, P_k]
    return tf.concat(rows, axis=1)  # -> [B, P]


def _matching(a, b, per_example=False):
    """The checked tensors of gradients `a` and `b` of the same weights (with
    per_example, b=None stands for a)."""
    a_tensors = checked_tensors(a, "a", per_example=per_example)
    b_tensors = (a_tensors if b is None and per_example else
                 checked_tensors(b, "b", per_example=per_example))
    if len(a_tensors) != len(b_tensors):
        raise _context.error(
            ValueError, f"`a` has {len(a_tensors)} tensors but `b` has "
            f"{len(b_tensors)}; compare gradients of the same weights.")
    for k, (a, b) in enumerate(zip(a_tensors, b_tensors)):
        a_shape = a.shape[1:] if per_example else a.shape
        b_shape = b.shape[1:] if per_example else b.shape
        if not a_shape.is_compatible_with(b_shape):
            raise _context.error(
                ValueError, f"`a[{k}]` has shape {a.shape} but `b[{k}]` has "
                f"shape {b.shape}; compare gradients of the same weights.")
        if a.dtype != b.dtype:
            raise _context.error(
                TypeError, f"`a` has dtype {a.dtype.name} but `b` has "
                f"{b.dtype.name}; cast one of them.")
    return a_tensors, b_tensors


@_context.public("dot")
def dot(a, b):
    """The dot product of two gradients, each flattened to one vector: a scalar.

    Example:
      pertower.dot(tf.gradients(loss_1, w), tf.gradients(loss_2, w))
    """
    a_tensors, b_tensors = _matching(a, b)
    return tf.add_n([tf.reduce_sum(x * y) for x, y in zip(a_tensors, b_tensors)])


@_context.public("cosine_similarity")
def cosine_similarity(a, b):
    """The cosine of the angle between two gradients, each flattened: a scalar.

    <a, b> / (|a| |b|); 0 when either gradient is all zeros.

    Example:
      pertower.cosine_similarity(g1, g2)
    """
    a_tensors, b_tensors = _matching(a, b)
    inner = tf.add_n([tf.reduce_sum(x * y) for x, y in zip(a_tensors, b_tensors)])
    return tf.math.divide_no_nan(
        inner, tf.linalg.global_norm(a_tensors) * tf.linalg.global_norm(b_tensors))


@_context.public("global_norms")
def global_norms(gradient):
    """The L2 norm of each example's whole gradient: [B].

    norms[i] = sqrt(sum_k |g_k[i]|^2) over all tensors k of the per-example gradient,
    as `tf.linalg.global_norm` does for one gradient.

    Example:
      norms = pertower.global_norms(pertower.per_example_gradients(cost, w, batch_size=32))
    """
    tensors = checked_tensors(gradient, "gradient", per_example=True)
    # each [B, ...] -> [B] sum of squares over its non-batch axes
    squares = [tf.reduce_sum(tf.square(g), axis=list(range(1, g.shape.rank)))
               if g.shape.rank > 1 else tf.square(g) for g in tensors]
    return tf.sqrt(tf.add_n(squares))


def _pairwise_dot(a_tensors, b_tensors):
    """[Ba, Bb] dot products of every row of a with every row of b."""
    total = None
    for x, y in zip(a_tensors, b_tensors):
        # [Ba, ...] x [Bb, ...] -> [Ba, Bb]
        term = tf.tensordot(x, y, axes=[list(range(1, x.shape.rank)),
                                        list(range(1, y.shape.rank))])
        total = term if total is None else total + term
    return total


@_context.public("pairwise_dot")
def pairwise_dot(a, b=None):
    """Dot products between every example of `a` and every example of `b`: [Ba, Bb].

    `a` and `b` are per-example gradients of the same weights; `b` defaults to `a`
    (then the result is the Gram matrix of the per-example gradients).

    Example:
      gram = pertower.pairwise_dot(per_example)                      # [B, B]
    """
    a_tensors, b_tensors = _matching(a, b, per_example=True)
    return _pairwise_dot(a_tensors, b_tensors)


@_context.public("pairwise_cosine")
def pairwise_cosine(a, b=None):
    """Cosines between every example of `a` and every example of `b`: [Ba, Bb].

    Entries whose gradients are all zeros are 0.

    Example:
      similarity = pertower.pairwise_cosine(train_grads, test_grads)  # [Ba, Bb]
    """
    a_tensors, b_tensors = _matching(a, b, per_example=True)
    inner = _pairwise_dot(a_tensors, b_tensors)
    a_norms = global_norms(a_tensors)
    b_norms = a_norms if b is None else global_norms(b_tensors)
    # [Ba, 1] * [1, Bb] -> [Ba, Bb]
    return tf.math.divide_no_nan(inner, a_norms[:, None] * b_norms[None, :])

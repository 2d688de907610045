"""Similarities between examples' gradients, by class, and the empirical NTK;
notation: `pertower._analytics`."""

import numpy as np
import tensorflow as tf

from pertower import _checks
from pertower import _context
from pertower import _reductions as reductions

__all__ = ["similarity_matrix", "class_similarity", "empirical_ntk"]


@_context.public("similarity_matrix")
def similarity_matrix(a, b=None, metric="cosine"):
    """Gradient similarities between every example of `a` and every example of `b`.

    `a`, `b` (default `a`): per-example gradients of the same weights, [B_a, *x.shape]
    and [B_b, *x.shape] per weight; `metric` "cosine" (`pertower.pairwise_cosine`) or
    "dot" (`pertower.pairwise_dot`). Returns [B_a, B_b]: cos(g_a_i, g_b_j) or
    <g_a_i, g_b_j>.

    Example:
      similarity = pertower.similarity_matrix(train_grads, test_grads, metric="cosine")
    """
    if metric == "cosine":
        return reductions.pairwise_cosine(a, b)
    if metric == "dot":
        return reductions.pairwise_dot(a, b)
    raise _context.error(ValueError, f"`metric` must be 'cosine' or 'dot', but "
                         f"received {metric!r}.")


@_context.public("class_similarity")
def class_similarity(similarity, labels_a, num_classes, labels_b=None):
    """Averages a [B_a, B_b] similarity matrix over class blocks: [C, C].

    S_class[c, d] = mean of similarity[i, j] over examples i of `a` with label c and
    j of `b` with label d. With `labels_b` None, `similarity` is one set against
    itself (square, e.g. `similarity_matrix(g)`) and the pairs i == j are left out of
    every mean (an example is not compared with itself). A block without any pair
    is NaN.

    `labels_a` [B_a] and `labels_b` [B_b] are integer labels in [0, num_classes = C).
    Returns [C, C] of similarity's dtype.

    Example:
      heat = pertower.class_similarity(pertower.similarity_matrix(grads), labels, 10)
    """
    num_classes = _checks.positive_int(num_classes, "num_classes")
    similarity = tf.convert_to_tensor(similarity)
    if similarity.shape.rank != 2:
        raise _context.error(ValueError, f"`similarity` must be a [B_a, B_b] matrix, "
                             f"but has shape {similarity.shape}.")
    with tf.name_scope(_context.name()):
        dtype = similarity.dtype
        one_hot_a = tf.one_hot(labels_a, num_classes, dtype=dtype)           # [B_a, C]
        if labels_b is None:
            one_hot_b = one_hot_a
            # 1 off the diagonal, 0 on it: leave out i == j, [B, B]
            pair_mask = 1 - tf.eye(tf.shape(similarity)[0], dtype=dtype)
        else:
            one_hot_b = tf.one_hot(labels_b, num_classes, dtype=dtype)       # [B_b, C]
            pair_mask = tf.ones_like(similarity)
        # [C, B_a] x [B_a, B_b] x [B_b, C] -> [C, C]
        totals = tf.matmul(tf.matmul(one_hot_a, similarity * pair_mask, transpose_a=True),
                           one_hot_b)
        counts = tf.matmul(tf.matmul(one_hot_a, pair_mask, transpose_a=True), one_hot_b)
        return totals / counts  # NaN where a block has no pair


@_context.public("empirical_ntk")
def empirical_ntk(jacobians_a, jacobians_b=None, output_rank=1):
    """The empirical neural tangent kernel: the Gram matrix of per-example Jacobians.

        Θ(x_i, x'_j)[k, l] = sum_p  J_i[k, p] J'_j[l, p],   J = ∂f(x)/∂w flattened over w

    (Jacot, Gabriel and Hongler 2018, "Neural Tangent Kernel", arXiv 1806.07572, at the
    current weights). For one output per example this is `pertower.pairwise_dot`.

    Args:
      jacobians_a: per-example Jacobians, [B_a, *out, *x.shape] per weight, as
        `pertower.per_example_jacobians` returns.
      jacobians_b: the same for other inputs, [B_b, *out, *x.shape]; default jacobians_a.
      output_rank: len(out), the static output axes after the batch axis (1 for [B, K]
        outputs, 0 for [B] outputs or per-example gradients).

    Returns:
      [B_a, *out, B_b, *out].

    Example:
      jac = pertower.per_example_jacobians(model(x), model.trainable_weights, batch_size=16)
      ntk = pertower.empirical_ntk(jac)                              # [16, K, 16, K]
    """
    output_rank = _checks.positive_int(output_rank, "output_rank", low=0)
    a = reductions.checked_tensors(jacobians_a, "jacobians_a", per_example=True)
    b = a if jacobians_b is None else reductions.checked_tensors(
        jacobians_b, "jacobians_b", per_example=True)
    if len(a) != len(b):
        raise _context.error(ValueError, f"`jacobians_a` has {len(a)} tensors but "
                             f"`jacobians_b` has {len(b)}; pass Jacobians of the same weights.")
    if output_rank == 0:
        return reductions.pairwise_dot(a, b)
    out = None
    for name, tensors in (("jacobians_a", a), ("jacobians_b", b)):
        for k, j in enumerate(tensors):
            if j.shape.rank is None or j.shape.rank < 1 + output_rank or not j.shape[
                    1:1 + output_rank].is_fully_defined():
                raise _context.error(
                    ValueError, f"`{name}[{k}]` has shape {j.shape}; with "
                    f"output_rank={output_rank} it must be [B, *out, *x.shape] with a static "
                    "`out`.")
            this_out = j.shape[1:1 + output_rank].as_list()
            if out is None:
                out = this_out
            elif this_out != out:
                raise _context.error(
                    ValueError, f"`{name}[{k}]` has output axes {this_out} but "
                    f"an earlier tensor has {out}; pass Jacobians of one output.")
    K = int(np.prod(out, dtype=np.int64))
    with tf.name_scope(_context.name()):
        # [B, *out, *x.shape] -> [B*K, P_x]: one row per example and output entry
        rows_a = [tf.reshape(j, tf.stack([tf.shape(j)[0] * K, -1])) for j in a]
        rows_b = [tf.reshape(j, tf.stack([tf.shape(j)[0] * K, -1])) for j in b]
        gram = reductions.pairwise_dot(rows_a, rows_b)                   # [B_a*K, B_b*K]
        # [B_a*K, B_b*K] -> [B_a, *out, B_b, *out]
        shape = tf.concat([tf.shape(a[0])[:1], out, tf.shape(b[0])[:1], out], axis=0)
        return tf.reshape(gram, shape)

"""Gradient analytics on per-example gradients: influence, similarity, Fisher, noise, NTK.

Notation:
    B   examples              g_i  example i's gradient over all weights, flattened [P]
    x   one weight            ḡ    the batch mean (1/B) sum_i g_i
    G   the true (expected) gradient, Σ the covariance of one example's gradient
    K   output entries per example (for Jacobians)

Every function is a graph op on a per-example gradient (a list with one [B, *x.shape]
tensor per weight, as `pertower.per_example_gradients` returns) or on per-example
Jacobians; the pairwise products reuse `pertower.reductions`.
"""

import dataclasses
import numbers

import numpy as np
import tensorflow as tf

from pertower import _checks
from pertower import _reductions as reductions
from pertower import _context
from pertower import _graph_walk as graph_walk

__all__ = ["tracin", "tracin_over_checkpoints", "similarity_matrix", "class_similarity",
           "fisher_diagonal", "gradient_variance", "NoiseScale", "gradient_noise_scale",
           "empirical_ntk"]


def _per_example_tensors(gradient, argument):
    """The per-example gradient's tensors, checked (reductions' checks), [B, ...] each."""
    # pylint: disable-next=protected-access
    return reductions._tensors(gradient, argument, per_example=True)


def _batch_count(tensors, dtype):
    """B as a scalar of `dtype`, from axis 0 of the first tensor."""
    return tf.cast(tf.shape(tensors[0])[0], dtype)


def _is_checkpoint_list(value):
    """True when `value` is a list over checkpoints of per-example gradients."""
    return isinstance(value, (list, tuple)) and bool(value) and isinstance(
        value[0], (list, tuple))


@_context.public("tracin")
def tracin(train_gradients, test_gradients, learning_rates=1.0):
    """TracIn influence of every training example on every test example: [B_train, B_test].

    TracInCP (Pruthi et al. 2020, "Estimating Training Data Influence by Tracing
    Gradient Descent", arXiv 2002.08484, eq. 3):

        TracIn(z_train, z_test) = sum_c  η_c  <∇ℓ(w_c, z_train), ∇ℓ(w_c, z_test)>

    over checkpoints c with weights w_c and learning rate η_c. A positive score marks a
    proponent (a step on z_train lowers z_test's loss), a negative one an opponent.

    Args:
      train_gradients: the per-example loss gradients of the training examples at one
        checkpoint (a list of [B_train, *x.shape]), or a list over C checkpoints of
        such lists.
      test_gradients: the same for the test examples, [B_test, *x.shape] per weight
        (a list over the same C checkpoints when train_gradients is one).
      learning_rates: η, a number or scalar tensor for one checkpoint, or a sequence of
        C of them.

    Returns:
      A [B_train, B_test] tensor: the sum over checkpoints of η_c times the dot
      products of the flattened gradients.

    Example (one checkpoint; sum several with `tracin_over_checkpoints`):
      train = pertower.per_example_gradients(train_loss, weights, batch_size=100)
      test = pertower.per_example_gradients(test_loss, weights, batch_size=5)
      scores = pertower.tracin(train, test, learning_rates=0.1)       # [100, 5]
    """
    if _is_checkpoint_list(train_gradients) or _is_checkpoint_list(test_gradients):
        if not (_is_checkpoint_list(train_gradients) and _is_checkpoint_list(test_gradients)):
            raise _context.error(
                ValueError, "one of `train_gradients` and `test_gradients` is "
                "a list over checkpoints and the other is not; give both per checkpoint.")
        C = len(train_gradients)
        if len(test_gradients) != C:
            raise _context.error(
                ValueError, f"`train_gradients` has {C} checkpoints but "
                f"`test_gradients` has {len(test_gradients)}.")
        if not isinstance(learning_rates, (list, tuple)) or len(learning_rates) != C:
            raise _context.error(
                ValueError, f"`learning_rates` must be a sequence of {C} "
                f"learning rates, one per checkpoint, but received {learning_rates!r:.80}.")
        pairs = list(zip(train_gradients, test_gradients, learning_rates))
    else:
        if isinstance(learning_rates, (list, tuple)):
            raise _context.error(
                ValueError, "`learning_rates` is a sequence, but the "
                "gradients are for one checkpoint; pass one learning rate, or the gradients "
                "as lists over checkpoints.")
        pairs = [(train_gradients, test_gradients, learning_rates)]
    with tf.name_scope(_context.name()):
        total = None
        for c, (train, test, rate) in enumerate(pairs):
            train = _per_example_tensors(train, f"train_gradients[{c}]")
            test = _per_example_tensors(test, f"test_gradients[{c}]")
            scores = reductions.pairwise_dot(train, test)                 # [B_train, B_test]
            term = tf.cast(rate, scores.dtype) * scores
            total = term if total is None else total + term
        return total


@_context.public("tracin_over_checkpoints")
def tracin_over_checkpoints(sess, scores, checkpoints, learning_rates, restore,
                            feed_dict=None):
    """Runs TracIn over saved checkpoints: sum_c η_c * sess.run(scores) at checkpoint c.

    The usual TracInCP set-up: one graph, its weights restored from each checkpoint in
    turn. `scores` is `pertower.tracin(train, test)` (learning rate 1) or any tensor
    to be summed the same way.

    Args:
      sess: the session.
      scores: the tensor to run at each checkpoint, e.g. [B_train, B_test].
      checkpoints: the checkpoint paths (or anything `restore` accepts), C of them.
      learning_rates: C learning rates η_c.
      restore: a `tf.compat.v1.train.Saver` (its `restore(sess, path)` is called) or a
        callable `restore(sess, checkpoint)`.
      feed_dict: the feeds for `scores`: one dict, or a list of dicts (for example one
        per chunk of the training set); each checkpoint is restored once and `scores`
        run for every dict.

    Returns:
      A NumPy array shaped like `scores` (for one dict), or a list of them, one per dict.

    Example:
      scores = pertower.tracin(train, test)
      influence = pertower.tracin_over_checkpoints(sess, scores, paths, [0.1] * len(paths),
                                                   saver, {x: X, y: Y, x_test: Xt, y_test: Yt})
    """
    checkpoints, learning_rates = list(checkpoints), list(learning_rates)
    if not checkpoints:
        raise _context.error(ValueError, "`checkpoints` is empty.")
    if len(learning_rates) != len(checkpoints):
        raise _context.error(
            ValueError, f"{len(checkpoints)} checkpoints but "
            f"{len(learning_rates)} learning rates; give one learning rate per checkpoint.")
    if hasattr(restore, "restore"):
        restore = restore.restore
    if not callable(restore):
        raise _context.error(TypeError, "`restore` must be a tf.compat.v1.train.Saver or a "
                             f"callable(sess, checkpoint), not {type(restore).__name__}.")
    several = isinstance(feed_dict, (list, tuple))
    feeds = list(feed_dict) if several else [feed_dict]
    totals = [None] * len(feeds)
    for checkpoint, rate in zip(checkpoints, learning_rates):
        restore(sess, checkpoint)
        for k, feed in enumerate(feeds):
            term = float(rate) * np.asarray(sess.run(scores, feed))
            totals[k] = term if totals[k] is None else totals[k] + term
    return totals if several else totals[0]


@_context.public("similarity_matrix")
def similarity_matrix(a, b=None, metric="cosine"):
    """Gradient similarities between every example of `a` and every example of `b`.

    Args:
      a: a per-example gradient, [B_a, *x.shape] per weight.
      b: another one over the same weights, [B_b, *x.shape]; default `a`.
      metric: "cosine" (`pertower.pairwise_cosine`) or "dot" (`pertower.pairwise_dot`).

    Returns:
      [B_a, B_b]: entry (i, j) is cos(g_a_i, g_b_j) or <g_a_i, g_b_j>.

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

    Args:
      similarity: [B_a, B_b] (or [B, B] when labels_b is None).
      labels_a: integer labels in [0, num_classes), [B_a].
      num_classes: C.
      labels_b: integer labels of the columns, [B_b]; None for the rows' labels.

    Returns:
      A [C, C] tensor of similarity's dtype.

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


@_context.public("fisher_diagonal")
def fisher_diagonal(per_example_gradients):
    """The diagonal of the empirical Fisher information: (1/B) sum_i g_i ⊙ g_i.

    F_diag = E_i[(∇ log p(y_i | x_i, w))^2] estimated on the batch with the observed
    labels (the "empirical Fisher"; Kunstner, Hennig and Balles 2019, arXiv 1905.12558,
    discuss where it differs from the true Fisher). Pass the gradients of the negative
    log-likelihood (e.g. cross-entropy) per example; the sign does not matter.

    Args:
      per_example_gradients: a list of [B, *x.shape].

    Returns:
      A list of [*x.shape] tensors, one per weight.

    Example:
      fisher = pertower.fisher_diagonal(pertower.per_example_gradients(nll, w, batch_size=64))
    """
    tensors = _per_example_tensors(per_example_gradients, "per_example_gradients")
    with tf.name_scope("fisher_diagonal"):
        return [tf.reduce_mean(tf.square(g), axis=0) for g in tensors]  # [B, ...] -> [...]


def _require_two_examples(tensors):
    B = graph_walk.static_batch_size(tensors[0])
    if B is not None and B < 2:
        raise _context.error(ValueError, f"the unbiased estimates need at least 2 "
                             f"examples, but the per-example gradients have B = {B}.")


@_context.public("gradient_variance")
def gradient_variance(per_example_gradients):
    """The variance of each gradient entry across examples, unbiased: [*x.shape] per weight.

        Var[g]_p = 1/(B-1) sum_i (g_ip - ḡ_p)^2

    Its sum over all entries p is tr(Σ), the estimate `gradient_noise_scale` uses.

    Args:
      per_example_gradients: a list of [B, *x.shape], B >= 2.

    Returns:
      A list of [*x.shape] tensors.

    Example:
      variance = pertower.gradient_variance(per_example)
    """
    tensors = _per_example_tensors(per_example_gradients, "per_example_gradients")
    _require_two_examples(tensors)
    with tf.name_scope("gradient_variance"):
        B = _batch_count(tensors, tensors[0].dtype)
        return [tf.reduce_sum(tf.square(g - tf.reduce_mean(g, axis=0)), axis=0) / (B - 1)
                for g in tensors]  # [B, ...] -> [...]


@dataclasses.dataclass(frozen=True)
class NoiseScale:
    """The simple gradient noise scale and the two estimates it is the ratio of.

    Attributes:
      trace_covariance: tr(Σ), unbiased: 1/(B-1) sum_i |g_i - ḡ|^2 (scalar).
      squared_norm: |G|^2, unbiased: |ḡ|^2 - tr(Σ)/B (scalar; can be negative when
        the noise dominates).
      simple_noise_scale: B_simple = trace_covariance / squared_norm (scalar). A ratio
        of unbiased estimates is biased; McCandlish et al. average the numerator and
        the denominator over many batches before dividing.
    """

    trace_covariance: tf.Tensor
    squared_norm: tf.Tensor
    simple_noise_scale: tf.Tensor


@_context.public("gradient_noise_scale")
def gradient_noise_scale(per_example_gradients):
    """The simple gradient noise scale B_simple = tr(Σ) / |G|^2 of one batch.

    McCandlish, Kaplan, Amodei et al. 2018, "An Empirical Model of Large-Batch Training"
    (arXiv 1812.06162), eq. 2.8; B_simple estimates the batch size above which larger
    batches stop paying off. From B per-example gradients the unbiased estimates are

        tr(Σ)  ≈ S = 1/(B-1) sum_i |g_i - ḡ|^2
        |G|^2  ≈ |ḡ|^2 - S / B        (E|ḡ|^2 = |G|^2 + tr(Σ)/B)

    which equal their Appendix A.1 two-batch estimators with B_small = 1, B_big = B.

    Args:
      per_example_gradients: a list of [B, *x.shape], B >= 2.

    Returns:
      A `NoiseScale` of three scalar tensors.

    Example:
      scale = pertower.gradient_noise_scale(per_example)
      S, G2, b_simple = sess.run([scale.trace_covariance, scale.squared_norm,
                                  scale.simple_noise_scale], feed)
    """
    tensors = _per_example_tensors(per_example_gradients, "per_example_gradients")
    _require_two_examples(tensors)
    with tf.name_scope("gradient_noise_scale"):
        B = _batch_count(tensors, tensors[0].dtype)
        means = [tf.reduce_mean(g, axis=0) for g in tensors]          # [*x.shape] each
        deviations = reductions.global_norms(
            [g - m for g, m in zip(tensors, means)])                    # [B]
        trace = tf.reduce_sum(tf.square(deviations)) / (B - 1)
        mean_squared = tf.add_n([tf.reduce_sum(tf.square(m)) for m in means])  # |ḡ|^2
        squared_norm = mean_squared - trace / B
        return NoiseScale(trace_covariance=trace, squared_norm=squared_norm,
                          simple_noise_scale=trace / squared_norm)


@_context.public("empirical_ntk")
def empirical_ntk(jacobians_a, jacobians_b=None, output_rank=1):
    """The empirical neural tangent kernel: the Gram matrix of per-example Jacobians.

        Θ(x_i, x'_j)[k, l] = sum_p  J_i[k, p] J'_j[l, p],   J = ∂f(x)/∂w flattened over w

    (Jacot, Gabriel and Hongler 2018, "Neural Tangent Kernel", arXiv 1806.07572, at the
    current weights). For one output per example this is `pertower.pairwise_dot`.

    Args:
      jacobians_a: per-example Jacobians, one [B_a, *out, *x.shape] tensor per weight,
        as `pertower.per_example_jacobians` returns.
      jacobians_b: the same for a second set of inputs, [B_b, *out, *x.shape]; default
        `jacobians_a`.
      output_rank: len(out), the number of output axes after the batch axis (1 for a
        [B, K] model output, 0 for [B] outputs or per-example gradients). `out` must
        be static.

    Returns:
      [B_a, *out, B_b, *out].

    Example:
      jac = pertower.per_example_jacobians(model(x), model.trainable_weights, batch_size=16)
      ntk = pertower.empirical_ntk(jac)                              # [16, K, 16, K]
    """
    if isinstance(output_rank, bool) or not isinstance(output_rank, numbers.Integral) or (
            output_rank < 0):
        raise _context.error(ValueError, f"`output_rank` must be a non-negative "
                             f"integer, but received {output_rank!r}.")
    a = _per_example_tensors(jacobians_a, "jacobians_a")
    b = a if jacobians_b is None else _per_example_tensors(jacobians_b, "jacobians_b")
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
        total = None
        for ja, jb in zip(a, b):
            # [B, *out, *x.shape] -> [B, K, P_x]
            fa = tf.reshape(ja, tf.stack([tf.shape(ja)[0], K, -1]))
            fb = tf.reshape(jb, tf.stack([tf.shape(jb)[0], K, -1]))
            term = tf.einsum("akp,blp->akbl", fa, fb)               # [B_a, K, B_b, K]
            total = term if total is None else total + term
        # [B_a, K, B_b, K] -> [B_a, *out, B_b, *out]
        shape = tf.concat([tf.shape(total)[:1], out, tf.shape(total)[2:3], out], axis=0)
        return tf.reshape(total, shape)

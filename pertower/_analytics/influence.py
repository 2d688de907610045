"""TracIn: the influence of training examples on test examples (Pruthi et al. 2020);
notation: `pertower._analytics`."""

import numpy as np
import tensorflow as tf

from pertower import _context
from pertower import _reductions as reductions

__all__ = ["tracin", "tracin_over_checkpoints"]


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
      train_gradients: the training examples' per-example loss gradients at one
        checkpoint ([B_train, *x.shape] per weight), or a list over C checkpoints.
      test_gradients: the same for the test examples, [B_test, *x.shape] per weight.
      learning_rates: η, a number or scalar tensor, or a sequence of C of them.

    Returns:
      [B_train, B_test]: sum over checkpoints of η_c times the gradients' dot products.

    Example (one checkpoint; sum several with `tracin_over_checkpoints`):
      train = pertower.per_example_gradients(train_loss, weights, batch_size=100)
      test = pertower.per_example_gradients(test_loss, weights, batch_size=5)
      scores = pertower.tracin(train, test, learning_rates=0.1)       # [100, 5]
    """
    several = _is_checkpoint_list(train_gradients)
    if several != _is_checkpoint_list(test_gradients):
        raise _context.error(
            ValueError, "one of `train_gradients` and `test_gradients` is "
            "a list over checkpoints and the other is not; give both per checkpoint.")
    if several:
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
    elif isinstance(learning_rates, (list, tuple)):
        raise _context.error(
            ValueError, "`learning_rates` is a sequence, but the "
            "gradients are for one checkpoint; pass one learning rate, or the gradients "
            "as lists over checkpoints.")
    else:
        pairs = [(train_gradients, test_gradients, learning_rates)]
    with tf.name_scope(_context.name()):
        total = None
        for c, (train, test, rate) in enumerate(pairs):
            train = reductions.checked_tensors(train, f"train_gradients[{c}]", per_example=True)
            test = reductions.checked_tensors(test, f"test_gradients[{c}]", per_example=True)
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
      sess, scores: the session and the tensor to run at each checkpoint.
      checkpoints: C checkpoint paths (or anything `restore` accepts).
      learning_rates: C learning rates η_c.
      restore: a `tf.compat.v1.train.Saver` or a callable `restore(sess, checkpoint)`.
      feed_dict: one dict, or a list of dicts (e.g. one per chunk of the training set);
        each checkpoint is restored once and `scores` run for every dict.

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

"""The slow, obviously correct reference: plain `tf.gradients` run on one slice at a time.

Every pertower method is compared with these loops in tests/, and the examples and
`pertower demo` use them to show agreement and speed-up. They feed the graph one
example (or one microbatch) at a time, so the batch tensors must be placeholders
whose batch axis is None.

Notation: B examples, M slices (microbatches), x one weight, K output entries.
"""

import numpy as np
import tensorflow as tf

__all__ = ["loop_per_example_gradients", "loop_microbatch_gradients",
           "loop_per_example_jacobians"]


def _dense_gradients(y_sum, xs):
    """tf.gradients(y_sum, xs) with IndexedSlices made dense and None as zeros."""
    grads = tf.gradients(y_sum, xs)
    return [tf.zeros_like(x) if g is None else tf.convert_to_tensor(g)
            for g, x in zip(grads, xs)]


def _slice_feeds(feed_dict, batch, num_slices):
    """Yields feed dicts holding slice m of every batch placeholder's value."""
    batch = list(feed_dict) if batch is None else list(batch)
    sizes = {len(feed_dict[b]) for b in batch}
    if len(sizes) != 1:
        raise ValueError(f"the fed batch values have different lengths: {sorted(sizes)}")
    (B,) = sizes
    step = B // num_slices
    for m in range(num_slices):
        feeds = dict(feed_dict)
        for b in batch:
            feeds[b] = feed_dict[b][m * step:(m + 1) * step]
        yield feeds


def _xs_list(xs):
    return list(xs) if isinstance(xs, (list, tuple)) else [xs]


def loop_microbatch_gradients(sess, ys, xs, feed_dict, num_microbatches, batch=None):
    """[M, *x.shape] per x: one `sess.run` of tf.gradients(sum(ys), xs) per slice.

    Args:
      sess: the session.
      ys: per-example values, [B, ...].
      xs: a weight or list of weights.
      feed_dict: the feeds for a whole batch of B examples.
      num_microbatches: M; slice m holds examples m*B/M ... (m+1)*B/M - 1.
      batch: the keys of `feed_dict` that carry the batch (default: all of them).
    """
    xs = _xs_list(xs)
    grads = _dense_gradients(tf.reduce_sum(ys), xs)
    rows = [sess.run(grads, feeds) for feeds in _slice_feeds(feed_dict, batch, num_microbatches)]
    return [np.stack([row[k] for row in rows]) for k in range(len(xs))]


def loop_per_example_gradients(sess, ys, xs, feed_dict, batch=None):
    """[B, *x.shape] per x: one `sess.run` of tf.gradients(sum(ys), xs) per example."""
    B = len(next(iter(feed_dict.values()))) if batch is None else len(feed_dict[_xs_list(batch)[0]])
    return loop_microbatch_gradients(sess, ys, xs, feed_dict, B, batch)


def loop_per_example_jacobians(sess, ys, xs, feed_dict, batch=None):
    """[B, *out, *x.shape] per x: one `sess.run` per example of the K gradients
    d ys[0, k] / d x, k over the output entries of one example."""
    xs = _xs_list(xs)
    out = ys.shape[1:].as_list()
    K = int(np.prod(out, dtype=np.int64))
    entries = tf.reshape(ys, [-1, K])  # [1, *out] -> [1, K]
    rows_per_k = [_dense_gradients(tf.reduce_sum(entries[:, k]), xs) for k in range(K)]
    B = len(next(iter(feed_dict.values()))) if batch is None else len(feed_dict[_xs_list(batch)[0]])
    per_example = []
    for feeds in _slice_feeds(feed_dict, batch, B):
        values = sess.run(rows_per_k, feeds)  # K x (list per x)
        per_example.append([np.stack([values[k][j] for k in range(K)]) for j in range(len(xs))])
    return [np.stack([e[j] for e in per_example]).reshape([B] + out + list(e_shape))
            for j, e_shape in enumerate(x.shape.as_list() for x in xs)]

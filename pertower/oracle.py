"""The slow, obviously correct reference: plain `tf.gradients` run on one slice at a time.

Every pertower method is compared with these loops. They feed the graph one example (or
microbatch) at a time, so the batch tensors must be placeholders whose batch axis is
None. The batch feeds are the keys `batch` (default: every key fed an array of rank >= 1),
sliced along their batch axis (`batch_axis`: None for 0, an int for all, or a list
parallel to `batch`, e.g. 1 for a time-major [T, B, d] feed).

Notation: B examples, M slices (microbatches), x one weight, K output entries.
"""

import numpy as np
import tensorflow as tf

__all__ = ["SliceLoop", "loop_per_example_gradients", "loop_microbatch_gradients",
           "loop_per_example_jacobians", "slice_feeds", "loop_several_batches_gradients"]


def _dense_gradients(y_sum, xs):
    """tf.gradients(y_sum, xs) with IndexedSlices made dense and None as zeros."""
    grads = tf.gradients(y_sum, xs)
    return [tf.zeros_like(x) if g is None else tf.convert_to_tensor(g)
            for g, x in zip(grads, xs)]


def _batch_keys(feed_dict, batch):
    if batch is not None:
        return _xs_list(batch)
    return [key for key, value in feed_dict.items() if np.ndim(value) >= 1]


def _axes(keys, batch_axis):
    if batch_axis is None:
        return [0] * len(keys)
    if isinstance(batch_axis, (list, tuple)):
        if len(batch_axis) != len(keys):
            raise ValueError(f"batch_axis has {len(batch_axis)} entries for {len(keys)} "
                             "batch feeds")
        return list(batch_axis)
    return [batch_axis] * len(keys)


def _fed_batch_size(feed_dict, batch, batch_axis=None):
    """B: the common length of the batch feeds along their batch axes."""
    keys = _batch_keys(feed_dict, batch)
    sizes = {np.shape(feed_dict[key])[axis] for key, axis in zip(keys, _axes(keys, batch_axis))}
    if len(sizes) != 1:
        raise ValueError(f"the fed batch values have different lengths: {sorted(sizes)}")
    return sizes.pop()


def slice_feeds(feed_dict, batch, num_slices, batch_axis=None):
    """Yields M feed dicts; the m-th holds slice m, [B/M, ...], of every batch feed."""
    batch = _batch_keys(feed_dict, batch)
    axes = _axes(batch, batch_axis)
    B = _fed_batch_size(feed_dict, batch, axes)
    if B % num_slices:
        raise ValueError(f"{num_slices} slices do not divide the fed batch of {B}")
    step = B // num_slices
    for m in range(num_slices):
        feeds = dict(feed_dict)
        for b, axis in zip(batch, axes):
            # [..., B, ...] -> [..., B/M, ...] on the batch axis
            feeds[b] = np.take(np.asarray(feed_dict[b]),
                               np.arange(m * step, (m + 1) * step), axis=axis)
        yield feeds


def _xs_list(xs):
    return list(xs) if isinstance(xs, (list, tuple)) else [xs]


class SliceLoop:
    """tf.gradients(sum(ys), xs), built once, run one slice of the batch at a time
    (the loop users write today; `run` is what the demo times)."""

    def __init__(self, ys, xs):
        self.xs = _xs_list(xs)
        self.gradients = _dense_gradients(tf.reduce_sum(ys), self.xs)  # [*x.shape] each

    def run(self, sess, feed_dict, num_slices, batch=None, batch_axis=None):
        """[M, *x.shape] per x: one `sess.run` per slice of the fed batch."""
        rows = [sess.run(self.gradients, feeds)
                for feeds in slice_feeds(feed_dict, batch, num_slices, batch_axis)]
        return [np.stack([row[k] for row in rows]) for k in range(len(self.xs))]


def loop_microbatch_gradients(sess, ys, xs, feed_dict, num_microbatches, batch=None,
                              batch_axis=None):
    """[M, *x.shape] per x: one `sess.run` of tf.gradients(sum(ys), xs) per slice of
    the fed batch of B examples (slice m: examples m*B/M ... (m+1)*B/M - 1)."""
    return SliceLoop(ys, xs).run(sess, feed_dict, num_microbatches, batch, batch_axis)


def loop_per_example_gradients(sess, ys, xs, feed_dict, batch=None, batch_axis=None):
    """[B, *x.shape] per x: one `sess.run` of tf.gradients(sum(ys), xs) per example."""
    return loop_microbatch_gradients(sess, ys, xs, feed_dict,
                                     _fed_batch_size(feed_dict, batch, batch_axis),
                                     batch, batch_axis)


def loop_per_example_jacobians(sess, ys, xs, feed_dict, batch=None):
    """[B, *out, *x.shape] per x: one `sess.run` per example of the K gradients
    d ys[0, k] / d x, k over the output entries of one example."""
    xs = _xs_list(xs)
    out = ys.shape[1:].as_list()
    K = int(np.prod(out, dtype=np.int64))
    entries = tf.reshape(ys, [-1, K])  # [1, *out] -> [1, K]
    rows_per_k = [_dense_gradients(tf.reduce_sum(entries[:, k]), xs) for k in range(K)]
    B = _fed_batch_size(feed_dict, batch)
    per_example = []
    for feeds in slice_feeds(feed_dict, batch, B):
        values = sess.run(rows_per_k, feeds)  # K x (list per x)
        per_example.append([np.stack([values[k][j] for k in range(K)]) for j in range(len(xs))])
    return [np.stack([e[j] for e in per_example]).reshape([B] + out + list(e_shape))
            for j, e_shape in enumerate(x.shape.as_list() for x in xs)]


def loop_several_batches_gradients(sess, ys, xs, feed_dict, batches, num_microbatches=None):
    """[G, *x.shape] per x for `ys` that joins several batches along axis 0
    (`ys = tf.concat([f(s1), f(s2)], 0)`): rows of the first batch, then of the second.

    Row r is tf.gradients(sum(ys), xs) run with the examples of row r's group fed to
    its own batch and an empty batch ([0, ...]) to every other one. `batches`: one list
    of feed keys per batch, in row order, e.g. [[s1], [s2]]; `num_microbatches`: M, or
    None for one group per example (every group must lie in one batch).
    """
    xs = _xs_list(xs)
    gradients = _dense_gradients(tf.reduce_sum(ys), xs)
    batches = [_xs_list(keys) for keys in batches]
    sizes = [len(feed_dict[keys[0]]) for keys in batches]
    g = 1 if num_microbatches is None else sum(sizes) // num_microbatches
    rows = []
    for s, keys in enumerate(batches):
        for start in range(0, sizes[s], g):
            feeds = dict(feed_dict)
            for other, other_keys in enumerate(batches):
                for key in other_keys:
                    value = np.asarray(feed_dict[key])
                    feeds[key] = value[start:start + g] if other == s else value[:0]
            rows.append(sess.run(gradients, feeds))
    return [np.stack([row[k] for row in rows]) for k in range(len(xs))]

"""Sparse per-example gradients of embedding weights x [V, *row]: only the looked-up rows.

Example i's gradient touches only the rows it looked up (a `tf.IndexedSlices`); with N
(example, row) pairs over the batch (B examples, or M microbatches), a
`PerExampleIndexedSlices` stands for

    dense[example_ids[n], indices[n]] += values[n]      for n in 0 ... N-1

(repeated (example, row) pairs add up, as `tf.IndexedSlices` sums repeated indices).
"""

import collections

import tensorflow as tf

__all__ = ["PerExampleIndexedSlices", "dense_rows"]


class PerExampleIndexedSlices(collections.namedtuple(
        "PerExampleIndexedSlices", ["values", "indices", "example_ids", "dense_shape"])):
    """The per-example gradients of an embedding weight x [V, *row], kept sparse.

    Fields (graph tensors):
      values: [N, *row], one gradient row per (example, lookup).
      indices: [N] int, the row of x each entry of `values` belongs to (0 <= id < V).
      example_ids: [N] int (indices' dtype), the example (or microbatch) it belongs
        to (0 <= id < B).
      dense_shape: [1 + rank(x)] int (indices' dtype), the dense shape [B, V, *row].

    Example:
      ids = keras.Input(shape=(4,), dtype="int32")
      embedding = keras.layers.Embedding(1000, 8)
      ys = tf.reduce_sum(embedding(ids), axis=[1, 2])                 # [B]
      (g,) = pertower.per_example_gradients(ys, embedding.trainable_weights,
                                            batch_size=32, sparse=True)
      g.values, g.indices, g.example_ids   # [128, 8], [128], [128]; 4 lookups per example
      dense = g.to_dense()                 # [32, 1000, 8]
    """

    __slots__ = ()

    def to_dense(self, name=None):
        """The dense per-example gradients, [B, V, *row] (repeated pairs summed)."""
        with tf.name_scope(name or "to_dense"):
            # [N] and [N] -> [N, 2] (example, row) coordinates
            coordinates = tf.stack([self.example_ids, self.indices], axis=1)
            return tf.scatter_nd(coordinates, self.values, self.dense_shape)


def stack_tower_slices(per_tower, copies):
    """T `tf.IndexedSlices` gradients (tower t's: values [n_t, *row], indices [n_t])
    -> a `PerExampleIndexedSlices`; `copies`: the T copies, [V, *row] each."""
    dtype = per_tower[0].indices.dtype
    indices = [tf.cast(g.indices, dtype) for g in per_tower]
    values = tf.concat([g.values for g in per_tower], axis=0)  # T x [n_t, *row] -> [N, *row]
    example_ids = tf.concat([tf.fill(tf.shape(i), tf.constant(t, dtype))  # T x [n_t] -> [N]
                             for t, i in enumerate(indices)], axis=0)
    T = len(per_tower)
    dense_shape = tf.concat([tf.constant([T], dtype), tf.shape(copies[0], out_type=dtype)],
                            axis=0)                                   # [1 + rank(x)]
    return PerExampleIndexedSlices(values=values, indices=tf.concat(indices, axis=0),
                                   example_ids=example_ids, dense_shape=dense_shape)


def dense_rows(gradient, like):
    """`gradient` of `like` dense, [*like.shape]: a `tf.IndexedSlices` scattered
    (repeated rows added); any other gradient unchanged."""
    if isinstance(gradient, tf.IndexedSlices):
        num_rows = tf.shape(like, out_type=gradient.indices.dtype)[0]
        return tf.math.unsorted_segment_sum(gradient.values, gradient.indices, num_rows)
    return gradient

"""Helpers shared by the rules: group the example-major rows, and the dense identities
(the per-example outer products and the ghost norm: `rules.matmul` states them).

Notation: G groups of contiguous examples, k rows per example, T = rows per group.
"""

import tensorflow as tf

from pertower._layout._shapes import to_groups


def dim(tensor, axis):
    """The size of `axis` of `tensor`: static int if known, else a scalar tensor."""
    static = tf.compat.dimension_value(tensor.shape[axis])
    return static if static is not None else tf.shape(tensor)[axis]


def dense_squared_norms(A, dZ, B, k):
    """[B] ||sum_t a_it ⊗ dz_it||^2 without forming the outer products (the ghost norm)."""
    A_g = to_groups(A, B)     # [B, k, d]
    dZ_g = to_groups(dZ, B)   # [B, k, n]
    if k == 1:
        return (tf.reduce_sum(tf.square(A_g), axis=[1, 2]) *
                tf.reduce_sum(tf.square(dZ_g), axis=[1, 2]))      # [B]
    a_gram = tf.einsum("btd,bsd->bts", A_g, A_g)                   # [B, k, k]
    dz_gram = tf.einsum("btn,bsn->bts", dZ_g, dZ_g)                # [B, k, k]
    return tf.reduce_sum(a_gram * dz_gram, axis=[1, 2])            # [B]


def ghost_norm_is_cheaper(T, d, n):
    """Mixed ghost clipping's choice (Bu, Mao, Xu 2022, arXiv 2205.10683, section 3): the
    ghost norm of T rows, ~2 T^2 (d + n) multiply-adds, is not dearer than forming the
    [d, n] gradient, ~2 T d n."""
    return None not in (T, d, n) and T * (d + n) <= d * n


def example_rows(analysis, activation, output):
    """The Rows of `activation` when it and `output` are example-major on axis 0 (lead
    0, k known); otherwise a string saying what is missing."""
    rows = analysis.rows(activation)
    if rows is None or rows.lead != 0 or rows.k is None:
        return (f"the rows of its input {activation.name} could not be traced to "
                "examples")
    out_rows = analysis.rows(output)
    if out_rows is None or out_rows.lead != 0 or out_rows.k is None:
        return f"the rows of its output {output.name} could not be traced to examples"
    return rows


def scale_rows(tensor, factors):
    """[B*k, ...] with example i's k rows multiplied by factors[i] ([B])."""
    B = dim(factors, 0)
    flat = tf.reshape(tensor, group_shape(B, [-1]))                     # [B, k*...]
    scaled = flat * tf.cast(factors, tensor.dtype)[:, None]              # [B, k*...]
    out = tf.reshape(scaled, tf.shape(tensor))                          # [B*k, ...]
    out.set_shape(tensor.shape)
    return out


def group_shape(G, dims):
    """[G, *dims], the sizes themselves (for `tf.broadcast_to`, `tf.zeros`, a reshape);
    G may be an int or a scalar tensor."""
    if isinstance(G, int) and not any(isinstance(d, tf.Tensor) for d in dims):
        return [G] + list(dims)
    return tf.stack([tf.convert_to_tensor(d, tf.int32) for d in [G] + list(dims)])

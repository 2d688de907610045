"""Per-example gradient norms: the L2 norm of each example's whole gradient.

Notation:
    B   examples in the batch       x   one weight (entry of `xs`)
    g_i the gradient of example i's value with respect to all of xs, flattened

    norms[i] = ||g_i||_2 = sqrt(sum_x ||d sum(ys[i]) / d x||^2)

This version materializes the per-example gradients ([B, *x.shape] per weight) and
reduces them; cheaper forms that never hold them are added per op.
"""

import math

import tensorflow as tf

from pertower import gradients as gradients_lib
from pertower import memory

__all__ = ["per_example_norms"]


def per_example_norms(ys, xs, batch=None, batch_size=None, name=None, method="auto",
                      validate=False, memory_limit=None, devices=None):
    """The L2 norm of each example's gradient over all of `xs`, [B].

    Args:
      ys, xs, batch, batch_size, name, method, validate, memory_limit, devices: as in
        `pertower.per_example_gradients`; a weight `ys` does not reach adds 0.

    Returns:
      A [B] tensor of ys's dtype: entry i is the L2 norm of the concatenation of
      `tf.gradients(tf.reduce_sum(ys[i]), x)` over every x, for example i alone.

    Example (per-example clipping factors for DP-SGD):
      norms = pertower.per_example_norms(loss, model.trainable_weights, batch_size=64)
      factors = tf.minimum(1.0, clip / (norms + 1e-12))          # [64]
    """
    function_name = "per_example_norms"
    gradients_lib.check_method(method, function_name)
    # memory.py: this form holds the per-example gradients, so their estimate applies
    memory.check_memory(ys, xs, batch, batch_size, None, 1, memory_limit, function_name)
    with tf.name_scope(name or function_name):
        per_example = gradients_lib.per_example_gradients(
            ys, xs, batch=batch, batch_size=batch_size, name="gradients", method=method,
            validate=validate, memory_limit=math.inf,  # validate: independence.py
            devices=devices)
        squares = []
        for g in per_example:                          # [B, *x.shape]
            axes = list(range(1, g.shape.rank))
            squares.append(tf.reduce_sum(tf.square(g), axis=axes))  # [B]
        return tf.sqrt(tf.add_n(squares))              # [B]

"""Rule for BiasAdd: Z = A + b, b [C] added along the channel axis (last for NHWC, the
Keras and tf.nn default; axis 1 for NCHW).

Identity: dZ/db sums over every position, so grad_i(b) = sum over example i's rows and
positions of dz, [C].
"""

import tensorflow as tf

from pertower._layout import _rows
from pertower._layout import _shapes
from pertower.rules import registry as registry_lib


class BiasAddRule(registry_lib.Rule):
    """Per-example sums of dZ over positions."""

    def match(self, op, slot, analysis):
        if slot != 1:
            return "the weight is BiasAdd's value input, not its bias"
        if op.get_attr("data_format") not in (b"NHWC", b"N...C", b"NCHW", b"NC..."):
            return f"BiasAdd with data_format {op.get_attr('data_format').decode()}"
        if op.get_attr("data_format").startswith(b"NC") and op.inputs[0].shape.rank is None:
            return "BiasAdd NCHW on an input without a static rank"
        return self.example_use(op, slot, analysis)

    def per_group(self, use, dZ, G):
        # [G*k, ..., C] (or [G*k, C, ...]) -> [G, C]: each group's rows and positions summed
        channel = 1 if use.op.get_attr("data_format").startswith(b"NC") else dZ.shape.rank - 1
        return _shapes.group_sum(dZ, G, use.rows.k, channel)

    def sum_squared(self, use, dZ_columns, B, per_example=False):
        # [C, B*k, ..., Ch] -> [C*B, T, Ch] -> [C, B, Ch]: each column's per-example sums
        C = _rows.dim(dZ_columns, 0)
        if use.op.get_attr("data_format").startswith(b"NC") and dZ_columns.shape.rank > 3:
            # NCHW: [C, B*k, Ch, ...] -> [C, B*k, Ch], the positions summed first
            dZ_columns = tf.reduce_sum(dZ_columns, axis=list(range(3, dZ_columns.shape.rank)))
        folded = tf.reshape(dZ_columns, tf.concat([[-1], tf.shape(dZ_columns)[2:]], 0))
        per_column = tf.reduce_sum(_rows.to_groups(folded, C * B), axis=1)    # [C*B, Ch]
        squares = tf.reduce_sum(tf.reshape(tf.square(per_column), tf.stack(
            [C, B, -1])), axis=0)                                                # [B, Ch]
        return squares if per_example else tf.reduce_sum(squares, axis=0)       # [Ch]

    def sum_squared_size(self, use, C, per_example=False):
        # numbers per example `sum_squared` holds: C per-column sums (and the result)
        return use.weight_shape.num_elements() * (C + per_example)

    # sum_i f_i grad_i(w): the one-group (batch) gradient of dZ scaled per example
    clipped_sum = registry_lib.batch_gradient_clipped_sum


def register(registry):
    """Adds the BiasAdd rule to `registry`."""
    registry.register("BiasAdd", BiasAddRule())

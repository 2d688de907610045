"""How a value computed from the batch's size is used: as data or as a size.

Notation: B examples in the batch, T towers of B/T examples, n = tf.shape(x)[0].

A SIZE value (`lattice.SIZE`: n, tf.size(x), tf.range(n), a shape [n, d]) means B in
the whole batch and B/T in a tower that replays the graph on B/T examples. Which of the
two a replay must feed depends on the use, decided here and nowhere else:

* **data**: the size enters the arithmetic of the values that reach `ys`: it becomes a
  float (`cost / tf.cast(n, tf.float32)`) or scales per-example integers
  (`labels * n`, a scalar size in elementwise arithmetic). Its documented meaning is the
  whole batch's B, so the towers read it from the whole batch's graph
  (`Analysis.size_data_edges`), and the rules' batched backward pass sees B as `ys` does.
* **size**: anything else: a shape, an axis, a bound, a range over the examples, an
  index stacked with labels for `tf.gather_nd`, per-example segment ids, the positions
  `embedding_lookup` partitions by, a `num_segments`. These must agree with the other
  tensors of the tower, so the towers keep the tower's own size (the replayed op sees
  its slice, as the batched op sees the batch).

`is_row_index` proves the classic TF1 index `tf.range(n)`: entry i of it is i, the
row of example i, so `tf.gather_nd(logits, tf.stack([tf.range(n), labels], 1))` picks a
value of example i for row i (`transfer_index.gather_nd`), in the batch and in every
tower alike.
"""

import tensorflow as tf

from pertower import _op_types as op_types
from pertower._batch_axis import static
from pertower._batch_axis.lattice import SIZE, Rows

__all__ = ["is_data_use", "is_row_index"]

# Ops through which an integer keeps its value (an index stays the same index).
_SAME_VALUE_OP_TYPES = frozenset({"Identity", "Cast", "Snapshot"})


def is_data_use(op, j, ins, outs):
    """Whether the integer SIZE input j of `op` enters the values reaching `ys` (the
    whole batch's B) rather than sizing or indexing the tower's tensors.

    Args:
      op: the consumer; j: the index of its SIZE input (not a shape slot, an integer).
      ins, outs: the lattice values of op's inputs and outputs.
    """
    if op.type == "Cast":
        return any(t.dtype.is_floating or t.dtype.is_complex for t in op.outputs)
    if op.type in op_types.ELEMENTWISE_OP_TYPES:
        # a scalar size scaling per-example values (labels * n); a [B] range added to
        # them (tf.range(n) * C + labels) is an index of the tower's own rows
        return op.inputs[j].shape.rank == 0 and any(v is not SIZE for v in outs)
    return False


def is_row_index(value_of, tensor, rows):
    """Whether `tensor`, [B] (or [B, 1]), is provably tf.range(n) with n the number of examples
    of a tensor laid out as `rows` (one row per example along `rows.lead`): entry i is
    the row of example i.

    Args:
      value_of: tensor -> lattice value (the scan's).
      tensor: a rank-1 integer tensor.
      rows: the `Rows` value of the tensor indexed (its batch axis rows.lead, k rows
        per example).
    """
    tensor = _column(tensor)
    while tensor.op.type in _SAME_VALUE_OP_TYPES and tensor.op.inputs:
        tensor = tensor.op.inputs[0]
    op = tensor.op
    if op.type != "Range" or rows.k != 1:
        return False
    start, delta = static.static_value(op.inputs[0]), static.static_value(op.inputs[2])
    if start is None or delta is None or int(start) != 0 or int(delta) != 1:
        return False
    return _is_batch_size(value_of, op.inputs[1])


def _column(tensor):
    """The [B] tensor of which the [B, 1] `tensor` is a column (tf.expand_dims(r, 1),
    r[:, None], tf.reshape(r, [-1, 1])); `tensor` itself otherwise."""
    op = tensor.op
    if tensor.shape.rank != 2 or tf.compat.dimension_value(tensor.shape[1]) != 1:
        return tensor
    if op.type in ("ExpandDims", "Reshape", "StridedSlice") and op.inputs[0].shape.rank == 1:
        if op.type == "StridedSlice" and op.get_attr("new_axis_mask") != 2:
            return tensor
        return op.inputs[0]
    return tensor


def _is_batch_size(value_of, n):
    """Whether the scalar `n` is B: tf.shape(x)[a] with a the batch axis of x (one row
    per example), or tf.size(x) of a [B] tensor x."""
    while n.op.type in _SAME_VALUE_OP_TYPES and n.op.inputs:
        n = n.op.inputs[0]
    op = n.op
    if op.type == "Size":
        x = op.inputs[0]
        value = value_of(x)
        return isinstance(value, Rows) and value.k == 1 and x.shape.rank == 1
    if op.type != "StridedSlice" or op.inputs[0].op.type != "Shape":
        return False
    if op.get_attr("shrink_axis_mask") != 1 or op.get_attr("ellipsis_mask") or op.get_attr(
            "new_axis_mask") or op.get_attr("begin_mask") & 1:
        return False
    begin = static.static_value(op.inputs[1])
    if begin is None or len(begin) != 1:
        return False
    x = op.inputs[0].op.inputs[0]
    value = value_of(x)
    return (isinstance(value, Rows) and value.k == 1 and x.shape.rank is not None
            and int(begin[0]) % x.shape.rank == value.lead)

"""The batch-axis scan on random chains of layout ops (hypothesis): a reduction after the
chain is a coupling exactly when it reduces the batch axis, tracked by hand. (Moved from
tests/test_mixing.py, which holds the scan's other checks.)"""

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

from pertower import _batch_axis
from pertower import _graph_walk as graph_walk


def _replayed(ys, batch):
    """The ops between the batch and `ys` (as tests/test_mixing.py's scan checks)."""
    return graph_walk.downstream_ops(batch, graph_walk.upstream_ops([ys]))

# -- property: the scan follows the batch axis through random layout ops ----------

LAYOUT_STEPS = ["transpose", "expand_dims", "merge_after", "split_after", "elementwise",
                "slice_other", "concat_other", "tile_other", "squeeze_ones", "flatten_rows"]


def _apply(step, t, batch_axis, draw_int, draw_permutation):
    """Applies one layout op to t; returns (new t, its batch axis), the axis computed
    here by hand."""
    shape = t.shape.as_list()
    rank = len(shape)
    others = [i for i in range(rank) if i != batch_axis]
    if step == "transpose":
        perm = draw_permutation(rank)
        return tf.transpose(t, perm), perm.index(batch_axis)
    if step == "expand_dims":
        k = draw_int(0, rank)
        return tf.expand_dims(t, k), batch_axis + (k <= batch_axis)
    if step == "merge_after" and batch_axis + 2 < rank + 1 and batch_axis + 2 <= rank - 1:
        # merge the two axes after the batch axis: [.., B, a, b, ..] -> [.., B, a*b, ..]
        a, b = shape[batch_axis + 1], shape[batch_axis + 2]
        new = tf.concat([tf.shape(t)[:batch_axis + 1], [a * b], tf.shape(t)[batch_axis + 3:]], 0)
        return tf.reshape(t, new), batch_axis
    if step == "split_after" and batch_axis + 1 < rank and shape[batch_axis + 1] % 2 == 0:
        n = shape[batch_axis + 1]
        new = tf.concat([tf.shape(t)[:batch_axis + 1], [2, n // 2], tf.shape(t)[batch_axis + 2:]], 0)
        return tf.reshape(t, new), batch_axis
    if step == "elementwise":
        return tf.tanh(t) * 2.0 + t, batch_axis
    if step == "slice_other" and others:
        k = others[draw_int(0, len(others) - 1)]
        index = [slice(None)] * rank
        index[k] = slice(0, 1)
        return t[tuple(index)], batch_axis
    if step == "concat_other" and others:
        k = others[draw_int(0, len(others) - 1)]
        return tf.concat([t, t * 3.0], axis=k), batch_axis
    if step == "tile_other" and others:
        multiples = [1] * rank
        multiples[others[draw_int(0, len(others) - 1)]] = 2
        return tf.tile(t, multiples), batch_axis
    if step == "squeeze_ones":
        ones = [i for i in others if shape[i] == 1]
        if ones:
            return tf.squeeze(t, axis=ones), batch_axis - sum(1 for i in ones if i < batch_axis)
    if step == "flatten_rows" and batch_axis == 0 and rank >= 2:
        return tf.reshape(t, [-1, int(np.prod(shape[1:]))]), 0
    return t, batch_axis


@settings(max_examples=20, deadline=None, derandomize=True)
@given(data=st.data())
def test_random_layout_chains_keep_the_batch_axis(data):
    """After a random chain of layout ops, a reduction over a random set of axes is a
    coupling exactly when the set holds the batch axis (tracked here by hand); 20 chains
    (80 with -m heavy below)."""
    _check_a_random_layout_chain(data)


@pytest.mark.heavy
@settings(max_examples=80, deadline=None, derandomize=True)
@given(data=st.data())
def test_more_random_layout_chains_keep_the_batch_axis(data):
    _check_a_random_layout_chain(data)


def _check_a_random_layout_chain(data):
    """One chain of up to 6 layout ops drawn from `data`, then a reduction: see
    `test_random_layout_chains_keep_the_batch_axis`."""
    def draw_int(low, high):
        return data.draw(st.integers(low, high))

    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 2, 3, 4], name="x")
        t, batch_axis = x, 0
        def draw_permutation(rank):
            return data.draw(st.permutations(list(range(rank))))

        for step in data.draw(st.lists(st.sampled_from(LAYOUT_STEPS), max_size=6)):
            t, batch_axis = _apply(step, t, batch_axis, draw_int, draw_permutation)
        rank = t.shape.rank
        axes = sorted(data.draw(st.sets(st.integers(0, rank - 1), min_size=1)))
        reduced = tf.reduce_sum(t, axis=axes, name="reduced")
        found = _batch_axis.find_couplings(_replayed(reduced, [x]), [x])
        if batch_axis in axes:
            assert [c.op.name for c in found] == ["reduced"], (axes, batch_axis, t.shape)
            assert f"axis {batch_axis}, the batch axis" in found[0].reason
        else:
            assert found == [], (axes, batch_axis, [c.reason for c in found])

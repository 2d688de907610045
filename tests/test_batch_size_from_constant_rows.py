"""Batch sizes computed from constant rows (issue 17, item 12): `cost /
tf.reduce_sum(tf.ones_like(cost))` divides by B like `tf.shape`/`tf.size` scaling, no
coupling. Each member against the documented meaning: row i's gradient as computed on
the whole batch (`common.loop_rows_of_batch`, the loss / B of the one-example
definition with the whole batch's B), in every method.
"""

import numpy as np
import pytest
import tensorflow as tf

import pertower
from pertower import _batch_axis
from pertower import _graph_walk as graph_walk
from tests import common

B = 4


def _batch_size_from(cost, kind):
    """B as a float computed from `cost` [B] in the way `kind` names."""
    if kind == "ones_like":
        return tf.reduce_sum(tf.ones_like(cost))
    if kind == "v1_ones_like":                    # a Fill of tf.shape(cost)
        return tf.reduce_sum(tf.compat.v1.ones_like(cost))
    if kind == "zeros_like_plus_one":
        return tf.reduce_sum(tf.zeros_like(cost) + 1.0)
    if kind == "size_over_mean_of_ones":
        return tf.cast(tf.size(cost), tf.float32) / tf.reduce_mean(tf.ones_like(cost))
    raise ValueError(kind)


KINDS = ["ones_like", "v1_ones_like", "zeros_like_plus_one", "size_over_mean_of_ones"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_batch_size_from_constant_rows_scales_like_tf_shape(kind):
    """Each method's per-example gradients on one graph, run together."""
    methods = ("auto", "rules", "towers")
    with tf.Graph().as_default() as graph:
        common.seed_weights(41)
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        w = tf.compat.v1.get_variable("w", [3, 2])
        cost = tf.reduce_sum(tf.tanh(tf.matmul(x, w)) ** 2, axis=1)          # [B]
        size = _batch_size_from(cost, kind)
        ys = cost / size                                                     # [B]
        analysis = _batch_axis.analyze(ys, [x], graph_walk.upstream_ops([ys]), B)
        assert analysis.verdict == "independent", (analysis.couplings, analysis.lost_at)
        assert analysis.size_data_edges, "no size-data edge for the towers to feed"
        grads = [pertower.per_example_gradients(ys, [w], batch_size=B, method=method)
                 for method in methods]
        feed = {x: np.random.RandomState(0).randn(B, 3).astype(np.float32)}
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            got, fed_size = sess.run([grads, size], feed)
            want = common.loop_rows_of_batch(sess, ys, [w], feed)
    assert fed_size == B
    for method, values in zip(methods, got):
        common.assert_all_close(values, want, kind="tight", what=f"{kind} {method}")


def test_a_reduction_of_rows_that_follow_the_values_is_still_a_coupling():
    """tf.ones_like(cost) * cost is not constant: its sum over the batch couples."""
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        w = tf.compat.v1.get_variable("w", [3, 2])
        cost = tf.reduce_sum(tf.tanh(tf.matmul(x, w)) ** 2, axis=1)          # [B]
        ys = cost / tf.reduce_sum(tf.ones_like(cost) * cost, name="total")
        analysis = _batch_axis.analyze(ys, [x], graph_walk.upstream_ops([ys]), B)
    assert [c.op.name for c in analysis.couplings] == ["total"]

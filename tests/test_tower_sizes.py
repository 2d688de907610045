"""Batch-size values used as shapes, indices, ranges, segment ids or partitions (issue 17
items 3, 5, 6).

The towers replay the graph on B/T examples. A size used as data (`loss / n`, with
n = tf.shape(x)[0]) keeps its documented meaning, the whole batch's B; a size used as
a shape, an index stacked with labels for `tf.gather_nd`, per-example segment ids, a
`num_segments` or the positions `embedding_lookup` partitions by is the tower's own
(`pertower._batch_axis.size_uses`). Each graph (tests/tower_size_cases.py)
runs with method="towers" and "auto" against the one-example loop, here with
TensorFlow 2 shapes and in tests/legacy/test_tower_sizes.py under disable_v2_behavior().
Rows mixed by a fed permutation or fixed positions through `gather_nd` are refused
with pertower's message, naming the op.
"""

import pytest
import tensorflow as tf

import pertower
from pertower import _batch_axis
from pertower import _graph_walk as graph_walk
from tests import tower_size_cases as sizes

B = sizes.B


# method="auto" in the default run on one kind per use of the size (a row index, a
# segment id, a mean's n, a partitioned lookup); the towers on every kind
_AUTO_DEFAULT_RUN = ("gather_nd_stack", "segment_sum", "mean", "partitioned_lookup")


@pytest.mark.parametrize("kind, method", [
    pytest.param(kind, method, marks=pytest.mark.heavy if method == "auto" and kind not in
                 _AUTO_DEFAULT_RUN else ())
    for kind in sizes.KINDS for method in ("towers", "auto")])
def test_size_uses_match_the_loop(kind, method):
    sizes.check_kind(kind, method)


@pytest.mark.parametrize("what", ["sparse", "norms"])
@pytest.mark.parametrize("kind", ["partitioned_lookup", "partitioned_lookup_div"])
def test_a_partitioned_embedding_lookup_gives_sparse_rows_and_norms(kind, what):
    sizes.check_kind(kind, "towers", what)


def _analysis(case):
    with case.graph.as_default():
        batch = [t for t in case.feed if t.op.type == "Placeholder"]
        return _batch_axis.analyze(case.ys, batch, graph_walk.upstream_ops([case.ys]))


def test_only_the_cast_of_the_size_is_data():
    """n enters `loss / n` through one Cast (the whole batch's B); as a range stacked
    with labels, a segment id or a num_segments it is no data edge."""
    mean = _analysis(sizes.build("mean"))
    assert [(op.type, j) for op, j in mean.size_data_edges] == [("Cast", 0)]
    called = _analysis(sizes.build("function_mean"))   # the call's input n, not m
    assert [(op.type, j) for op, j in called.size_data_edges] == [("PartitionedCall", 1)]
    scaled = _analysis(sizes.build("scaled_labels"))   # labels * n
    assert [(op.type, j) for op, j in scaled.size_data_edges] == [("Mul", 1)]
    for kind in ("gather_nd_stack", "gather_nd_concat", "segment_sum", "unsorted_segment_sum",
                 "segment_mean_repeat", "range_as_shape", "partitioned_lookup",
                 "function_gather_nd"):
        assert _analysis(sizes.build(kind)).size_data_edges == [], kind


@pytest.mark.parametrize("kind", ["gather_nd_stack", "gather_nd_concat", "gather_nd_size"])
def test_gather_nd_by_the_row_index_is_proven_and_served_by_the_rules(kind):
    """tf.gather_nd(logits, tf.stack([tf.range(n), labels], 1)) (or the concat of their
    columns) reads example i only:
    the verdict is independent and the rules serve the weight (no towers)."""
    case = sizes.build(kind)
    analysis = _analysis(case)
    assert analysis.verdict == "independent", analysis.lost_at
    assert analysis.rows(case.ys) == _batch_axis.Rows(0, 1, 1)
    with case.graph.as_default():
        explained = pertower.explain(case.ys, case.xs, batch_size=B)
    assert [weight.method for weight in explained.weights] == ["rules"], str(explained)


@pytest.mark.parametrize("method", ["towers", "auto"])
@pytest.mark.parametrize("kind", sizes.REFUSED_KINDS)
def test_rows_mixed_by_index_are_refused_naming_the_op(kind, method):
    case = sizes.build(kind)
    with case.graph.as_default():
        with pytest.raises(ValueError, match=r"pertower\.per_example_gradients: the op "
                           r"'GatherNd' \(GatherNd\) between the batch and `ys` couples"):
            pertower.per_example_gradients(case.ys, case.xs, batch_size=B, method=method)


def test_a_row_index_of_another_length_is_refused():
    """tf.range(n - 1) is not the row index: gathering by it picks examples by position."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 3])
        w = tf.compat.v1.get_variable("w", [3, 2])
        h = tf.matmul(x, w)
        rows = tf.range(tf.shape(x)[0] - 1)
        ys = tf.gather_nd(h, tf.stack([rows, tf.zeros_like(rows)], 1))
        with pytest.raises(ValueError, match="whose first column is not tf.range"):
            pertower.per_example_gradients(ys, [w], batch_size=B, method="towers")

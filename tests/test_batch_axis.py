"""The batch-axis analysis (`pertower._batch_axis`): verdicts, where a proof is lost,
SIZE values, and the per-op rules through ops the analysis follows, against the oracle."""

import pytest
import tensorflow as tf

import pertower
from pertower import _batch_axis
from pertower import _context
from pertower import _dispatch
from pertower import _graph_walk as graph_walk
from pertower import _op_types as op_types
from pertower import oracle
from tests import cases
from tests import common

B = 4


def _analyze(ys, batch):
    return _batch_axis.analyze(ys, batch, graph_walk.upstream_ops([ys]))


def _plan(ys, xs):
    return _dispatch.make_plan(ys, xs, validate=False, refuse=False)


def _image(h):
    """[B, 4] -> [B, 2, 2, 1]."""
    return tf.reshape(h, [-1, 2, 2, 1])


def _sum_rows(t):
    """[B, ...] -> [B]."""
    return tf.reduce_sum(t, axis=list(range(1, t.shape.rank)))


# (id, op type that must appear, f(h) -> [B] from the [B, 4] activation h of a Dense MLP)
OP_CASES = [
    ("xlogy", "Xlogy", lambda h: _sum_rows(tf.math.xlogy(h, tf.nn.softplus(h) + 1.0))),
    ("atan", "Atan", lambda h: _sum_rows(tf.atan(h))),
    ("cosh", "Cosh", lambda h: _sum_rows(tf.cosh(h))),
    ("multiply_no_nan", "MulNoNan", lambda h: _sum_rows(tf.math.multiply_no_nan(h, tf.sin(h)))),
    ("ensure_shape", "EnsureShape", lambda h: _sum_rows(tf.ensure_shape(h, [None, 4]) ** 2)),
    ("clip_by_value", "Minimum", lambda h: _sum_rows(tf.clip_by_value(h, -0.3, 0.3) ** 2)),
    ("clip_by_value_op", "ClipByValue", lambda h: _sum_rows(
        tf.raw_ops.ClipByValue(t=h, clip_value_min=-0.3, clip_value_max=0.3) ** 2)),
    ("broadcast_to", "BroadcastTo", lambda h: _sum_rows(tf.sin(tf.broadcast_to(
        h[:, None, :], tf.stack([tf.shape(h)[0], 3, 4]))))),
    ("max_pool_v2", "MaxPoolV2", lambda h: _sum_rows(tf.raw_ops.MaxPoolV2(
        input=_image(h), ksize=[1, 2, 1, 1], strides=[1, 1, 1, 1], padding="VALID"))),
    ("lrn", "LRN", lambda h: _sum_rows(tf.nn.local_response_normalization(
        tf.reshape(h, [-1, 1, 2, 2]), depth_radius=1))),
    ("resize_bilinear", "ResizeBilinear", lambda h: _sum_rows(tf.sin(
        tf.image.resize(_image(h), [3, 3], method="bilinear")))),
    ("resize_nearest", "ResizeNearestNeighbor", lambda h: _sum_rows(tf.sin(
        tf.image.resize(_image(h), [3, 3], method="nearest")))),
    ("resize_bicubic", "ResizeBicubic", lambda h: _sum_rows(tf.sin(
        tf.image.resize(_image(h), [3, 3], method="bicubic")))),
    ("resize_area", "ResizeArea", lambda h: _sum_rows(tf.sin(
        tf.image.resize(_image(h), [3, 3], method="area")))),
]


# Op types TensorFlow registers no gradient for.
_NO_GRADIENT = frozenset({"ResizeArea"})


@pytest.fixture(scope="module")
def features():
    """One graph and session for every case: x [B, 3] -> Dense(6, tanh) -> Dense(4)
    (`cases.build_hidden_features`); (graph, sess, x, h [B, 4], weights, feed)."""
    case = cases.build_hidden_features(B)
    yield case.graph, case.sess, case.batch[0], case.outputs, case.xs, case.feed
    case.sess.close()


@pytest.mark.parametrize("op_type,build", [c[1:] for c in OP_CASES], ids=[c[0] for c in OP_CASES])
def test_ops_in_the_table_keep_the_rules_and_match_the_oracle(features, op_type, build):
    graph, sess, x, h, xs, feed = features
    with graph.as_default():
        ys = build(h)                                           # [B]
        assert any(op.type == op_type for op in graph_walk.upstream_ops([ys])), op_type
        analysis = _analyze(ys, [x])
        assert analysis.verdict == "independent", analysis.lost_at
        assert analysis.couplings == [] and analysis.lost_at is None
        assert _plan(ys, xs).fallback == []
        if op_type in _NO_GRADIENT:
            pytest.skip(f"TensorFlow registers no gradient for {op_type}: the analysis and "
                        f"the plan are checked, but no gradient can be compared with the loop")
        got = pertower.per_example_gradients(ys, xs, method="rules")
        want = oracle.loop_per_example_gradients(sess, ys, xs, feed)
    common.assert_all_close(sess.run(got, feed), want, what=op_type, kind="deep")


def test_every_elementwise_op_type_has_a_transfer_function():
    from pertower._batch_axis import analysis  # pylint: disable=import-outside-toplevel
    extra = {"ClipByValue", "BroadcastTo", "EnsureShape", "MaxPoolV2", "LRN",
             "ResizeBilinear", "ResizeNearestNeighbor", "ResizeBicubic", "ResizeArea"}
    missing = sorted((op_types.ELEMENTWISE_OP_TYPES | extra) - set(analysis.TRANSFERS))
    assert missing == []


# (id, f(h) -> [B] that moves examples, words lost_at's op name must contain)
LOST_CASES = [
    ("scan_over_the_batch", lambda h: _sum_rows(tf.scan(lambda acc, row: acc + row, h)),
     "scan"),
    ("reshape_reverse_rows", lambda h: _sum_rows(tf.reshape(
        tf.reverse(tf.reshape(h, [2, -1, 4], name="split_rows"), [0]), [-1, 4])),
     "split_rows"),
    ("reshape_transpose_rows", lambda h: _sum_rows(tf.reshape(tf.transpose(
        tf.reshape(h, tf.stack([tf.shape(h)[0] // 2, 2, 4]), name="pairs"), [1, 0, 2]),
        tf.shape(h))),
     "pairs"),
]


@pytest.mark.parametrize("build,name", [c[1:] for c in LOST_CASES], ids=[c[0] for c in LOST_CASES])
def test_ops_that_move_examples_are_never_independent(features, build, name):
    graph, _, x, h, xs, _ = features
    with graph.as_default():
        ys = build(h)
        analysis = _analyze(ys, [x])
        assert analysis.verdict in ("unproven", "coupled")
        if analysis.verdict == "unproven":
            op, reason = analysis.lost_at
            assert name in op.name and reason, analysis.lost_at
        plan = _plan(ys, xs)
        assert plan.fallback == list(range(len(xs)))
        assert "could not be traced" in plan.reasons[0]


def test_a_mean_over_the_batch_size_is_independent_and_matches_the_definition(features):
    """cost / B with B = tf.shape(x)[0]: the rules give the gradient of row i as computed
    on the whole batch (the towers must feed the Cast the whole batch's size)."""
    graph, sess, x, h, xs, feed = features
    with graph.as_default():
        cost = _sum_rows(tf.tanh(h) ** 2)                                   # [B]
        size = tf.cast(tf.shape(x)[0], tf.float32, name="batch_size_float")
        ys = cost / size                                                    # [B]
        analysis = _analyze(ys, [x])
        assert analysis.verdict == "independent", analysis.lost_at
        assert size.op in [op for op, _ in analysis.size_data_edges]
        assert (size.op, 0) in analysis.size_data_edges
        assert analysis.rows(ys) == _batch_axis.Rows(0, 1, 1)
        assert _plan(ys, xs).fallback == []
        got = pertower.per_example_gradients(ys, xs, method="rules")
        total = tf.gradients(tf.reduce_sum(ys), xs)
        want = common.loop_rows_of_batch(sess, ys, xs, feed)
    got, total = sess.run([got, total], feed)
    common.assert_all_close(got, want, kind="tight", what="rows of the batch")
    common.assert_all_close([g.sum(axis=0) for g in got], total, kind="tight", what="sum")


def test_a_size_only_shape_argument_is_no_data_edge(features):
    graph, _, x, h, _, _ = features
    with graph.as_default():
        ys = _sum_rows(tf.reshape(h, tf.stack([tf.shape(x)[0], 2, 2])))
        analysis = _analyze(ys, [x])
    assert analysis.verdict == "independent" and analysis.size_data_edges == []


def test_a_batch_maximum_that_only_bounds_a_loop_or_a_range_is_no_coupling():
    """max(lengths) over the batch feeding only a While bound or tf.range (as
    tf.compat.v1.nn.dynamic_rnn's reduce_max(sequence_length))."""
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        lengths = tf.compat.v1.placeholder(tf.int32, [None], name="lengths")
        n = tf.reduce_max(lengths, name="max_length")
        _, acc = tf.while_loop(lambda i, acc: i < n, lambda i, acc: (i + 1, acc + tf.tanh(x)),
                               [tf.constant(0), tf.zeros_like(x)])
        ys = _sum_rows(acc)
        loop = _analyze(ys, [x, lengths])
        steps = tf.range(n)
        ys_range = _sum_rows(tf.transpose(tf.tile(x[None], tf.stack([tf.size(steps), 1, 1])),
                                          [1, 0, 2]))
        ranged = _analyze(ys_range, [x, lengths])
        data = _analyze(ys * tf.cast(n, tf.float32), [x, lengths])
        seq_x = tf.compat.v1.placeholder(tf.float32, [None, 5, 3], name="seq_x")
        cell = tf.compat.v1.nn.rnn_cell.BasicRNNCell(2)
        _, state = tf.compat.v1.nn.dynamic_rnn(cell, seq_x, sequence_length=lengths,
                                               dtype=tf.float32)
        rnn = _analyze(_sum_rows(state ** 2), [seq_x, lengths])
    assert rnn.verdict == "independent", (rnn.couplings, rnn.lost_at)
    for analysis in (loop, ranged):
        assert analysis.couplings == [] and analysis.verdict != "coupled", analysis.couplings
    assert [c.op.name for c in data.couplings] == ["max_length"]
    assert "reduces (Max) over axis 0" in data.couplings[0].reason


def test_find_couplings_keeps_its_words(features):
    graph, _, x, h, _, _ = features
    with graph.as_default():
        ys = h - tf.reduce_mean(h, axis=0, name="batch_mean")
        ops = graph_walk.downstream_ops([x], graph_walk.upstream_ops([ys]))
        found = _batch_axis.find_couplings(ops, [x])
        assert [c.op.name for c in found] == ["batch_mean"]
        assert _analyze(ys, [x]).verdict == "coupled"
        # errors name the public function the call came through
        with pytest.raises(ValueError, match=r"pertower.f: the op 'batch_mean' \(Mean\).*"
                                             r"reduces \(Mean\) over axis 0, the batch axis"):
            with _context.public_call("f"):
                raise ValueError(found[0].message())


def test_an_op_the_analysis_does_not_know_leaves_the_request_unproven(features):
    graph, _, x, h, _, _ = features
    with graph.as_default():
        ys = _sum_rows(tf.math.segment_sum(h, tf.zeros_like(x[:, 0], tf.int32),
                                           name="segments"))
        analysis = _analyze(ys, [x])
    assert analysis.verdict == "unproven" and analysis.couplings == []
    op, reason = analysis.lost_at
    assert op.name == "segments" and "does not know this op type" in reason

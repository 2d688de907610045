"""Batch-size values used as shapes, indices, ranges, segment ids or partitions in the
towers (issue 17 items 3, 5, 6), built here for both shape modes.

`build(kind)` makes one small graph in which n = tf.shape(x)[0] (or tf.size) is used
one way; tests/test_tower_sizes.py runs every kind in the test process (TensorFlow 2
shapes) and tests/legacy/test_tower_sizes.py runs `CHECKS` under
tf.compat.v1.disable_v2_behavior() (shapes of `Dimension`s, reference variables),
each against the one-example loop (`pertower.oracle`), or, for `loss / n`, against the
rows of the whole batch (`common.loop_rows_of_batch`: n means the whole batch's B).

Notation: B examples, D features, C classes, n the batch size as a tensor.
"""

import dataclasses

import numpy as np
import tensorflow as tf

__all__ = ["B", "KINDS", "CALL_KINDS", "REFUSED_KINDS", "SizeCase", "build", "check_kind", "CHECKS",
           "HEAVY"]

B, D, C, VOCAB = 4, 3, 5, 10
# Graphs whose per-example gradients the towers and the rules must give: each uses the
# batch size as something else than data (except "mean" and "scaled_labels", where it is data).
KINDS = ("gather_nd_stack", "gather_nd_concat", "gather_nd_size", "segment_sum",
         "unsorted_segment_sum", "segment_mean_repeat", "range_as_shape", "partitioned_lookup",
         "partitioned_lookup_div", "mean", "scaled_labels")
# Graphs that call a tf.function (analyzed only: TensorFlow's own gradient of a call op
# built in a v1 graph fails on the loop too, "Connecting to invalid output 1").
CALL_KINDS = ("function_gather_nd", "function_mean")
# Graphs that mix the rows of the batch by index: refused with pertower's message.
REFUSED_KINDS = ("permutation", "fixed_rows")


@dataclasses.dataclass
class SizeCase:
    """One graph and what the loop and pertower need to run it."""

    graph: tf.Graph
    sess: object
    ys: tf.Tensor      # [B]
    xs: list
    feed: dict
    whole_batch_size: bool   # ys reads n as data: compare with the rows of the batch


def build(kind, seed=0):
    """The graph of `kind` (one of KINDS or REFUSED_KINDS), initialized, with a feed."""
    graph = tf.Graph()
    rng = np.random.RandomState(seed)
    with graph.as_default():
        tf.compat.v1.set_random_seed(seed)
        x = tf.compat.v1.placeholder(tf.float32, [None, D], name="x")
        labels = tf.compat.v1.placeholder(tf.int32, [None], name="labels")
        feed = {x: rng.randn(B, D).astype(np.float32), labels: rng.randint(0, C, B)}
        w = tf.compat.v1.get_variable("w", [D, C])
        xs = [w]
        logits = tf.tanh(tf.matmul(x, w))                                   # [B, C]
        n = tf.shape(x)[0]
        if kind == "gather_nd_stack":      # the TF1 idiom for each example's label logit
            ys = -tf.gather_nd(tf.nn.log_softmax(logits), tf.stack([tf.range(n), labels], 1))
        elif kind == "gather_nd_concat":   # [B, 1] ++ [B, 1] -> [B, 2]
            index = tf.concat([tf.expand_dims(tf.range(n), 1), tf.expand_dims(labels, 1)], 1)
            ys = tf.gather_nd(logits, index) ** 2
        elif kind == "gather_nd_size":     # n as tf.size of a [B] tensor, int64 range
            rows = tf.range(tf.cast(tf.size(labels), tf.int64))
            ys = tf.gather_nd(logits, tf.stack([rows, tf.cast(labels, tf.int64)], -1)) ** 2
        elif kind in ("segment_sum", "unsorted_segment_sum"):
            # [B, C] -> [B*C] entries; segment ids [B*C]: example i's C entries get id i
            ids = tf.reshape(tf.tile(tf.expand_dims(tf.range(n), 1), [1, C]), [-1])
            flat = tf.reshape(logits ** 2, [-1])
            ys = (tf.math.segment_sum(flat, ids) if kind == "segment_sum" else
                  tf.math.unsorted_segment_sum(flat, ids, n))                     # [B]
        elif kind == "segment_mean_repeat":   # ids by tf.repeat, [B*C] -> [B]
            ids = tf.repeat(tf.range(n), C)
            ys = tf.math.segment_mean(tf.reshape(logits ** 2, [-1]), ids)
        elif kind == "range_as_shape":     # [B, C] zeros shaped by tf.size(tf.range(n))
            zeros = tf.zeros(tf.stack([tf.size(tf.range(n)), C]))
            ys = tf.reduce_sum((logits + zeros + 1.0) ** 2, 1)
        elif kind.startswith("partitioned_lookup"):
            ids = tf.compat.v1.placeholder(tf.int32, [None, 2], name="ids")     # [B, 2]
            feed[ids] = rng.randint(0, VOCAB, [B, 2])
            with tf.compat.v1.variable_scope(
                    "embedding", partitioner=tf.compat.v1.fixed_size_partitioner(2)):
                table = tf.compat.v1.get_variable("table", [VOCAB, D])
            strategy = "div" if kind.endswith("div") else "mod"
            e = tf.compat.v1.nn.embedding_lookup(table, ids, partition_strategy=strategy)
            ys = tf.reduce_sum(tf.matmul(tf.reduce_sum(e, 1) * x, w) ** 2, 1)  # [B]
            xs = list(table) + [w]
        elif kind == "scaled_labels":      # n scales per-example integers: data
            ys = tf.reduce_sum(logits ** 2, 1) * tf.cast(labels * n + 1, tf.float32)
        elif kind == "function_gather_nd":   # the index built inside a called function
            ys = -_label_log_probability(logits, labels)
        elif kind == "mean":               # n as data: the whole batch's B
            ys = tf.reduce_sum(logits ** 2, 1) / tf.cast(n, tf.float32)
        elif kind == "function_mean":      # n as data inside a called function
            ys = _mean_of_squares(logits, n, tf.size(labels))
        elif kind == "permutation":        # rows mixed by a fed permutation
            perm = tf.compat.v1.placeholder(tf.int32, [None], name="perm")
            feed[perm] = np.array([1, 0, 3, 2], np.int32)
            ys = tf.reduce_sum(tf.gather_nd(logits, tf.expand_dims(perm, 1)) ** 2, 1)
        elif kind == "fixed_rows":         # rows picked at fixed positions
            picked = tf.gather_nd(logits, tf.constant([[1], [0], [3], [2]]))
            ys = tf.reduce_sum(picked ** 2, 1) + 0.0 * tf.reduce_sum(logits, 1)
        else:
            raise ValueError(f"`kind` must be one of {KINDS + CALL_KINDS + REFUSED_KINDS}, got {kind!r}")
        sess = tf.compat.v1.Session(graph=graph)
        sess.run(tf.compat.v1.global_variables_initializer())
    return SizeCase(graph, sess, ys, xs, feed, kind in ("mean", "scaled_labels", "function_mean"))


@tf.function
def _label_log_probability(logits, labels):
    """[B, C], [B] -> [B]: log p(label_i) of row i, by the row index tf.range(n)."""
    index = tf.stack([tf.range(tf.shape(logits)[0]), labels], 1)            # [B, 2]
    return tf.gather_nd(tf.nn.log_softmax(logits), index)


@tf.function
def _mean_of_squares(logits, n, m):
    """[B, C], B, B -> [B]: each row's sum of squares over the whole batch's B (n, data);
    m (the same B) only shapes a reshape."""
    rows = tf.reshape(logits, tf.stack([m, -1]))                            # [B, C]
    return tf.reduce_sum(rows ** 2, 1) / tf.cast(n, tf.float32)


def reference(case):
    """What pertower must give: the one-example loop, or the rows of the whole batch
    when ys reads the batch size as data."""
    from pertower import oracle
    from tests import common
    with case.graph.as_default():
        if case.whole_batch_size:
            return common.loop_rows_of_batch(case.sess, case.ys, case.xs, case.feed)
        return oracle.loop_per_example_gradients(case.sess, case.ys, case.xs, case.feed)


def check_kind(kind, method, what="gradients"):
    """Runs pertower on `kind` with `method` and compares with `reference`; with
    what="norms", the per-example norms."""
    import pertower
    from tests import common
    case = build(kind)
    with case.graph.as_default():
        if what == "norms":
            got = [case.sess.run(pertower.per_example_norms(
                case.ys, case.xs, batch_size=B, method=method), case.feed)]
            want = [np.sqrt(sum(np.sum(g.reshape(B, -1) ** 2, 1) for g in reference(case)))]
        else:
            sparse = what == "sparse"
            got = pertower.per_example_gradients(case.ys, case.xs, batch_size=B,
                                                 method=method, sparse=sparse)
            if sparse:
                got = [g.to_dense() if hasattr(g, "to_dense") else g for g in got]
            got = case.sess.run(got, case.feed)
            want = reference(case)
    common.assert_all_close(got, want, what=f"{kind} ({method}, {what})", kind="tight")


def _legacy_check(kind, method, what):
    def check():
        check_kind(kind, method, what)
    check.__name__ = f"check_{kind}_{method}_{what}"
    return check


def _legacy_refusal(kind):
    def check():
        import pertower
        case = build(kind)
        with case.graph.as_default():
            try:
                pertower.per_example_gradients(case.ys, case.xs, batch_size=B, method="towers")
            except ValueError as error:
                if "couples the examples" in str(error) and "GatherNd" in str(error):
                    return ""
                raise
        raise AssertionError(f"{kind}: no refusal")
    check.__name__ = f"check_{kind}_is_refused"
    return check


CHECKS = ([_legacy_check(kind, method, "gradients") for kind in KINDS
           for method in ("towers", "auto")]
          + [_legacy_check("partitioned_lookup", "towers", what) for what in ("sparse", "norms")]
          + [_legacy_refusal(kind) for kind in REFUSED_KINDS])
# The checks of the heavy run: under disable_v2_behavior()
# the default run replays every kind in the towers (where the sizes are `Dimension`s)
# and checks the refusals; method "auto", sparse rows and norms of every kind are
# checked in graph mode in the default run (tests/test_tower_sizes.py).
HEAVY = frozenset(check.__name__ for check in CHECKS
                  if check.__name__.endswith(("_auto_gradients", "_sparse", "_norms")))

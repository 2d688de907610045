"""Legacy TF1 idioms (placeholders with a None batch, tf.compat.v1.get_variable,
tf.compat.v1.layers, tf.compat.v1.losses, sampled losses) against the one-example loop:
sampled losses sharing the batch's draw, partitioned embedding lookups
(DynamicPartition/DynamicStitch) and sparse lookups of ids made sparse in the graph on
the rules, dynamic_rnn with sequence_length after a training op was built, and the
matrix of tests/legacy_idiom_cases.py (heavy).

Each `check_*` function builds its own graph and compares `pertower` with the loop (or
checks a refusal's words). The tests here run them in this process (graph mode, TF2
behaviour); tests/legacy/test_legacy_idioms.py runs them under
`tf.compat.v1.disable_v2_behavior()` (reference variables, `Dimension` shapes).

Sampled losses (`tf.nn.sampled_softmax_loss`, `tf.nn.nce_loss`) draw one set of S classes
per run for the whole batch. Example i's per-example gradient is that of its loss given
the batch's draw (the B gradients sum to the batch gradient of the same run): the
towers read the batch's draw (`pertower._towers.slicing`), and the loop is fed the
same draw (the sampler's outputs, with example i's row of the true classes' expected
counts) so that it computes the same losses one example at a time.
"""

import numpy as np
import pytest
import tensorflow as tf

import pertower
from pertower import _op_types as op_types
from pertower import oracle
from tests import common
from tests import legacy_idiom_cases

v1 = tf.compat.v1
B = 3          # examples per batch
CLASSES = 10   # classes of the sampled losses
SAMPLED = 4    # classes drawn per run
DIM = 4        # input features


def _samplers(graph):
    return [op for op in graph.get_operations()
            if op.type in op_types.FIXED_CANDIDATE_SAMPLER_OP_TYPES]


def _draw_feeds(draws, i):
    """The feeds that give the loop's run on example i the batch's draw: each sampler's
    sampled classes and their expected counts [S], and row i of the true classes'
    expected counts [B, num_true]."""
    feeds = {}
    for op, (sampled, true_expected, sampled_expected) in draws:
        feeds[op.outputs[0]] = sampled
        feeds[op.outputs[1]] = true_expected[i:i + 1]
        feeds[op.outputs[2]] = sampled_expected
    return feeds


def _sampled_loss_graph(nce=True):
    """A hidden layer, then a sampled softmax loss (remove_accidental_hits=True, its
    default) plus, with `nce`, an NCE loss (a second sampler) as the per-example loss [B]."""
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(1)
        x = v1.placeholder(tf.float32, [None, DIM], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        hidden = tf.tanh(v1.nn.xw_plus_b(x, v1.get_variable("W0", [DIM, DIM]),
                                         v1.get_variable("b0", [DIM])))
        labels = tf.reshape(y, [-1, 1])
        ys = v1.nn.sampled_softmax_loss(
            v1.get_variable("softmax_w", [CLASSES, DIM]), v1.get_variable("softmax_b", [CLASSES]),
            labels, hidden, num_sampled=SAMPLED, num_classes=CLASSES)
        if nce:
            ys += v1.nn.nce_loss(
                v1.get_variable("nce_w", [CLASSES, DIM]), v1.get_variable("nce_b", [CLASSES]),
                labels, hidden, num_sampled=SAMPLED, num_classes=CLASSES)
        xs = v1.trainable_variables()
    rng = np.random.RandomState(0)
    feed = {x: rng.randn(B, DIM).astype(np.float32), y: rng.randint(0, CLASSES, B)}
    return graph, ys, xs, feed


def _loop_with_draws(sess, ys, xs, feed, draws):
    """[B, *x.shape] per x: tf.gradients of example i's loss, fed the batch's draw."""
    batch_keys = [key for key, value in feed.items() if np.ndim(value) >= 1]
    with sess.graph.as_default():
        gradients = oracle.SliceLoop(ys, xs).gradients   # dense, [*x.shape] each
    n = len(feed[batch_keys[0]])
    rows = []
    for i in range(n):
        feeds = {key: (value[i:i + 1] if key in batch_keys else value)
                 for key, value in feed.items()}
        feeds.update(_draw_feeds(draws, i))
        rows.append(sess.run(gradients, feeds))
    return [np.stack([row[k] for row in rows]) for k in range(len(xs))]


def check_sampled_losses_share_the_batch_draw(full=True):
    """Per-example gradients, norms and a DPOptimizer step (towers, batch_size=B) of a
    sampled softmax + NCE loss against the loop fed the same draw; without batch_size
    the refusal names `batch_size` and the sampler. Without `full`: the sampled softmax
    loss alone, no norms (the default run's cost)."""
    graph, ys, xs, feed = _sampled_loss_graph(nce=full)
    with graph.as_default():
        with pytest.raises(ValueError, match=r"(?s)no `batch_size` was given.*CandidateSampler"):
            pertower.per_example_gradients(ys, xs)
        samplers = _samplers(graph)
        assert len(samplers) == (2 if full else 1), [op.name for op in samplers]
        draw_tensors = [list(op.outputs) for op in samplers]
        grads = pertower.per_example_gradients(ys, xs, batch_size=B)
        norms = (pertower.per_example_norms(ys, xs, batch_size=B) if full
                 else tf.zeros([B]))
        clip = 0.5
        dp = pertower.DPOptimizer(v1.train.GradientDescentOptimizer(1.0), l2_norm_clip=clip,
                                  noise_multiplier=0.0)
        step = dp.minimize(ys, var_list=xs, batch_size=B)
        sess = v1.Session(graph=graph)
        sess.run(v1.global_variables_initializer())
    tolerance = common.tolerance(np.float32, "deep")
    # the pertower results and the draw of the same run
    got, got_norms, drawn = sess.run([grads, norms, draw_tensors], feed)
    draws = list(zip(samplers, drawn))
    want = _loop_with_draws(sess, ys, xs, feed, draws)
    common.assert_all_close(got, want, what="sampled losses: per-example gradients",
                            **tolerance)
    if full:
        want_norms = np.sqrt(sum(np.sum(g.reshape(B, -1) ** 2, axis=1) for g in want))
        common.assert_all_close([got_norms], [want_norms], what="sampled losses: norms",
                                **tolerance)
    # the DP step: -(1/B) sum_i min(1, C/||g_i||) g_i, with g_i of the step's own draw
    before = sess.run(xs)
    _, drawn = sess.run([step, draw_tensors], feed)
    after = sess.run(xs)
    sess.run([v1.assign(x, value) for x, value in zip(xs, before)])
    want = _loop_with_draws(sess, ys, xs, feed, list(zip(samplers, drawn)))
    norms_i = np.sqrt(sum(np.sum(g.reshape(B, -1) ** 2, axis=1) for g in want))
    factors = np.minimum(1.0, clip / norms_i)
    common.assert_all_close([a - b for a, b in zip(after, before)],
                            [-np.tensordot(factors, g, 1) / B for g in want],
                            what="sampled losses: DP step", **tolerance)
    # not a vacuous comparison: another draw gives other per-example gradients
    other = sess.run(grads, feed)
    assert any(not np.allclose(a, b) for a, b in zip(other, got)), "the draws did not change"


def check_sampled_loss_microbatches_and_capacity():
    """Microbatch gradients (B microbatches of one example) and a DPOptimizer with a
    batch capacity (max_batch_size=B, a batch of B-1 fed: the padded towers) share the
    draw too."""
    graph, ys, xs, feed = _sampled_loss_graph()
    with graph.as_default():
        samplers = _samplers(graph)
        draw_tensors = [list(op.outputs) for op in samplers]
        micro = pertower.microbatch_gradients(ys, xs, batch_size=B, num_microbatches=B)
        clip = 0.5
        dp = pertower.DPOptimizer(v1.train.GradientDescentOptimizer(1.0), l2_norm_clip=clip,
                                  noise_multiplier=0.0, expected_batch_size=B)
        step = dp.minimize(ys, var_list=xs, max_batch_size=B)
        sess = v1.Session(graph=graph)
        sess.run(v1.global_variables_initializer())
    tolerance = common.tolerance(np.float32, "deep")
    got, drawn = sess.run([micro, draw_tensors], feed)
    want = _loop_with_draws(sess, ys, xs, feed, list(zip(samplers, drawn)))
    common.assert_all_close(got, want, what="sampled losses: microbatches of one", **tolerance)
    fed = {key: value[:B - 1] for key, value in feed.items()}   # 2 of a capacity of 3
    before = sess.run(xs)
    _, drawn = sess.run([step, draw_tensors], fed)
    after = sess.run(xs)
    sess.run([v1.assign(x, value) for x, value in zip(xs, before)])
    want = _loop_with_draws(sess, ys, xs, fed, list(zip(samplers, drawn)))
    norms_i = np.sqrt(sum(np.sum(g.reshape(len(g), -1) ** 2, axis=1) for g in want))
    factors = np.minimum(1.0, clip / norms_i)
    common.assert_all_close([a - b for a, b in zip(after, before)],
                            [-np.tensordot(factors, g, 1) / B for g in want],
                            what="sampled losses: DP step with a batch capacity", **tolerance)


def _partitioned_lookup_graph(extra_use=None):
    """Two partitioned tables (tf.compat.v1.get_variable with fixed_size_partitioner):
    "div" over 3 parts and "mod" over 2, looked up by [B, 4] ids (repeated ids, parts
    an example never reads), then a dense head; `extra_use(graph)` may add to the loss."""
    graph = tf.Graph()
    with graph.as_default():
        ids = v1.placeholder(tf.int32, [None, 4], name="ids")
        y = v1.placeholder(tf.int32, [None], name="y")
        div = v1.get_variable("div_table", [CLASSES, DIM],
                              partitioner=v1.fixed_size_partitioner(3))
        with v1.variable_scope("scope", partitioner=v1.fixed_size_partitioner(2)):
            mod = v1.get_variable("mod_table", [CLASSES, DIM])
        looked_up = (v1.nn.embedding_lookup(div, ids, partition_strategy="div")
                     + v1.nn.embedding_lookup(list(mod), ids, partition_strategy="mod"))
        hidden = tf.reshape(tf.tanh(looked_up), [-1, 4 * DIM])
        logits = v1.layers.dense(hidden, 3)
        ys = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        if extra_use is not None:
            ys += extra_use(graph)
        xs = v1.trainable_variables()
    rng = np.random.RandomState(1)
    feed = {ids: np.array([[1, 1, 7, 2], [9, 9, 9, 9], [0, 5, 3, 4], [8, 6, 2, 2]])[:B],
            y: rng.randint(0, 3, B)}
    four = {ids: np.array([[1, 1, 7, 2], [9, 9, 9, 9], [0, 5, 3, 4], [8, 6, 2, 2]]),
            y: rng.randint(0, 3, 4)}
    return graph, ys, xs, feed, four


def check_partitioned_lookups_on_the_rules():
    """Partitioned embedding lookups ("div", "mod"; reference or resource parts): every
    part on the rules without batch_size (explain), per-example gradients, norms,
    2 microbatches of 2 and a DPOptimizer step against the loop."""
    graph, ys, xs, feed, four = _partitioned_lookup_graph()
    assert sum("part_" in x.name for x in xs) == 5, [x.name for x in xs]
    _check_rules_against_loop(graph, ys, xs, feed, four, "partitioned lookups")


def check_partitioned_lookup_with_another_use_is_not_proven():
    """A partition of the ids read outside the lookup (its sum added to the loss), or
    positions that are not range(n): the analysis loses the batch axis there, so the
    parts are not on the rules (towers, which need batch_size)."""
    def partition_sum(graph):
        split = [op for op in graph.get_operations() if op.type == "DynamicPartition"][0]
        return tf.cast(tf.reduce_sum(split.outputs[0]), tf.float32)

    graph, ys, xs, _, _ = _partitioned_lookup_graph(partition_sum)
    with graph.as_default():
        plan = pertower.explain(ys, xs)
        assert all(w.method != "rules" for w in plan.weights), str(plan)

    graph = tf.Graph()
    with graph.as_default():
        ids = v1.placeholder(tf.int32, [None], name="ids")
        parts = [v1.get_variable(f"part_{p}", [CLASSES, DIM]) for p in range(2)]
        which = ids % 2
        split = tf.dynamic_partition(ids // 2, which, 2)
        positions = tf.dynamic_partition(tf.reverse(tf.range(tf.size(ids)), [0]), which, 2)
        rows = tf.dynamic_stitch(positions, [tf.gather(parts[p], split[p]) for p in range(2)])
        ys = tf.reduce_sum(rows, 1)
        plan = pertower.explain(ys, parts)
        assert all(w.method != "rules" for w in plan.weights), str(plan)


@pytest.mark.heavy
def _sparse_lookup_graph(extra_use=None):
    """Ids fed dense [B, 5] (0 = no id), made a SparseTensor in the graph with
    tf.sparse.from_dense (as pertower's refusal of a sparse placeholder advises) and
    looked up in three tables with the "sum", "mean" and "sqrtn" combiners
    (tf.compat.v1.nn.embedding_lookup_sparse; the "mean" one a resource variable, also
    under disable_v2_behavior()), then a dense head; `extra_use(sp)` may add to the loss."""
    graph = tf.Graph()
    with graph.as_default():
        ids = v1.placeholder(tf.int64, [None, 5], name="ids")
        y = v1.placeholder(tf.int32, [None], name="y")
        sp = tf.sparse.from_dense(ids)
        # (a resource table: TensorFlow gathers its rows by the unique ids first)
        looked_up = [v1.nn.embedding_lookup_sparse(
            v1.get_variable(f"{c}_table", [CLASSES, DIM], use_resource=c == "mean"),
            sp, None, combiner=c) for c in ("sum", "mean", "sqrtn")]
        logits = v1.layers.dense(tf.tanh(tf.concat(looked_up, 1)), 3)
        ys = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        if extra_use is not None:
            ys += extra_use(sp)
        xs = v1.trainable_variables()
    rows = np.array([[1, 1, 7, 0, 2], [0, 9, 0, 0, 0], [3, 5, 3, 4, 3], [8, 0, 0, 6, 6]])
    rng = np.random.RandomState(2)
    feed = {ids: rows[:B], y: rng.randint(0, 3, B)}
    four = {ids: rows, y: rng.randint(0, 3, 4)}
    return graph, ys, xs, feed, four


def check_sparse_lookups_on_the_rules():
    """Sparse lookups of ids made sparse in the graph: every table on the rules without
    batch_size (explain), per-example gradients, norms, 2 microbatches of 2 and a
    DPOptimizer step against the loop."""
    graph, ys, xs, feed, four = _sparse_lookup_graph()
    _check_rules_against_loop(graph, ys, xs, feed, four, "sparse lookups")


def _check_rules_against_loop(graph, ys, xs, feed, four, what):
    with graph.as_default():
        ops = len(graph.get_operations())
        plan = pertower.explain(ys, xs)
        assert len(graph.get_operations()) == ops, "explain added ops to the graph"
        off = {w.name: w.reason for w in plan.weights if w.method != "rules"}
        assert not off and plan.request.batch_size is None, str(plan)
        grads = pertower.per_example_gradients(ys, xs)
        norms = pertower.per_example_norms(ys, xs)
        micro = pertower.microbatch_gradients(ys, xs, num_microbatches=2)
        clip = 0.5
        dp = pertower.DPOptimizer(v1.train.GradientDescentOptimizer(1.0), l2_norm_clip=clip,
                                  noise_multiplier=0.0)
        step = dp.minimize(ys, var_list=xs)
        loop = oracle.SliceLoop(ys, xs)
        sess = v1.Session(graph=graph)
        sess.run(v1.global_variables_initializer())
    want, want_norms = legacy_idiom_cases.assert_gradients_and_norms_match_loop(
        sess, grads, norms, loop, feed, what)
    tolerance = common.tolerance(np.float32, "deep")
    common.assert_all_close(sess.run(micro, four), loop.run(sess, four, 2),
                            what=f"{what}: microbatches", **tolerance)
    before = sess.run(xs)
    sess.run(step, feed)
    after = sess.run(xs)
    factors = np.minimum(1.0, clip / want_norms)
    common.assert_all_close([a - b for a, b in zip(after, before)],
                            [-np.tensordot(factors, g, 1) / B for g in want],
                            what=f"{what}: DP step", **tolerance)


def check_sparse_lookup_with_trailing_empty_examples():
    """Examples without an id after the last one with ids: the lookup has fewer rows
    than the batch (so does `ys`); per-example gradients keep the batch's B rows (zeros
    for those examples, as the loop gives) and microbatches of two group the examples
    of the batch, not of the lookup's rows."""
    graph = tf.Graph()
    with graph.as_default():
        ids = v1.placeholder(tf.int64, [None, 4], name="ids")
        table = v1.get_variable("table", [CLASSES, DIM])
        rows = v1.nn.embedding_lookup_sparse(table, tf.sparse.from_dense(ids), None,
                                             combiner="mean")
        ys = tf.reduce_sum(tf.tanh(rows), 1)
        grads = pertower.per_example_gradients(ys, [table])
        micro = pertower.microbatch_gradients(ys, [table], num_microbatches=2)
        loop = oracle.SliceLoop(ys, [table])
        sess = v1.Session(graph=graph)
        sess.run(v1.global_variables_initializer())
    feed = {ids: np.array([[1, 1, 0, 0], [0, 0, 0, 0], [4, 5, 6, 7], [0, 0, 0, 0]])}
    got, got_micro = sess.run([grads, micro], feed)
    tolerance = common.tolerance(np.float32, "deep")
    common.assert_all_close(got, loop.run(sess, feed, 4), what="trailing empty examples",
                            **tolerance)
    common.assert_all_close(got_micro, loop.run(sess, feed, 2),
                            what="trailing empty examples: microbatches", **tolerance)


def check_sparse_lookup_with_another_use_is_not_proven():
    """The SparseTensor's coordinates also read by another op (a sparse sum added to
    the loss): the analysis loses the batch axis at the Where, no table on the rules."""
    graph, ys, xs, _, _ = _sparse_lookup_graph(
        lambda sp: tf.cast(tf.sparse.reduce_sum(sp), tf.float32))
    with graph.as_default():
        plan = pertower.explain(ys, xs)
        assert all(w.method != "rules" for w in plan.weights), str(plan)


def check_training_op_built_first_keeps_the_loop_proof():
    """A training op built before pertower's call (tf.gradients adds accumulator outputs
    to a v2 While): dynamic_rnn with sequence_length stays proven (its loop bound is a
    max over the batch, its state kept past each example's end), no batch_size, against
    the loop."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 3, 2], name="x")
        y = v1.placeholder(tf.int32, [None], name="y")
        lengths = v1.placeholder(tf.int32, [None], name="lengths")
        _, state = v1.nn.dynamic_rnn(v1.nn.rnn_cell.BasicRNNCell(2), x,
                                     sequence_length=lengths, dtype=tf.float32)
        logits = tf.matmul(state, v1.get_variable("W", [2, 3]))
        ys = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        xs = v1.trainable_variables()
        train = v1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_mean(ys))
        plan = pertower.explain(ys, xs)
        assert all(w.method == "rules" for w in plan.weights), str(plan)
        grads = pertower.per_example_gradients(ys, xs)
        loop = oracle.SliceLoop(ys, xs)
        sess = v1.Session(graph=graph)
        sess.run(v1.global_variables_initializer())
    rng = np.random.RandomState(3)
    feed = {x: rng.randn(B, 3, 2).astype(np.float32), y: rng.randint(0, 3, B),
            lengths: np.array([1, 3, 2])[:B]}
    del train
    common.assert_all_close(sess.run(grads, feed), loop.run(sess, feed, B),
                            what="training op first: per-example gradients",
                            **common.tolerance(np.float32, "deep"))


def test_sampled_softmax_shares_the_batch_draw():
    """The sampled softmax alone (its legacy twin: check_sampled_softmax_shares_the_batch_draw
    of the default run); with NCE and the norms: the heavy test below, in both modes."""
    check_sampled_losses_share_the_batch_draw(full=False)


@pytest.mark.heavy
def test_sampled_losses_share_the_batch_draw():
    check_sampled_losses_share_the_batch_draw()


@pytest.mark.heavy
def test_partitioned_lookups_on_the_rules():
    """(The default run checks it under disable_v2_behavior().)"""
    check_partitioned_lookups_on_the_rules()


def test_partitioned_lookup_with_another_use_is_not_proven():
    check_partitioned_lookup_with_another_use_is_not_proven()


@pytest.mark.heavy
def test_sparse_lookups_on_the_rules():
    """(The default run checks it under disable_v2_behavior(), both table kinds.)"""
    check_sparse_lookups_on_the_rules()


@pytest.mark.heavy
def test_sparse_lookup_with_trailing_empty_examples():
    """(The default run checks it under disable_v2_behavior().)"""
    check_sparse_lookup_with_trailing_empty_examples()


def test_sparse_lookup_with_another_use_is_not_proven():
    check_sparse_lookup_with_another_use_is_not_proven()


def test_training_op_built_first_keeps_the_loop_proof():
    check_training_op_built_first_keeps_the_loop_proof()


@pytest.mark.heavy
@pytest.mark.parametrize("name", sorted(legacy_idiom_cases.CASES))
def test_legacy_idiom_matches_the_loop(name):
    """The matrix of tests/legacy_idiom_cases.py: TF1 idioms against the loop."""
    legacy_idiom_cases.check_case(name)


@pytest.mark.parametrize("name", sorted(legacy_idiom_cases.REFUSED))
def test_legacy_idiom_is_refused_with_its_reason(name):
    legacy_idiom_cases.check_refused(name)


@pytest.mark.heavy
def test_sampled_loss_microbatches_and_capacity():
    check_sampled_loss_microbatches_and_capacity()

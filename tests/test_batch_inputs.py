"""Batch tensors as they come: a batch on another axis than 0 (`batch_axis=`), and the
messages for batches pertower cannot follow. Every result is compared with the
one-example loop (`pertower.oracle`)."""

import re

import numpy as np
import pytest
import tensorflow as tf

import pertower
from pertower import oracle
from tests import common

T, D, H, B = 4, 3, 2, 5


@pytest.fixture(scope="module")
def time_major():
    """A static_rnn-style recurrence over a time-major x, [T, None, D]; ys [B]."""
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(7)
        x = tf.compat.v1.placeholder(tf.float32, [T, None, D], name="x")
        W = tf.Variable(np.random.RandomState(0).randn(D, H).astype("float32"), name="W")
        U = tf.Variable(np.random.RandomState(1).randn(H, H).astype("float32"), name="U")
        state = None
        for x_t in tf.unstack(x, axis=0):                      # T x [B, D]
            z = tf.matmul(x_t, W)                               # [B, H]
            state = tf.tanh(z if state is None else z + tf.matmul(state, U))
        ys = tf.reduce_sum(tf.square(state), axis=1)            # [B]
        sess = tf.compat.v1.Session(graph=graph)
        sess.run(tf.compat.v1.global_variables_initializer())
        X = np.random.RandomState(2).randn(T, B, D).astype("float32")
        want = common.run_oracle(oracle.loop_per_example_gradients, sess, ys, [W, U],
                                 {x: X}, batch=[x], batch_axis=1)
        yield dict(graph=graph, sess=sess, x=x, xs=[W, U], ys=ys, X=X, want=want)
        sess.close()


@pytest.mark.parametrize("method", ["auto", "rules", "towers"])
def test_time_major_batch_matches_the_loop(time_major, method):
    c = time_major
    with c["graph"].as_default():
        grads = pertower.per_example_gradients(c["ys"], c["xs"], batch_size=B,
                                               method=method, batch_axis=1)
        common.assert_all_close(c["sess"].run(grads, {c["x"]: c["X"]}), c["want"])


def test_time_major_rules_need_no_batch_size_and_norms_and_microbatches(time_major):
    c = time_major
    with c["graph"].as_default():
        plan = pertower.explain(c["ys"], c["xs"], batch_axis=1)
        assert "x:0 (batch axis 1)" in str(plan) and plan.verdict == "independent"
        grads = pertower.per_example_gradients(c["ys"], c["xs"], batch_axis=[1],
                                               method="rules")
        norms = pertower.per_example_norms(c["ys"], c["xs"], batch_axis=1)
        micro = pertower.microbatch_gradients(c["ys"], c["xs"], batch_size=B - 1,
                                              num_microbatches=2, batch_axis=1,
                                              method="towers")
        X4 = c["X"][:, :B - 1]
        got, got_norms = c["sess"].run([grads, norms], {c["x"]: c["X"]})
        got_micro = c["sess"].run(micro, {c["x"]: X4})
    common.assert_all_close(got, c["want"])
    want_norms = np.sqrt(sum(np.sum(np.reshape(w, [B, -1]) ** 2, axis=1) for w in c["want"]))
    common.assert_all_close([got_norms], [want_norms])
    want_micro = common.run_oracle(oracle.loop_microbatch_gradients, c["sess"], c["ys"],
                                   c["xs"], {c["x"]: X4}, 2, batch=[c["x"]], batch_axis=1)
    common.assert_all_close(got_micro, want_micro)


def test_time_major_towers_check_the_fed_batch_on_the_batch_axis(time_major):
    c = time_major
    with c["graph"].as_default():
        towers = pertower.build_towers(c["ys"], c["xs"], batch_size=B, batch_axis=1)
        check = pertower.check_independence(c["ys"], batch_size=B, batch_axis=1)
        assert c["sess"].run(check.independent, {c["x"]: c["X"]})
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match=r"built for a batch of 5 examples.*has 3 examples"):
            c["sess"].run(towers.stacked, {c["x"]: c["X"][:, :3]})


def test_time_major_without_batch_axis_says_to_pass_it(time_major):
    c = time_major
    with c["graph"].as_default():
        with pytest.raises(ValueError, match=r"`batch_size` is 5, but the batch tensor "
                           r"x:0 has a static batch size of 4 on axis 0\. If its batch is "
                           r"on another axis .* pass batch_axis=1"):
            pertower.per_example_gradients(c["ys"], c["xs"], batch_size=B)


@pytest.mark.parametrize("bad, error, words", [
    (3, ValueError, r"`batch_axis` is 3, out of range for the batch tensor x:0 of shape "
                    r"\(4, None, 3\) \(rank 3\)"),
    ("1", TypeError, r"`batch_axis` must be an int .* received '1'"),
    (True, TypeError, r"`batch_axis` must be an int"),
    ([1, 0], ValueError, r"`batch_axis` has 2 entries, but there are 1 batch tensors"),
])
def test_bad_batch_axis_is_refused(time_major, bad, error, words):
    c = time_major
    with c["graph"].as_default():
        with pytest.raises(error, match=r"^pertower\.per_example_gradients: " + words):
            pertower.per_example_gradients(c["ys"], c["xs"], batch_size=B, batch_axis=bad)


def test_negative_batch_axis_and_a_list_per_batch_tensor():
    """batch_axis=[-2, 0]: a time-major x and batch-major labels y."""
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(8)
        x = tf.compat.v1.placeholder(tf.float32, [T, None, D], name="x")
        y = tf.compat.v1.placeholder(tf.float32, [None, H], name="y")
        W = tf.Variable(np.random.RandomState(3).randn(D, H).astype("float32"), name="W")
        h = tf.einsum("tbd,dh->bh", tf.tanh(x), W)                 # [B, H]
        ys = tf.reduce_sum(tf.square(h - y), axis=1)               # [B]
        X = np.random.RandomState(4).randn(T, B, D).astype("float32")
        Y = np.random.RandomState(5).randn(B, H).astype("float32")
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            want = common.run_oracle(oracle.loop_per_example_gradients, sess, ys, [W],
                                     {x: X, y: Y}, batch=[x, y], batch_axis=[1, 0])
            for method in ("auto", "towers"):
                grads = pertower.per_example_gradients(ys, [W], batch=[x, y], batch_size=B,
                                                       method=method, batch_axis=[-2, 0])
                common.assert_all_close(sess.run(grads, {x: X, y: Y}), want)


@pytest.fixture(scope="module")
def side_inputs():
    """x [None, 3], labels [None], class weights [None] (a side input), shapeless u."""
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(9)
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        labels = tf.compat.v1.placeholder(tf.int32, [None], name="labels")
        class_weights = tf.compat.v1.placeholder(tf.float32, [None], name="class_weights")
        W = tf.Variable(np.random.RandomState(6).randn(3, 4).astype("float32"), name="W")
        logits = tf.matmul(x, W)                                           # [B, 4]
        loss = tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=labels, logits=logits) * tf.gather(class_weights, labels)  # [B]
        sess = tf.compat.v1.Session(graph=graph)
        sess.run(tf.compat.v1.global_variables_initializer())
        feed = {x: np.random.RandomState(7).randn(4, 3).astype("float32"),
                labels: np.array([0, 3, 1, 3], np.int32),
                class_weights: np.array([0.5, 2.0, 1.0, 3.0], np.float32)}
        yield dict(graph=graph, sess=sess, x=x, labels=labels, W=W, logits=logits,
                   loss=loss, feed=feed)
        sess.close()


def test_side_input_gathered_by_label_suggests_batch(side_inputs):
    c = side_inputs
    with c["graph"].as_default():
        with pytest.raises(ValueError, match=r"^pertower.per_example_gradients: `batch=` "
                           r"decides .* batch input \(x:0, labels:0, class_weights:0\)\. If "
                           r"class_weights:0 is not per-example data but a side input .* pass "
                           r"batch=\[x:0, labels:0\].* Otherwise, .*couples the examples"):
            pertower.per_example_gradients(c["loss"], [c["W"]], batch_size=4)
        grads = pertower.per_example_gradients(c["loss"], [c["W"]],
                                               batch=[c["x"], c["labels"]])
        got = c["sess"].run(grads, c["feed"])
    want = common.run_oracle(oracle.loop_per_example_gradients, c["sess"], c["loss"],
                             [c["W"]], c["feed"], batch=[c["x"], c["labels"]])
    common.assert_all_close(got, want)


def test_reshape_pairing_examples_is_not_blamed_on_a_baked_batch_size(side_inputs):
    c = side_inputs
    with c["graph"].as_default():
        paired = tf.reduce_sum(tf.reshape(c["logits"], [-1, 8]), axis=1)   # [B/2]
        with pytest.raises(ValueError) as raised:
            pertower.per_example_gradients(paired, [c["W"]], batch=c["x"], batch_size=4,
                                           validate=False)
    words = str(raised.value)
    assert "bakes its batch size" not in words
    assert re.search(r"The batch axis is None, so no batch size is baked in: an op "
                     r"between the batch and `ys` needs several examples together \(the "
                     r"analysis lost the examples' rows at 'Reshape'", words), words


@pytest.mark.parametrize("reduce, words", [
    (lambda t: tf.reduce_mean(t, axis=0, keepdims=True),
     r"has 1 row on axis 0, but the batch has 5 examples.*Was it reduced over the batch"),
    (lambda t: tf.transpose(t),
     r"has 4 rows on axis 0, but the batch has 5 examples.*Is it transposed"),
])
def test_ys_whose_axis_0_is_not_the_batch_gets_a_hint(reduce, words):
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [5, 3], name="x")
        W = tf.Variable(tf.ones([3, 4]), name="W")
        with pytest.raises(ValueError, match=r"^pertower\.per_example_gradients: `ys` .*"
                           + words):
            pertower.per_example_gradients(reduce(tf.matmul(x, W)), [W])


def test_shapeless_placeholder_alone_is_the_batch_and_beside_others_is_named():
    graph = tf.Graph()
    with graph.as_default():
        u = tf.compat.v1.placeholder(tf.float32, name="u")                 # unknown rank
        W = tf.Variable(np.random.RandomState(8).randn(3, 2).astype("float32"), name="W")
        ys = tf.reduce_sum(tf.tanh(tf.matmul(u, W)), axis=1)              # [B]
        U = np.random.RandomState(9).randn(3, 3).astype("float32")
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            grads = pertower.per_example_gradients(ys, [W], batch_size=3)
            got = sess.run(grads, {u: U})
            want = common.run_oracle(oracle.loop_per_example_gradients, sess, ys, [W],
                                     {u: U}, batch=[u])
        common.assert_all_close(got, want)
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        with pytest.raises(ValueError, match=r"depends on the placeholder\(s\) u:0 of "
                           r"unknown shape, besides the batch tensors \(x:0\).*Pass `batch=`"):
            pertower.per_example_gradients(ys + tf.reduce_sum(x, axis=1), [W], batch_size=3)


def test_sparse_placeholder_is_named_and_dense_ids_work():
    graph = tf.Graph()
    with graph.as_default():
        E = tf.Variable(np.random.RandomState(10).randn(10, 2).astype("float32"), name="E")
        sparse_ids = tf.compat.v1.sparse_placeholder(tf.int64, name="ids")
        ys = tf.reduce_sum(tf.nn.embedding_lookup_sparse(E, sparse_ids, None,
                                                         combiner="sum") ** 2, axis=1)
        with pytest.raises(ValueError, match=r"^pertower\.per_example_gradients: `ys` .* "
                           r"depends on the sparse placeholder 'ids' .* pass `batch=` that "
                           r"dense placeholder"):
            pertower.per_example_gradients(ys, [E], batch_size=3)
        # the advice: dense ids [B, n] padded with -1, the SparseTensor built in the graph
        dense_ids = tf.compat.v1.placeholder(tf.int64, [None, 3], name="dense_ids")
        built = tf.sparse.retain(tf.sparse.from_dense(dense_ids),
                                 tf.sparse.from_dense(dense_ids).values >= 0)
        ys = tf.reduce_sum(tf.nn.embedding_lookup_sparse(E, built, None,
                                                         combiner="sum") ** 2, axis=1)
        ids = np.array([[1, 4, -1], [2, -1, -1], [7, 7, 3]], np.int64)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            grads = pertower.per_example_gradients(ys, [E], batch=dense_ids, batch_size=3)
            got = sess.run(grads, {dense_ids: ids})
            want = common.run_oracle(oracle.loop_per_example_gradients, sess, ys, [E],
                                     {dense_ids: ids}, batch=[dense_ids])
        common.assert_all_close(got, want)

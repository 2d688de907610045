"""Sparse per-example gradients of embedding weights (sparse=True) against the oracle,
densified in NumPy; the dense default for the same weights."""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import pertower
from pertower import oracle
from tests import cases
from tests import common


def _densify(values, indices, example_ids, dense_shape):
    """NumPy: dense[example_ids[n], indices[n]] += values[n]."""
    dense = np.zeros(dense_shape, values.dtype)
    np.add.at(dense, (example_ids, indices), values)
    return dense


@pytest.fixture(scope="module")
def embedding():
    """tests.common's embedding model (ids [B, 4] with repeated ids) and pertower's
    tensors for it, built before the session runs."""
    case = cases.build_embedding()
    with case.graph.as_default():
        ids = case.batch[0]
        table = case.xs[0]                                  # the Embedding weight [20, 6]
        assert "embeddings" in table.name
        built = {
            f"sparse/{method}": pertower.per_example_gradients(
                case.ys, case.xs, batch_size=case.B, sparse=True, method=method)
            for method in ("towers", "auto")}
        built["dense"] = pertower.per_example_gradients(case.ys, case.xs, batch_size=case.B)
        built["micro"] = pertower.microbatch_gradients(case.ys, case.xs, num_microbatches=2,
                                                       batch_size=case.B, sparse=True)
        built["batch"] = tf.convert_to_tensor(tf.gradients(tf.reduce_sum(case.ys), table)[0])
        built["to_dense"] = built["sparse/towers"][0].to_dense()
        built["loop"] = oracle.SliceLoop(case.ys, case.xs)
    yield case, ids, built
    case.sess.close()


@pytest.mark.parametrize("method", ["towers", "auto"])
def test_sparse_embedding_gradients_match_oracle(embedding, method):
    case, ids, built = embedding
    sparse, *dense_rest = built[f"sparse/{method}"]
    assert isinstance(sparse, pertower.PerExampleIndexedSlices)
    assert all(isinstance(g, tf.Tensor) for g in dense_rest)  # the Dense layers stay dense
    got, rest = case.sess.run([sparse, dense_rest], case.feed)
    want = built["loop"].run(case.sess, case.feed, case.B)
    # one row per lookup: the fed ids in order, example by example (repeats kept)
    fed_ids = case.feed[ids]                                 # [B, 4]
    np.testing.assert_array_equal(got.indices, fed_ids.reshape(-1))
    np.testing.assert_array_equal(got.example_ids, np.repeat(np.arange(case.B), 4))
    np.testing.assert_array_equal(got.dense_shape, [case.B, 20, 6])
    assert got.values.shape == (case.B * 4, 6)
    common.assert_all_close([_densify(*got)] + list(rest), want, case.rtol, case.atol,
                            f"sparse embedding gradients ({method})")


def test_dense_default_and_to_dense_match_oracle(embedding):
    case, _, built = embedding
    dense, to_dense = case.sess.run([built["dense"], built["to_dense"]], case.feed)
    want = built["loop"].run(case.sess, case.feed, case.B)
    common.assert_all_close(dense, want, case.rtol, case.atol, "dense default")
    common.assert_all_close([to_dense], want[:1], case.rtol, case.atol, "to_dense()")


def test_sparse_microbatch_gradients_match_oracle(embedding):
    case, _, built = embedding
    sparse, *rest = built["micro"]
    got, rest = case.sess.run([sparse, rest], case.feed)
    np.testing.assert_array_equal(got.example_ids, np.repeat([0, 1], 8))
    want = built["loop"].run(case.sess, case.feed, 2)
    common.assert_all_close([_densify(*got)] + list(rest), want, case.rtol, case.atol,
                            "sparse microbatch gradients")


def test_sparse_rows_sum_to_the_batch_gradient(embedding):
    case, _, built = embedding
    got, batch = case.sess.run([built["sparse/towers"][0], built["batch"]], case.feed)
    common.assert_all_close([_densify(*got).sum(axis=0)], [batch], kind="tight",
                            what="sum over examples")


def test_a_weight_also_read_densely_stays_dense():
    """Tied embeddings: the table is gathered and multiplied, so its per-example
    gradient is not row-sparse and sparse=True returns the dense [B, *x.shape]."""
    with tf.Graph().as_default() as graph:
        common.seed_weights(21)
        ids = tf.compat.v1.placeholder(tf.int32, [None, 3], name="ids")
        embedding = keras.layers.Embedding(7, 4)
        h = tf.reduce_mean(embedding(ids), axis=1)                        # [B, 4]
        logits = tf.matmul(h, embedding.embeddings, transpose_b=True)    # [B, 7]
        ys = tf.reduce_logsumexp(logits, axis=1)                          # [B]
        xs = embedding.trainable_weights
        loop = oracle.SliceLoop(ys, xs)
        (got,) = pertower.per_example_gradients(ys, xs, batch_size=3, sparse=True)
        assert isinstance(got, tf.Tensor) and got.shape.as_list() == [3, 7, 4]
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            feed = {ids: np.array([[1, 1, 6], [0, 2, 3], [5, 5, 5]])}
            common.assert_all_close(sess.run([got], feed), loop.run(sess, feed, 3), kind="tight",
                                    what="tied embedding")

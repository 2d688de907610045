"""Bad input gets a clear error (type and words checked), never a wrong answer."""

import re

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import pertower
from pertower import oracle
from tests import common


def test_scalar_ys_is_refused(mlp):
    with mlp.graph.as_default():
        with pytest.raises(ValueError, match=r"`ys` .* is a scalar.*batch axis.*reduction=NONE"):
            pertower.per_example_gradients(tf.reduce_mean(mlp.ys), mlp.xs, batch_size=4)


def test_ys_that_does_not_depend_on_the_batch_is_refused(mlp):
    with mlp.graph.as_default():
        no_batch = tf.reshape(tf.reduce_sum(mlp.xs[0]), [1]) * tf.ones([4])
        with pytest.raises(ValueError, match=r"depends on no placeholder.*Pass `batch=`"):
            pertower.per_example_gradients(no_batch, mlp.xs, batch_size=4)
        with pytest.raises(ValueError, match=r"does not depend on the batch \(x:0\)"):
            pertower.per_example_gradients(no_batch, mlp.xs, batch=mlp.batch[0], batch_size=4)


@pytest.mark.parametrize("bad", ["a string", np.ones(3), 3.0])
def test_xs_entry_of_the_wrong_type_is_refused(mlp, bad):
    with mlp.graph.as_default():
        with pytest.raises(TypeError, match=r"`xs\[1\]` must be a tf.Variable or a tf.Tensor, "
                                            r"but received"):
            pertower.per_example_gradients(mlp.ys, [mlp.xs[0], bad], batch_size=4)


def test_activation_in_xs_is_refused(mlp):
    with mlp.graph.as_default():
        activation = mlp.outputs * 2.0
        with pytest.raises(ValueError, match=r"`xs\[0\]` .* depends on the batch.*activation"):
            pertower.per_example_gradients(mlp.ys, [activation], batch_size=4)


def test_missing_batch_size_for_a_none_batch_axis_is_refused_by_the_towers(mlp):
    """The towers are built for a fixed number of examples (the default method needs
    no batch_size when every weight has a rule: see test_dispatch.py)."""
    with mlp.graph.as_default():
        with pytest.raises(ValueError, match=r"batch axis is not static.*method='towers' "
                                             r"was asked for.*Pass batch_size=B"):
            pertower.per_example_gradients(mlp.ys, mlp.xs, method="towers")


@pytest.mark.parametrize("bad", [0, -3, 2.5, "4"])
def test_bad_batch_size_is_refused(mlp, bad):
    with mlp.graph.as_default():
        with pytest.raises(ValueError, match=r"`batch_size` must be a positive integer, but "
                                             r"received"):
            pertower.per_example_gradients(mlp.ys, mlp.xs, batch_size=bad)


def test_batch_tensors_with_different_static_sizes_are_refused():
    with tf.Graph().as_default():
        a = tf.compat.v1.placeholder(tf.float32, [4, 2], name="a")
        b = tf.compat.v1.placeholder(tf.float32, [3, 2], name="b")
        w = tf.compat.v1.get_variable("w", [2])
        ys = tf.reduce_sum(a * w, axis=1)
        pad = tf.reduce_sum(b * w)
        with pytest.raises(ValueError, match=r"different static batch sizes \(a:0 has 4, "
                                             r"b:0 has 3\)"):
            pertower.per_example_gradients(ys + pad, [w], batch=[a, b])
        with pytest.raises(ValueError, match=r"batch is ambiguous.*a:0.*b:0.*Pass `batch=`"):
            pertower.per_example_gradients(ys + pad, [w])


def test_batch_size_that_contradicts_the_static_batch_is_refused():
    with tf.Graph().as_default():
        a = tf.compat.v1.placeholder(tf.float32, [4, 2], name="a")
        w = tf.compat.v1.get_variable("w", [2])
        with pytest.raises(ValueError, match=r"`batch_size` is 5, but the batch tensor a:0 has "
                                             r"a static batch size of 4"):
            pertower.per_example_gradients(tf.reduce_sum(a * w, axis=1), [w], batch_size=5)


@pytest.mark.parametrize("bad", [3, 5])
def test_num_microbatches_that_does_not_divide_the_batch_is_refused(mlp, bad):
    with mlp.graph.as_default():
        with pytest.raises(ValueError, match=rf"`num_microbatches` \({bad}\) must divide the "
                                             r"batch size \(4\)"):
            pertower.microbatch_gradients(mlp.ys, mlp.xs, num_microbatches=bad, batch_size=4)


def test_unreached_weight_gives_zeros_or_none(mlp):
    with mlp.graph.as_default():
        unused = tf.compat.v1.get_variable("unused", [3, 2], dtype=tf.float32)
        mlp.sess.run(unused.initializer)
        with pytest.warns(UserWarning, match=r"does not depend on 1 of the 7 weights.*unused"):
            zeros = pertower.per_example_gradients(mlp.ys, mlp.xs + [unused], batch_size=4)
        nones = pertower.per_example_gradients(mlp.ys, mlp.xs + [unused], batch_size=4,
                                               unconnected_gradients="none")
        assert nones[-1] is None and all(g is not None for g in nones[:-1])
        want = oracle.loop_per_example_gradients(mlp.sess, mlp.ys, mlp.xs + [unused], mlp.feed)
        with pytest.raises(ValueError, match=r"`unconnected_gradients` must be 'zero' or 'none'"):
            pertower.per_example_gradients(mlp.ys, mlp.xs, batch_size=4,
                                           unconnected_gradients="zeros")
    got = mlp.sess.run(zeros, mlp.feed)
    assert got[-1].shape == (4, 3, 2) and not got[-1].any()
    common.assert_all_close(got, want, mlp.rtol, mlp.atol, "with an unreached weight")


@pytest.mark.parametrize("method,built", [("rules", "gradients"), ("towers", "towers")])
def test_feeding_another_batch_size_names_both_sizes(mlp, method, built):
    """The run-time check reads as one sentence (one string, not bracketed pieces)."""
    with mlp.graph.as_default():
        grads = pertower.per_example_gradients(mlp.ys, mlp.xs, batch_size=4, method=method)
    short = {k: v[:3] for k, v in mlp.feed.items()}
    with pytest.raises(tf.errors.InvalidArgumentError) as caught:
        mlp.sess.run(grads, short)
    message = str(caught.value)
    assert re.search(rf"pertower: the {built} were built for a batch of 4 examples "
                     r"\(batch_size=4\), but the batch fed to \S+ has 3 examples\. Feed "
                     r"batches of 4 examples", message), message
    assert "] [" not in message, message


def test_microbatches_that_do_not_divide_the_fed_batch_read_as_one_sentence(mlp):
    with mlp.graph.as_default():
        grads = pertower.microbatch_gradients(mlp.ys, mlp.xs, num_microbatches=2,
                                              method="rules")
    short = {k: v[:3] for k, v in mlp.feed.items()}
    with pytest.raises(tf.errors.InvalidArgumentError) as caught:
        mlp.sess.run(grads, short)
    message = str(caught.value)
    assert re.search(r"`num_microbatches` \(2\) must divide the batch size, but the batch "
                     r"fed to \S+ has 3 examples\. Feed a multiple of 2 examples\.",
                     message), message
    assert "] [" not in message, message


def test_non_static_jacobian_outputs_are_refused(mlp):
    with mlp.graph.as_default():
        ragged = tf.compat.v1.placeholder_with_default(mlp.outputs, [None, None])
        with pytest.raises(ValueError, match=r"output axes of `ys` .* must be static"):
            pertower.per_example_jacobians(ragged, mlp.xs, batch_size=4)


def test_non_tensor_ys_is_refused(mlp):
    with mlp.graph.as_default():
        with pytest.raises(TypeError, match=r"`ys` must be a tensor computed from the batch, "
                                            r"but received the variable"):
            pertower.per_example_gradients(mlp.xs[0], mlp.xs, batch_size=4)
        with pytest.raises(TypeError, match=r"`ys` must be a tf.Tensor, but received ndarray"):
            pertower.per_example_gradients(np.ones([4]), mlp.xs, batch_size=4)


def test_unrolled_lstm_matches_oracle():
    with tf.Graph().as_default() as graph:
        common.seed_weights(8)
        x = tf.compat.v1.placeholder(tf.float32, [None, 3, 2])              # T = 3 steps
        ys = keras.layers.Dense(1)(keras.layers.LSTM(3, unroll=True)(x))
        xs = tf.compat.v1.trainable_variables()
        grads = pertower.per_example_gradients(ys, xs, batch_size=3)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            feed = {x: np.random.RandomState(0).randn(3, 3, 2).astype(np.float32)}
            want = oracle.loop_per_example_gradients(sess, ys, xs, feed)
            common.assert_all_close(sess.run(grads, feed), want, kind="tight", what="unrolled LSTM")


def _joined_batches(shape):
    """f(concat([s1, s1 + s2])) with the batch left to be found: rows of s1, then rows
    that read s1 again, so axis 0 of ys is not the batch axis of either."""
    s1 = tf.compat.v1.placeholder(tf.float32, [None, 3], name="s1")
    s2 = tf.compat.v1.placeholder(tf.float32, [None, 3], name="s2")
    w = tf.compat.v1.get_variable("w", [3, 1])
    # s1's rows, then rows that read s1 again: not several batches joined (see
    # test_several_batches.py), so axis 0 of ys is not the batch
    ys = tf.matmul(tf.concat([s1, s1 + s2], axis=0), w)[:, 0]       # [2B]
    if shape == "static":
        return s1, s2, w, ys
    return s1, s2, w, tf.compat.v1.placeholder_with_default(ys, shape)  # rows unknown


def test_ys_whose_rows_do_not_follow_the_batch_is_refused():
    with tf.Graph().as_default():
        _, _, w, ys = _joined_batches("static")
        with pytest.raises(ValueError, match=r"axis 0 of `ys` .* does not follow the batch "
                                             r"\(s1:0, s2:0\): a tower given 1 example\(s\) "
                                             r"produced 2 row\(s\).*pass `batch=` the joined"):
            pertower.microbatch_gradients(ys, [w], num_microbatches=2, batch_size=2)


def test_ys_whose_rows_do_not_follow_the_batch_fails_at_run_time_when_not_static():
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        s1, s2, w, ys = _joined_batches([None])
        grads = pertower.microbatch_gradients(ys, [w], num_microbatches=2, batch_size=2)
        sess.run(w.initializer)
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match=r"does not follow the batch.*produced 2 row\(s\)\. "):
            sess.run(grads, {s1: np.ones([2, 3]), s2: np.ones([2, 3])})


def test_random_ops_in_the_replay_give_a_warning():
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 4])
        dense = keras.layers.Dense(3)
        ys = tf.reduce_sum(keras.layers.Dropout(0.5)(dense(x), training=True), axis=1)
        with pytest.warns(UserWarning, match=r"depends on the random op .*Each tower draws "
                                             r"its own random numbers"):
            pertower.per_example_gradients(ys, dense.trainable_weights, batch_size=2,
                                           method="towers")


def test_a_batch_size_baked_into_the_graph_is_explained():
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4, 3], name="x")
        w = tf.compat.v1.get_variable("w", [3, 1])
        ys = tf.reshape(tf.matmul(x, w), [4])                 # the 4 is a constant
        with pytest.raises(ValueError, match=r"replaying the graph from the batch to `ys` on "
                                             r"slices of 1 example\(s\) failed.*bakes its "
                                             r"batch size into constants"):
            pertower.per_example_gradients(ys, [w], method="towers")


def test_a_batch_size_baked_into_the_graph_is_no_problem_for_the_rules():
    """The rules never replay the graph on slices, so the baked 4 does not matter:
    d ys[i] / d w = x[i] (by hand)."""
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        x = tf.compat.v1.placeholder(tf.float32, [4, 3], name="x")
        w = tf.compat.v1.get_variable("w", [3, 1])
        ys = tf.reshape(tf.matmul(x, w), [4])                 # the 4 is a constant
        (g,) = pertower.per_example_gradients(ys, [w])        # method="auto"
        sess.run(w.initializer)
        values = np.arange(12, dtype=np.float32).reshape(4, 3)
        np.testing.assert_allclose(sess.run(g, {x: values}), values[:, :, None])

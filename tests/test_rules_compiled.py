"""XLA-compiled function calls (tf.function(jit_compile=True)) under the towers: a Keras
grouped convolution and a compiled function reading weights itself are replayed and
differentiated compiled, against the one-example oracle; a compiled function drawing
random numbers is refused, naming the call."""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import pertower
from pertower import oracle
from tests import common


def _compiled_calls(graph, scope):
    """The function-call ops under `scope` and whether each is XLA-compiled."""
    return [(op.type, op.get_attr("_XlaMustCompile") if "_XlaMustCompile" in op.node_def.attr
             else False)
            for op in graph.get_operations()
            if op.name.startswith(scope) and op.type in ("PartitionedCall",
                                                          "StatefulPartitionedCall")]


def test_keras_grouped_conv_under_the_towers_before_any_gradient():
    """Keras Conv2D(groups=2) when nothing differentiated its XLA-compiled call yet: the
    towers replay the call compiled (not as an If whose lowering would run the grouped
    convolution on CPU kernels, which have none without oneDNN) and differentiate it
    with a compiled call too; per-example gradients, norms and two microbatches match
    the loop, and the user's call op stays compiled."""
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(3)
        x = tf.compat.v1.placeholder(tf.float32, [None, 5, 4, 4])
        conv = keras.layers.Conv2D(6, (3, 2), groups=2, padding="same")
        ys = tf.reduce_sum(tf.sin(conv(x)), axis=[1, 2, 3])
        xs = conv.trainable_weights
        (call,) = [op for op in graph.get_operations() if op.type == "PartitionedCall"]
        outputs = len(call.outputs)
        grads = pertower.per_example_gradients(ys, xs, batch_size=3, method="towers")
        norms = pertower.per_example_norms(ys, xs, batch_size=3, method="towers")
        two = pertower.microbatch_gradients(ys, xs, num_microbatches=2, batch_size=4,
                                            method="towers")
        towers = _compiled_calls(graph, "per_example_gradients/")
        assert towers and all(compiled for _, compiled in towers), towers
        # the user's call keeps its output and its compilation; the towers may leave it
        # with the extra outputs a tf.gradients through it would add (so that a
        # gradient the user builds after the first run still works)
        assert len(call.outputs) >= outputs and call.get_attr("_XlaMustCompile"), call
        loop = oracle.SliceLoop(ys, xs)      # before the first run, see `cases.build_case`
        sess = tf.compat.v1.Session(graph=graph)
        sess.run(tf.compat.v1.global_variables_initializer())
    feed = {x: np.random.RandomState(3).randn(4, 5, 4, 4).astype(np.float32)}
    three = {x: feed[x][:3]}
    want = common.run_oracle(loop.run, sess, three, 3)
    want_two = common.run_oracle(loop.run, sess, feed, 2)
    got, got_norms = sess.run([grads, norms], three)
    got_two = sess.run(two, feed)
    common.assert_all_close(got, want, what="Keras grouped conv, towers")
    common.assert_all_close(
        [got_norms], [np.sqrt(sum(np.sum(w.reshape(3, -1) ** 2, axis=1) for w in want))],
        what="Keras grouped conv, norms")
    common.assert_all_close(got_two, want_two, atol=1e-5, what="two microbatches")
    sess.close()


def test_an_xla_compiled_function_reading_weights_is_replayed_compiled():
    """A tf.function(jit_compile=True) that reads variables itself (a grouped
    tf.nn.conv2d filter [3, 3, 4/2, 4] and a scale): the towers give the compiled call
    their copies as values (one copy of the function for all towers) and
    differentiate it compiled; the scale, read in the function but left out of `xs`,
    stays a variable. Against the loop; then a second derivative through the compiled
    gradient matches plain TensorFlow's."""
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(4)
        x = tf.compat.v1.placeholder(tf.float32, [None, 5, 5, 4])
        w = tf.compat.v1.get_variable("w_compiled", [3, 3, 2, 4])
        scale = tf.compat.v1.get_variable("scale_compiled", [],
                                          initializer=tf.compat.v1.constant_initializer(1.5))

        @tf.function(jit_compile=True)
        def grouped(images):
            return tf.nn.conv2d(images, w, 1, "VALID") * scale

        ys = tf.reduce_sum(tf.tanh(grouped(x)) ** 2, axis=[1, 2, 3])
        (both_w, both_scale) = pertower.per_example_gradients(ys, [w, scale], batch_size=2,
                                                              method="towers", validate=False)
        (only_w,) = pertower.per_example_gradients(ys, [w], batch_size=2, method="towers",
                                                   validate=False)
        # d/dx sum_i |g_i|^2 (a gradient penalty) through the compiled backward call
        penalty = tf.gradients(tf.reduce_sum(only_w ** 2), x)[0]
        loop = oracle.SliceLoop(ys, [w, scale])
        one = [tf.gradients(tf.reduce_sum(tf.tanh(tf.nn.conv2d(x[i:i + 1], w, 1, "VALID")
                                                      * scale) ** 2), w)[0]
               for i in range(2)]
        want_penalty = tf.gradients(sum(tf.reduce_sum(g ** 2) for g in one), x)[0]
        sess = tf.compat.v1.Session(graph=graph)
        sess.run(tf.compat.v1.global_variables_initializer())
    feed = {x: np.random.RandomState(4).randn(2, 5, 5, 4).astype(np.float32)}
    with sess:
        want = common.run_oracle(loop.run, sess, feed, 2)
        got = sess.run([both_w, both_scale, only_w, penalty], feed)
        common.assert_all_close(got[:3], want + want[:1], what="compiled function, towers")
        # plain TensorFlow's second derivative runs the grouped convolution uncompiled:
        # the plain CPU kernels (no oneDNN) have none, and run_oracle skips, saying so
        reference_penalty = common.run_oracle(sess.run, want_penalty, feed)
        common.assert_all_close([got[3]], [reference_penalty], rtol=1e-3, atol=1e-4,
                                what="second derivative")


def test_an_xla_compiled_function_that_draws_random_numbers_is_refused():
    """The compiled gradient runs the call again; random draws inside it would differ
    from the forward pass's, so the towers refuse at build time, naming the call."""
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 4])
        w = tf.compat.v1.get_variable("w_noisy", [4, 3])

        @tf.function(jit_compile=True)
        def noisy(rows, kernel):
            return tf.matmul(rows, kernel) * tf.random.uniform([3])

        ys = tf.reduce_sum(noisy(x, tf.convert_to_tensor(w)) ** 2, axis=1)
        with pytest.raises(NotImplementedError,
                           match=r"^pertower\.per_example_gradients: .*"
                                 r"cannot differentiate the XLA-compiled function call "
                                 r"'.*PartitionedCall'.*draws random numbers "
                                 r"\(RandomUniform\).*out of `xs`"):
            pertower.per_example_gradients(ys, [w], batch_size=2, method="towers")

"""Non-float variables in DPOptimizer's `var_list` (issue 17, item 8): an int64
`global_step` and a tf.string variable get no gradient (None), a warning names them,
and a training step runs; the float weight's DP gradient (noise off, no clipping)
matches the one-example loop.

A dtype mismatch at `sess.run` once aborted the whole process (exit 134); the tests run
here in graph mode and, under tf.compat.v1.disable_v2_behavior() (reference variables),
in tests/legacy/test_dp_non_float_variables.py.
"""

import warnings

import numpy as np
import tensorflow as tf

import pertower
from pertower import oracle
from tests import common

B = 4


def test_dp_optimizer_skips_int64_and_string_variables():
    with tf.Graph().as_default() as graph:
        common.seed_weights(51)
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        w = tf.compat.v1.get_variable("w", [3, 2])
        step = tf.compat.v1.train.get_or_create_global_step()                 # int64
        label = tf.compat.v1.get_variable("label", [], dtype=tf.string, trainable=False,
                                          initializer=tf.constant_initializer("a"))
        loss = tf.reduce_sum(tf.tanh(tf.matmul(x, w)) ** 2, axis=1)           # [B]
        dp = pertower.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                  l2_norm_clip=1e6, noise_multiplier=0.0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pairs = dp.compute_gradients(loss, var_list=[step, w, label], batch_size=B)
        texts = [str(c.message) for c in caught]
        named = [t for t in texts if "not floating-point" in t]
        assert len(named) == 1, texts
        assert named[0].startswith("pertower.DPOptimizer.compute_gradients: 2 of the "
                                   "variables in `var_list` are not floating-point"), named[0]
        assert "global_step:0 (int64)" in named[0] and "label:0 (string)" in named[0], named[0]
        assert [v for _, v in pairs] == [step, w, label]
        assert pairs[0][0] is None and pairs[2][0] is None, pairs
        train = dp.apply_gradients(pairs, global_step=step)
        feed = {x: np.random.RandomState(0).randn(B, 3).astype(np.float32)}
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            want = oracle.loop_per_example_gradients(sess, loss, [w], feed)[0].mean(axis=0)
            got = sess.run(pairs[1][0], feed)
            sess.run(train, feed)
            assert sess.run(step) == 1 and sess.run(label) == b"a"
    common.assert_all_close([got], [want], kind="tight", what="DP gradient of w")


def test_dp_optimizer_refuses_a_var_list_without_float_variables():
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        step = tf.compat.v1.train.get_or_create_global_step()
        loss = tf.reduce_sum(x ** 2, axis=1)
        dp = pertower.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                  l2_norm_clip=1.0, noise_multiplier=0.0)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dp.compute_gradients(loss, var_list=[step], batch_size=B)
        except ValueError as error:
            assert str(error).startswith("pertower.DPOptimizer.compute_gradients: `var_list` "
                                         "has no floating-point variable"), str(error)
        else:
            raise AssertionError("a var_list of one int64 variable was not refused")

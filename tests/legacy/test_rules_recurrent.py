"""The checks of tests/test_rules_recurrent.py (weights read
inside a while loop on the rules) under tf.compat.v1.disable_v2_behavior() (legacy shape
mode, reference variables) with control flow v2 (Keras then builds `While` loops), and a
TF1 (v1) loop (on the rules of pertower._loops.frames), against the one-example oracle.
"""

import numpy as np
import pytest
import tensorflow as tf

import pertower
from pertower import oracle
from tests import common
from tests import test_rules_recurrent as recurrent


def _with_control_flow_v2(check):
    tf.compat.v1.enable_control_flow_v2()
    try:
        return check()
    finally:
        tf.compat.v1.disable_control_flow_v2()


@pytest.mark.heavy
def test_lstm():
    print(_with_control_flow_v2(lambda: recurrent.check_language_model("LSTM")))


@pytest.mark.heavy
def test_gru():
    print(_with_control_flow_v2(lambda: recurrent.check_language_model("GRU")))


@pytest.mark.heavy
def test_simple_rnn():
    print(_with_control_flow_v2(lambda: recurrent.check_language_model("SimpleRNN")))


def test_while_loop_with_reference_variables_on_the_rules():
    """A tf.while_loop (control flow v2) over reference variables: the loop takes the
    weight's value as a loop input (not a resource handle) and its body reads it by a
    MatMul: on the rules, without batch_size, against the loop."""
    def check():
        with tf.Graph().as_default() as graph:
            common.seed_weights(2)
            x = tf.compat.v1.placeholder(tf.float32, [None, 3])
            w = tf.compat.v1.get_variable("w", [3, 3])
            h = tf.while_loop(lambda i, h: i < 2, lambda i, h: (i + 1, tf.tanh(h @ w)),
                              [0, x])[1]
            ys = tf.reduce_sum(tf.square(h - 0.3), axis=1)
            assert any(op.type in ("While", "StatelessWhile")
                       for op in graph.get_operations()), "no TF2 loop"
            plan = pertower.explain(ys, [w], batch=[x])
            assert plan.weights[0].method == "rules" and "per step" in plan.weights[0].ops[0], \
                str(plan)
            grads = pertower.per_example_gradients(ys, [w], batch=[x])
            loop = oracle.SliceLoop(ys, [w])
            with tf.compat.v1.Session(graph=graph) as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                for B in (3, 4):
                    feed = {x: np.random.RandomState(B).randn(B, 3).astype(np.float32)}
                    common.assert_all_close(sess.run(grads, feed),
                                            loop.run(sess, feed, B, batch=[x]),
                                            kind="deep", what=f"value loop input B={B}")
        return str(plan)
    print(_with_control_flow_v2(check))


def test_v1_loop_on_the_rules():
    """With control flow v1 the LSTM's loop is a TF1 frame: its weights are on the
    rules too (`pertower._loops.frames`), without batch_size, and match the loop."""
    graph, ys, batch = recurrent._language_model("LSTM")  # pylint: disable=protected-access
    with graph.as_default():
        assert any(op.type == "LoopCond" for op in graph.get_operations()), "no TF1 loop"
        xs = tf.compat.v1.trainable_variables()
        plan = pertower.explain(ys, xs, batch=batch)
        grads = pertower.per_example_gradients(ys, xs, batch=batch)
        loop = oracle.SliceLoop(ys, xs)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for B in recurrent.SIZES:
                feed = recurrent._feed(batch, B, B)  # pylint: disable=protected-access
                common.assert_all_close(sess.run(grads, feed),
                                        loop.run(sess, feed, B, batch=batch),
                                        kind="deep", what=f"v1 LSTM B={B}")
    for row in plan.weights:
        assert row.method == "rules", str(plan)
    assert sum("per step" in " ".join(row.ops) for row in plan.weights) == 3, str(plan)
    print(str(plan))


# the Keras LSTM and GRU language models under this mode, for the heavy run: the LSTM's
# and the GRU's rules are checked in graph mode in the default run (the LSTM language
# model of tests/test_rules_recurrent.py, the masked GRU of
# tests/test_rules_recurrent_v1.py); and the SimpleRNN (a Keras layer's TF2 loop over
# reference variables: in the default run, a tf.while_loop's over reference variables
# by test_while_loop_with_reference_variables_on_the_rules)

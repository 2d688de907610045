"""The checks of tests/test_batch_axis_sizes_in_bodies.py (sizes from `tf.shape` inside
loop bodies, conds and functions read as sizes; a real batch mean still refused) under
tf.compat.v1.disable_v2_behavior(), where Keras' RNN and `tf.while_loop` build TF1 frames,
against the one-example oracle. (A weight read inside a v1 `tf.cond` reaches a Switch,
which the towers cannot give a copy to: refused with a NotImplementedError naming it.)
"""

import numpy as np
import pytest
import tensorflow as tf

import pertower
from tests import test_batch_axis_sizes_in_bodies as sizes


def test_a_cell_with_layer_normalization():
    sizes.test_a_cell_with_layer_normalization_is_proven_and_its_dense_is_on_the_rules()


@pytest.mark.parametrize("batch_dim", [None, sizes.B])
def test_a_while_loop_body_that_reshapes_by_its_batch_size(batch_dim):
    sizes.test_a_while_loop_body_that_reshapes_by_its_batch_size(batch_dim)


def test_layer_normalization_in_a_function():
    sizes.test_layer_normalization_in_a_cond_or_a_function_is_proven("function")


def test_a_batch_mean_in_a_layer_normalized_cell_is_stopped_by_the_run_time_check():
    """In a TF1 frame the proof is lost at the cell's size arithmetic, so the row passes
    run with the run-time check, which stops the batch mean."""
    graph, x, ys = sizes._rnn_model(batch_mean=True)   # pylint: disable=protected-access
    with graph.as_default():
        xs = tf.compat.v1.trainable_variables()
        plan = pertower.explain(ys, xs, batch=[x], batch_size=sizes.B)
        assert plan.verdict == "unproven" and plan.validate, str(plan)
        grads = pertower.per_example_gradients(ys, xs, batch=[x], batch_size=sizes.B)
        feed = {x: np.random.RandomState(0).randn(sizes.B, sizes.T, sizes.D)}
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            with pytest.raises(tf.errors.InvalidArgumentError, match="recomputed one"):
                sess.run(grads, feed)


@pytest.mark.parametrize("layer,use", [("lstm", "reshape"), ("gru", "ones")])
def test_a_size_of_a_recurrent_layers_output_keeps_the_proof(layer, use):
    sizes.test_a_size_of_a_recurrent_layers_output_keeps_the_proof(layer, use, False)

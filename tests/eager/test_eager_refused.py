"""With eager execution on (TensorFlow 2's default), pertower refuses and says how to
switch to graph mode.
"""

import tensorflow as tf

import pertower


def _refusal(call):
    """The message of the RuntimeError that `call()` raises."""
    try:
        call()
    except RuntimeError as error:
        return str(error)
    raise AssertionError("no RuntimeError raised")


def _assert_names_the_switch(text):
    if not ("eager execution is on" in text and "disable_eager_execution()" in text):
        raise AssertionError(f"wrong message: {text}")


def test_eager_is_on():
    """The process really runs eagerly (nothing above switched it off)."""
    assert tf.executing_eagerly()


def test_per_example_gradients_refuses_eager():
    w = tf.Variable([1.0, 2.0])
    x = tf.constant([[1.0, 2.0], [3.0, 4.0]])
    _assert_names_the_switch(_refusal(
        lambda: pertower.per_example_gradients(tf.reduce_sum(x * w, axis=1), [w],
                                               batch_size=2)))


def test_microbatch_gradients_refuses_eager():
    w = tf.Variable([1.0, 2.0])
    x = tf.constant([[1.0, 2.0], [3.0, 4.0]])
    _assert_names_the_switch(_refusal(
        lambda: pertower.microbatch_gradients(x[:, 0], [w], num_microbatches=2)))


def test_dp_optimizer_refuses_eager():
    """DPOptimizer.compute_gradients needs graph mode and says so."""
    w = tf.Variable([1.0, 2.0])
    dp = pertower.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1), 1.0, 1.0)
    text = _refusal(lambda: dp.compute_gradients(tf.constant([1.0, 2.0]) * w, [w]))
    if "pertower.DPOptimizer.compute_gradients needs graph mode" not in text:
        raise AssertionError(f"wrong message: {text}")

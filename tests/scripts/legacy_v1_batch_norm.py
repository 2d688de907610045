"""Under disable_v2_behavior (v1 cond: Switch/Merge), a batch norm whose training mode
is a placeholder is refused, and the same layer in inference mode is accepted.

Run in a subprocess by tests/test_mixing.py (the switch is process-wide)."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import tensorflow as tf  # noqa: E402

tf.compat.v1.disable_v2_behavior()

import pertower  # noqa: E402

with tf.Graph().as_default():
    x = tf.compat.v1.placeholder(tf.float32, [None, 4, 4, 2], name="x")
    training = tf.compat.v1.placeholder(tf.bool, [], name="training")
    h = tf.compat.v1.layers.conv2d(x, 3, 3)
    normed = tf.compat.v1.layers.batch_normalization(h, training=training)
    ys = tf.reduce_sum(normed, axis=[1, 2, 3])
    assert any(op.type == "Switch" for op in tf.compat.v1.get_default_graph().get_operations())
    try:
        pertower.per_example_gradients(ys, tf.compat.v1.trainable_variables(), batch_size=3)
    except ValueError as error:
        assert "couples the examples of the batch" in str(error), error
        assert "is_training=True" in str(error) and "training=False" in str(error), error
    else:
        raise AssertionError("batch norm with a training placeholder was not refused")
    inference = tf.compat.v1.layers.batch_normalization(h, training=False, name="inference")
    grads = pertower.per_example_gradients(tf.reduce_sum(inference, axis=[1, 2, 3]),
                                           tf.compat.v1.trainable_variables(), batch_size=3)
    assert len(grads) == len(tf.compat.v1.trainable_variables())
print("ok")

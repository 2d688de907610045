"""Convolutions inside a loop body on the rules, per step (issue 32, item 2): tf_keras'
ConvLSTM2D and ConvLSTM1D (input and recurrent kernels split into gates, read by Conv2D)
and a raw tf.while_loop convolving its state (Conv2D, DepthwiseConv2dNative). Each read
is the convolution rule on the body op laid on every step's input at once
(`pertower._loops.step_rules.StepConvolution`): no towers, no batch_size. Per-example
gradients, norms and a noiseless DP step against the one-example loop at two fed batch
sizes (`test_rules_recurrent_weight_functions._check`).
"""

import pytest
import tensorflow as tf
import tf_keras as keras

from tests.test_rules_recurrent_weight_functions import _check

T, SIDE, CHANNELS = 3, 5, 2


def _conv_lstm(layer, spatial):
    """x [B, T, *spatial, CHANNELS] -> `layer()` (return_sequences) -> ys = sum of squares."""
    def build(batch_size):
        shape = [T] + spatial + [CHANNELS]
        x = tf.compat.v1.placeholder(tf.float32, [batch_size] + shape, name="x")
        h = layer()(x)                                                  # [B, T, *spatial', F]
        ys = tf.reduce_sum(h ** 2, axis=list(range(1, h.shape.rank)))  # [B]
        return ys, tf.compat.v1.trainable_variables(), [x], shape
    return build


def test_conv_lstm2d_kernels_and_bias_per_step():
    """ConvLSTM2D(3, 3x3, same): kernel [3, 3, 2, 12] and recurrent_kernel [3, 3, 3, 12]
    split into 4 gates, each read by a Conv2D per step."""
    _check(_conv_lstm(lambda: keras.layers.ConvLSTM2D(3, 3, padding="same",
                                                      return_sequences=True), [SIDE, SIDE]))


@pytest.mark.heavy
def test_conv_lstm2d_strided_valid():
    """ConvLSTM2D(2, 2x2, strides 2, valid) on 5x5 maps: strided input convolutions; a
    None and a static batch size."""
    _check(_conv_lstm(lambda: keras.layers.ConvLSTM2D(2, 2, strides=2, return_sequences=True),
                      [SIDE, SIDE]), static=True)


@pytest.mark.heavy
def test_conv_lstm1d():
    """ConvLSTM1D(4, 3, same): Conv1D's lowering (ExpandDims, Conv2D) in the body."""
    _check(_conv_lstm(lambda: keras.layers.ConvLSTM1D(4, 3, padding="same",
                                                      return_sequences=True), [SIDE]))


@pytest.mark.parametrize("conv", [
    lambda h, w: tf.nn.conv2d(h, w, 1, "SAME"),
    pytest.param(lambda h, w: tf.nn.depthwise_conv2d(h, w[:, :, :, :1], [1, 1, 1, 1], "SAME"),
                 marks=pytest.mark.heavy),
], ids=["conv2d", "depthwise"])
def test_a_state_convolved_in_a_raw_while_loop(conv):
    """tf.while_loop: h <- tanh(conv(h, w)) three times on h [B, 5, 5, 2], the filter
    read directly (Conv2D) or sliced (depthwise, w[..., :1])."""
    def build(batch_size):
        x = tf.compat.v1.placeholder(tf.float32, [batch_size, SIDE, SIDE, CHANNELS], name="x")
        w = tf.compat.v1.get_variable("w", [3, 3, CHANNELS, CHANNELS])

        def body(i, h):
            return i + 1, tf.tanh(conv(h, w))

        _, h = tf.while_loop(lambda i, h: i < T, body, [tf.constant(0), x])
        return tf.reduce_sum(h ** 2, axis=[1, 2, 3]), [w], [x], [SIDE, SIDE, CHANNELS]

    _check(build, tol=dict(rtol=1e-4, atol=1e-5), static=True)


@pytest.mark.heavy
def test_mixed_float16_conv_lstm2d():
    """Under mixed_float16 the body convolves in float16 with Casts of the kernels
    (weight-side functions before the split): still per step."""
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        build = _conv_lstm(lambda: keras.layers.ConvLSTM2D(3, 3, padding="same",
                                                           return_sequences=True), [SIDE, SIDE])

        def in_float32(batch_size):
            ys, xs, batch, shape = build(batch_size)
            return tf.cast(ys, tf.float32), xs, batch, shape

        _check(in_float32, tol=dict(rtol=1e-2, atol=1e-3))   # both sides compute in float16
    finally:
        keras.mixed_precision.set_global_policy(previous)

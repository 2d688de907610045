"""Rule for Conv2DBackpropInput: the transposed convolution (tf_keras Conv2DTranspose,
`tf.nn.conv2d_transpose`, Conv1DTranspose's lowering).

Identity. With W [kh, kw, Cf, Of] the filter of the convolution the op transposes, A
its data input [N, Ho, Wo, Of] and Z its output [N, H, W, Cf], the op applies to A the
adjoint of x -> conv(x, W), so grad_i(W) is the filter gradient of conv(., W) with dZ as
its input and A as its output gradient (TensorFlow's `_Conv2DBackpropInputGrad` for the
batch), kept per example by the ways of `conv2d` (`conv2d.TransposedRule`).

Covered: NHWC and NCHW, any strides, SAME/VALID/explicit padding, dilations; the filter
static; A's rows example-major.
"""

from pertower import _context
from pertower.rules import conv2d

__all__ = ["Conv2DTransposeRule", "register"]


class Conv2DTransposeRule(conv2d.TransposedRule):
    """Per-example filter gradients of Conv2DBackpropInput through the Conv2D of dZ
    (`options`: a `conv2d.ConvOptions` for the Conv2D ways)."""

    @_context.public("rules.conv2d_transpose.Conv2DTransposeRule")
    def __init__(self, options=None):
        super().__init__(options)


def register(registry, options=None):
    """Adds the Conv2DBackpropInput rule to `registry` (with `options`, a
    `conv2d.ConvOptions`)."""
    registry.register("Conv2DBackpropInput", Conv2DTransposeRule(options))

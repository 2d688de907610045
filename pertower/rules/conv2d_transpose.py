"""Rule for Conv2DBackpropInput: the transposed convolution (tf_keras Conv2DTranspose,
`tf.nn.conv2d_transpose`, Conv1DTranspose's lowering).

Notation (as in `conv2d`): W the filter [kh, kw, Cf, Of] of the convolution that the op
transposes (Cf its input channels, Of its output channels); A the op's data input
(out_backprop), [N, Ho, Wo, Of]; Z the op's output [N, H, W, Cf]; dZ the gradient at Z.

Identity. Conv2DBackpropInput computes the input gradient of the convolution
conv(x, W): [N, H, W, Cf] -> [N, Ho, Wo, Of] at the output gradient A, i.e. it applies
the adjoint (transpose) of the linear map x -> conv(x, W):
    Z[n, y, c] = sum_{p, u, v, o : y = p*s + (u, v)*d - pad} W[u, v, c, o] A[n, p, o].
Differentiating with respect to W,
    dL/dW[u, v, c, o] = sum_{n, p} dZ[n, p*s + (u, v)*d - pad, c] A[n, p, o],
which is the filter gradient of the convolution conv(., W) with dZ in the role of its
input and A in the role of its output gradient: Conv2DBackpropFilter(input=dZ,
out_backprop=A) (the roles swapped; TensorFlow's registered gradient of
Conv2DBackpropInput, `_Conv2DBackpropInputGrad` in nn_grad.py, computes exactly this).
Kept per example it is Rochette et al.'s identity (arXiv 1912.06015; see `conv2d`) for
that convolution:
    grad_i(W)[u, v, c, o] = sum_{p} dz_i(p*s + (u, v)*d - pad)[c] a_ip[o],
so the rule (`conv2d.TransposedRule`) builds (at gradient time, never run) the NHWC
Conv2D of dZ with W and the op's strides, padding and dilations, whose output has A's
shape, and hands dZ as its input and A as its output gradient to the Conv2D ways.

Covered: NHWC and NCHW (transposed to NHWC), any strides, SAME/VALID/explicit padding,
dilations; the filter static; A's rows example-major (k rows per example).
"""

from pertower import _context
from pertower.rules import conv2d

__all__ = ["Conv2DTransposeRule", "register"]


class Conv2DTransposeRule(conv2d.TransposedRule):
    """Per-example filter gradients of Conv2DBackpropInput through the Conv2D rule.

    Args:
      options: a `conv2d.ConvOptions` for the Conv2D ways (default: "auto").
    """

    @_context.public("rules.conv2d_transpose.Conv2DTransposeRule")
    def __init__(self, options=None):
        super().__init__(options)


def register(registry, options=None):
    """Adds the Conv2DBackpropInput rule to `registry` (with `options`, a
    `conv2d.ConvOptions`)."""
    registry.register("Conv2DBackpropInput", Conv2DTransposeRule(options))

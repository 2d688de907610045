"""Rules for DepthwiseConv2dNative (Keras DepthwiseConv2D, SeparableConv2D's depthwise
part) and DepthwiseConv2dNativeBackpropInput: the convolution rule of `conv2d` with the
depthwise ways (`_convolution.ways.depthwise_by_grouped`, `depthwise_by_patches`).

Identity (Rochette et al. 2019, arXiv 1912.06015; as for Conv2D, per channel): output
channel c*M + m at position p is sum_{u,v} x_p[u, v, c] W[u, v, c, m], so
    grad_i(W)[u, v, c, m] = sum_p x_ip[u, v, c] dz_ip[c*M + m],
computed one of two ways (each tested against the oracle):

    "grouped"    the batch folded into channels: x as [T, H, W, G*Cin] and dZ as
                 [T, Ho, Wo, G*Cin*M] are the input and output gradient of ONE depthwise
                 convolution with G*Cin channels, so DepthwiseConv2dNativeBackpropFilter
                 gives [kh, kw, G*Cin, M]. With oneDNN's kernels it is called on chunks of
                 the input channels, each call's filter gradient holding at most
                 CHUNK_FLOATS numbers (oneDNN's form slows down by an order of magnitude
                 beyond ~32k; Eigen's does not: docs/conv_ways.md);
    "patches"    the patches ordered (kh, kw, Cin) and one contraction per group.

"auto" takes "grouped" wherever it runs: float32, no dilation (TensorFlow's CPU kernel
refuses dilations and has no float64 form), equal row and column strides; it never writes
the kh*kw copies of the input that the patches hold. Elsewhere "patches". The strategy
values "depthwise" and "shifts" mean "grouped" and "patches" here.

DepthwiseConv2dNativeBackpropInput (weight W [kh, kw, C, M], data A [N, Ho, Wo, C*M],
output Z [N, H, W, C]) computes the input gradient of x -> dconv(x, W) at A, so
    grad_i(W)[u, v, c, m] = sum_p dz_i(p*s + (u, v)*d - pad)[c] a_ip[c*M + m],
the filter gradient of dconv(., W) with dZ as its input and A as its output gradient
(TensorFlow's `_DepthwiseConv2dNativeBackpropInputGrad`; as `conv2d_transpose`).

Covered: NHWC, any strides, SAME/VALID/explicit padding, dilations; the filter static.
NCHW and the blocks of a SpaceToBatchND through `_convolution.views`.
"""

from pertower import _context
from pertower._convolution import ways as _conv_ways
from pertower.rules import conv2d

__all__ = ["CHUNK_FLOATS", "GUESSED_G", "DepthwiseConv2DRule",
           "DepthwiseConv2DTransposeRule", "register"]

CHUNK_FLOATS = _conv_ways.CHUNK_FLOATS
GUESSED_G = _conv_ways.GUESSED_G


class DepthwiseConv2DRule(conv2d.ConvolutionRule):
    """Per-example depthwise filter gradients.

    Args:
      options: a `conv2d.ConvOptions` (default: strategy "auto").
    """

    @_context.public("rules.depthwise_conv2d.DepthwiseConv2DRule")
    def __init__(self, options=None):
        super().__init__(options)


class DepthwiseConv2DTransposeRule(conv2d.TransposedRule):
    """Per-example filter gradients of DepthwiseConv2dNativeBackpropInput through the
    depthwise rule on its forward convolution.

    Args:
      options: a `conv2d.ConvOptions` for the depthwise ways (default: "auto").
    """

    @_context.public("rules.depthwise_conv2d.DepthwiseConv2DTransposeRule")
    def __init__(self, options=None):
        super().__init__(options)


def register(registry, options=None):
    """Adds the DepthwiseConv2dNative and DepthwiseConv2dNativeBackpropInput rules to
    `registry` (with `options`, a `conv2d.ConvOptions`)."""
    registry.register("DepthwiseConv2dNative", DepthwiseConv2DRule(options))
    registry.register("DepthwiseConv2dNativeBackpropInput",
                      DepthwiseConv2DTransposeRule(options))

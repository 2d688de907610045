"""Rules for DepthwiseConv2dNative (Keras DepthwiseConv2D, SeparableConv2D's depthwise
part) and DepthwiseConv2dNativeBackpropInput: `conv2d`'s rules with the depthwise ways.

Identity (Rochette et al. 2019, arXiv 1912.06015, per channel): output channel c*M + m
is sum_{u,v} x_p[u, v, c] W[u, v, c, m], so grad_i(W)[u, v, c, m] = sum_p x_ip[u, v, c]
dz_ip[c*M + m], by (`_convolution.ways`):

    "grouped"  x as [T, H, W, G*Cin] and dZ as [T, Ho, Wo, G*Cin*M]: ONE depthwise
               backward-filter kernel, [kh, kw, G*Cin, M]; under oneDNN on chunks of at
               most CHUNK_FLOATS numbers (beyond ~32k it slows down tenfold);
    "patches"  the patches ordered (kh, kw, Cin) and one contraction per group.

"auto": "grouped" where it runs (float32, no dilation, equal strides), else "patches";
"examples" for filters of 25+ taps as `ways.per_example_calls_pay` says; "depthwise"
and "shifts" mean "grouped" and "patches". The transposed op as in `conv2d_transpose`.
Covered: NHWC, NCHW, SpaceToBatchND blocks, any strides and padding, dilations.
"""

from pertower import _context
from pertower._convolution import ways as _conv_ways
from pertower.rules import conv2d

__all__ = ["CHUNK_FLOATS", "GUESSED_G", "DepthwiseConv2DRule",
           "DepthwiseConv2DTransposeRule", "register"]

CHUNK_FLOATS = _conv_ways.CHUNK_FLOATS
GUESSED_G = _conv_ways.GUESSED_G


class DepthwiseConv2DRule(conv2d.ConvolutionRule):
    """Per-example depthwise filter gradients (`options`: a `conv2d.ConvOptions`)."""

    @_context.public("rules.depthwise_conv2d.DepthwiseConv2DRule")
    def __init__(self, options=None):
        super().__init__(options)


class DepthwiseConv2DTransposeRule(conv2d.TransposedRule):
    """Per-example filter gradients of DepthwiseConv2dNativeBackpropInput through its
    forward depthwise convolution (`options`: a `conv2d.ConvOptions`)."""

    @_context.public("rules.depthwise_conv2d.DepthwiseConv2DTransposeRule")
    def __init__(self, options=None):
        super().__init__(options)


def register(registry, options=None):
    """Adds the DepthwiseConv2dNative and DepthwiseConv2dNativeBackpropInput rules to
    `registry` (with `options`, a `conv2d.ConvOptions`)."""
    registry.register("DepthwiseConv2dNative", DepthwiseConv2DRule(options))
    registry.register("DepthwiseConv2dNativeBackpropInput",
                      DepthwiseConv2DTransposeRule(options))

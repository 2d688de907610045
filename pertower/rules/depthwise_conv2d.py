"""Rule for DepthwiseConv2dNative (Keras DepthwiseConv2D / SeparableConv2D's depthwise part).

Identity (Rochette et al. 2019, arXiv 1912.06015; as for Conv2D, per channel): output
channel c*M + m at position p is sum_{u,v} x_p[u, v, c] W[u, v, c, m], so
    grad_i(W)[u, v, c, m] = sum_p x_ip[u, v, c] dz_ip[c, m],
computed one of two ways (each tested against the oracle):

    "grouped"    the batch folded into channels: x as [T, H, W, G*Cin] and dZ as
                 [T, Ho, Wo, G*Cin*M] are the input and output gradient of ONE depthwise
                 convolution with G*Cin channels (channel g*Cin + c of the folded dZ
                 block is dZ's channel c*M + m of group g, in the same order), so
                 `DepthwiseConv2dNativeBackpropFilter` gives [kh, kw, G*Cin, M]. With
                 TensorFlow's oneDNN kernels (`ConvOptions.onednn`) it is called on
                 chunks of the input channels, [T, H, W, G*c] each, such that each call's
                 filter gradient G*c*kh*kw*M holds at most CHUNK_FLOATS numbers (oneDNN's
                 form of the kernel slows down by an order of magnitude once it holds
                 more than ~32k; Eigen's does not: docs/conv_ways.md);
    "patches"    the patches of `tf.image.extract_patches` ordered (kh, kw, Cin) and
                 one batched contraction per group.

"auto" takes "grouped" wherever it runs: float32, no dilation (TensorFlow's CPU
backward-filter kernel refuses dilations and has no float64 form), equal row and
column strides; it never writes the kh*kw copies of the input that the patches hold
(N*P*kh*kw*Cin numbers against the G*kh*kw*Cin*M of the result). Elsewhere "patches".
A filter larger than its map takes its live taps only (`_convolution.live_taps`). The
strategy values "depthwise" and "shifts" (a way removed: one contraction per tap, never
faster than these two) mean "grouped" and "patches" here.

Covered: NHWC, any strides, SAME/VALID/explicit padding, dilations; the filter static.
NCHW and the blocks of a SpaceToBatchND (Keras' dilated DepthwiseConv2D without
oneDNN: SpaceToBatchND -> DepthwiseConv2dNative -> BatchToSpaceND) through
`_conv_views`: the same ways on A and dZ re-laid-out to NHWC, example-major.

DepthwiseConv2dNativeBackpropInput (a depthwise transposed convolution; its weight is
the filter W [kh, kw, C, M], its data input A [N, Ho, Wo, C*M], its output Z
[N, H, W, C]). It computes the input gradient of the depthwise convolution
x -> dconv(x, W) at the output gradient A, the adjoint of that linear map:
    Z[n, y, c] = sum_{p, u, v, m : y = p*s + (u, v)*d - pad} W[u, v, c, m] A[n, p, c*M + m],
so, differentiating with respect to W,
    grad_i(W)[u, v, c, m] = sum_p dz_i(p*s + (u, v)*d - pad)[c] a_ip[c*M + m],
the filter gradient of dconv(., W) with dZ as its input and A as its output gradient
(as TensorFlow's registered gradient of the op, `_DepthwiseConv2dNativeBackpropInputGrad`
in nn_grad.py, computes for the batch; the same swap as `conv2d_transpose` for
Conv2DBackpropInput). `DepthwiseConv2DTransposeRule` builds that forward depthwise
convolution (never run) and hands it to this rule's ways (`_conv_views.TransposedView`).
"""

import tensorflow as tf

from pertower import _context
from pertower._convolution import geometry as geometry
from pertower._convolution import live_taps as _live_taps
from pertower._convolution import options as _conv_options
from pertower._convolution import views as _conv_views
from pertower._layout import _rows
from pertower._layout import _shapes
from pertower._convolution import squares as conv2d_squares
from pertower.rules import registry as registry_lib

__all__ = ["CHUNK_FLOATS", "GUESSED_G", "DepthwiseConv2DRule",
           "DepthwiseConv2DTransposeRule", "register"]

# "grouped": each backward-filter call writes at most CHUNK_FLOATS numbers (32 KB), the
# number of groups taken as GUESSED_G where it is known only at run time
CHUNK_FLOATS = 8192
GUESSED_G = 32



class DepthwiseConv2DRule(registry_lib.Rule):
    """Per-example depthwise filter gradients.

    Args:
      options: a `conv2d.ConvOptions` (default: strategy "auto").
    """

    @_context.public("rules.depthwise_conv2d.DepthwiseConv2DRule")
    def __init__(self, options=None):
        if options is None:
            options = _conv_options.ConvOptions()
        if not isinstance(options, _conv_options.ConvOptions):
            raise _context.error(TypeError, "`options` must be a ConvOptions, but received "
                                            f"{options!r}.")
        self.options = options

    def match(self, op, slot, analysis):
        view = _conv_views.view_use(self, op, slot, analysis)   # NCHW, SpaceToBatchND blocks
        if view is not None:
            return view
        rows = geometry.check_convolution(op, slot, analysis)
        if isinstance(rows, str):
            return rows
        if self.options.strategy in ("grouped", "depthwise") and not self._grouped_covers(op):
            return (f"the forced strategy {self.options.strategy!r} needs float32 and no "
                    "dilation")
        return registry_lib.Use(op, slot, self, op.inputs[0], op.outputs[0],
                                op.inputs[1].shape, rows)

    @staticmethod
    def _grouped_covers(op):
        # (TensorFlow's depthwise kernels take equal row and column strides only; a
        # grouped Conv2D computed as a depthwise one, `_conv_grouped`, may have others)
        strides = list(op.get_attr("strides"))
        return (op.inputs[0].dtype == tf.float32 and strides[1] == strides[2] and
                list(op.get_attr("dilations")) == [1, 1, 1, 1])

    def strategy(self, use, G=None):
        """"grouped" or "patches": the way `per_group` computes `use` (for `G` groups:
        "grouped" with one group, or maybe one, is TensorFlow's own kernel, which
        `_conv_options.untrusted_filter_gradient` keeps away from 1x1 strided filters)."""
        if self.options.strategy in ("patches", "shifts") or not self._grouped_covers(use.op):
            return "patches"
        if (not (isinstance(G, int) and G > 1) and
                _conv_options.untrusted_filter_gradient(use, self.options)):
            return "patches"
        return "grouped"

    def per_group(self, use, dZ, G):
        if isinstance(use, _conv_views.ViewUse):   # the NHWC ways on a re-laid-out copy
            return self.per_group(*use.view.inner(use, dZ), G)
        live = _live_taps.per_group_of_live_taps(self.per_group, use, dZ, G)
        if live is not None:      # a filter larger than its map: the live taps only
            return live
        if self.strategy(use, G) == "grouped":
            return self._grouped(use, dZ, G)
        return self._patches(use, dZ, G)

    def _grouped(self, use, dZ, G):
        kh, kw, c_in, mult = use.weight_shape.as_list()
        x, padding = geometry.explicitly_padded(use.op)
        # oneDNN's kernel: chunks of c input channels, G*c*kh*kw*M <= CHUNK_FLOATS (G
        # unknown: GUESSED_G); Eigen's: one call
        per_call = c_in if not _conv_options.onednn_runs(self.options) \
            else max(1, CHUNK_FLOATS // (kh * kw * mult * (G if isinstance(G, int) else GUESSED_G)))
        count = -(-c_in // per_call)
        sizes = [c_in // count + (1 if j < c_in % count else 0) for j in range(count)]
        channels = _shapes.constant(3)
        xs = tf.split(x, _shapes.constant(sizes), channels) if count > 1 else [x]
        dZs = (tf.split(dZ, _shapes.constant([c * mult for c in sizes]), channels)
               if count > 1 else [dZ])
        grads = []
        for c, x_part, dZ_part in zip(sizes, xs, dZs):
            grad = tf.raw_ops.DepthwiseConv2dNativeBackpropFilter(
                input=geometry.fold_groups(x_part, G, use.rows.k),     # [T, H, W, G*c]
                filter_sizes=geometry.sizes([kh, kw, geometry.mul(G, c), mult]),
                out_backprop=geometry.fold_groups(dZ_part, G, use.rows.k),  # [.., G*c*M]
                strides=list(use.op.get_attr("strides")), padding=padding,
                data_format="NHWC")                                   # [kh, kw, G*c, M]
            grads.append(tf.reshape(grad, _shapes.constant([kh, kw, -1, c, mult])))
        grad = tf.concat(grads, channels) if count > 1 else grads[0]  # [kh, kw, G, Cin, M]
        return tf.transpose(grad, _shapes.constant([2, 0, 1, 3, 4]))  # [G, kh, kw, Cin, M]

    @staticmethod
    def _patches(use, dZ, G):
        kh, kw, c_in, mult = use.weight_shape.as_list()
        k = use.rows.k
        x_patches = geometry.split_channels(
            geometry.to_groups(geometry.patches(use.op, kh, kw), G, k), G,
            [kh * kw, c_in])                                   # [G, P, kh*kw, Cin]
        dZ_g = geometry.split_channels(geometry.to_groups(dZ, G, k), G,
                                       [c_in, mult])           # [G, P, Cin, M]
        grad = tf.einsum("gpuc,gpcm->gucm", x_patches, dZ_g)   # [G, kh*kw, Cin, M]
        return tf.reshape(grad, geometry.group_target(G, [kh, kw, c_in, mult]))

    def sum_squared(self, use, dZ_columns, B, per_example=False):
        return conv2d_squares.sum_squared(self, use, dZ_columns, B, per_example)

    def sum_squared_size(self, use, C, per_example=False):
        return conv2d_squares.formed_size(use, C, per_example)

    def clipped_sum(self, use, dZ, factors):
        # sum_i f_i grad_i(W): the filter gradient of the batch with dZ scaled per
        # example (dilated filters form the per-example gradients instead)
        if isinstance(use, _conv_views.ViewUse):
            return self.clipped_sum(*use.view.inner(use, dZ), factors)
        strides = list(use.op.get_attr("strides"))
        if not geometry.plain_filter_gradient(use.op) or strides[1] != strides[2]:
            return registry_lib.default_clipped_sum(self, use, dZ, factors)
        if _conv_options.untrusted_filter_gradient(use, self.options):  # one group of shifts
            return registry_lib.batch_gradient_clipped_sum(self, use, dZ, factors)
        return geometry.filter_gradient(tf.raw_ops.DepthwiseConv2dNativeBackpropFilter, use,
                                        _rows.scale_rows(dZ, factors))


class DepthwiseConv2DTransposeRule(_conv_views.TransposedRule):
    """Per-example filter gradients of DepthwiseConv2dNativeBackpropInput (a depthwise
    transposed convolution) through `DepthwiseConv2DRule` on its forward convolution.

    Args:
      options: a `conv2d.ConvOptions` for the depthwise ways (default: "auto").
    """

    @_context.public("rules.depthwise_conv2d.DepthwiseConv2DTransposeRule")
    def __init__(self, options=None):
        self.convolution = DepthwiseConv2DRule(options)


def register(registry, options=None):
    """Adds the DepthwiseConv2dNative and DepthwiseConv2dNativeBackpropInput rules to
    `registry` (with `options`, a `conv2d.ConvOptions`)."""
    registry.register("DepthwiseConv2dNative", DepthwiseConv2DRule(options))
    registry.register("DepthwiseConv2dNativeBackpropInput",
                      DepthwiseConv2DTransposeRule(options))

"""Rule for DepthwiseConv2dNative (Keras DepthwiseConv2D / SeparableConv2D's depthwise part).

Identity (Rochette et al. 2019, arXiv 1912.06015; as for Conv2D, per channel): output
channel c*M + m at position p is sum_{u,v} x_p[u, v, c] W[u, v, c, m], so
    grad_i(W)[u, v, c, m] = sum_p x_ip[u, v, c] dz_ip[c, m],
computed one of three ways (each tested against the oracle):

    "patches"    the patches of `tf.image.extract_patches` ordered (kh, kw, Cin) and
                 one batched contraction per group;
    "grouped"    the batch folded into channels: x as [T, H, W, G*Cin] and dZ as
                 [T, Ho, Wo, G*Cin*M] are the input and output gradient of ONE depthwise
                 convolution with G*Cin channels (channel g*Cin + c of the folded dZ
                 block is dZ's channel c*M + m of group g, in the same order), so ONE
                 `DepthwiseConv2dNativeBackpropFilter` gives [kh, kw, G*Cin, M];
    "shifts"     per filter tap (u, v), the strided slice of the padded input that the
                 tap multiplies (`_conv_geometry.taps`) and one contraction with dZ over
                 each group's positions, [G, Cin, M], stacked to [G, kh, kw, Cin, M]
                 (forced only: "grouped" was faster wherever it runs).

"grouped" is used for float32 without dilation (TensorFlow's CPU backward-filter
kernel fails on dilations and has no float64 form); it never writes the kh*kw copies of
the input that the patches hold, which is what the patches form's time is spent on.
Measured (per_example_gradients of one 3x3 SAME depthwise layer, M = 1, B = 64,
float32, 2-core AVX-512 CPU shared with other jobs, best of 11, ms):

    H   C    | patches  grouped
    32   32  |  212      10.0
    16   64  |  106       7.9
     8  128  |   55       5.1
     4  256  |   24       2.4
Force one way with `DepthwiseConv2DRule(conv2d.ConvOptions(strategy=...))` ("grouped",
"patches" or "shifts"; "depthwise" means "grouped" here).

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
from pertower.rules import _rows
from pertower.rules import _shapes
from pertower._convolution import squares as conv2d_squares
from pertower.rules import registry as registry_lib

__all__ = ["DepthwiseConv2DRule", "DepthwiseConv2DTransposeRule", "register"]



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
        if self.options.strategy == "shifts" and geometry.spatial_pads(op, 1, 1) is None:
            return ("the forced strategy 'shifts' needs static input and output heights "
                    "and widths")
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
        """"grouped", "shifts" or "patches": the way `per_group` computes `use` (for `G`
        groups: "grouped" with one group, or maybe one, is TensorFlow's own kernel, which
        `_conv_options.untrusted_filter_gradient` keeps away from 1x1 strided filters)."""
        if self.options.strategy == "shifts":
            return "shifts"
        if self.options.strategy == "patches" or not self._grouped_covers(use.op):
            return "patches"
        if (not (isinstance(G, int) and G > 1) and
                _conv_options.untrusted_filter_gradient(use, self.options)):
            return "shifts" if geometry.spatial_pads(use.op, 1, 1) is not None else "patches"
        return "grouped"

    def per_group(self, use, dZ, G):
        if isinstance(use, _conv_views.ViewUse):   # the NHWC ways on a re-laid-out copy
            return self.per_group(*use.view.inner(use, dZ), G)
        live = _live_taps.per_group_of_live_taps(self.per_group, use, dZ, G)
        if live is not None:      # a filter larger than its map: the live taps only
            return live
        strategy = self.strategy(use, G)
        if strategy == "grouped":
            return self._grouped(use, dZ, G)
        if strategy == "shifts":
            return self._shifts(use, dZ, G)
        return self._patches(use, dZ, G)

    @staticmethod
    def _shifts(use, dZ, G):
        kh, kw, c_in, mult = use.weight_shape.as_list()
        k = use.rows.k
        dZ_g = geometry.split_channels(geometry.to_groups(dZ, G, k), G,
                                       [c_in, mult])              # [G, T*Ho*Wo, Cin, M]
        per_tap = [tf.einsum("gpc,gpcm->gcm", geometry.to_groups(x_tap, G, k), dZ_g)
                   for x_tap in geometry.taps(use.op, kh, kw)]  # kh*kw x [G, Cin, M]
        grad = tf.stack(per_tap, axis=1)                          # [G, kh*kw, Cin, M]
        return tf.reshape(grad, geometry.group_target(G, [kh, kw, c_in, mult]))

    @staticmethod
    def _grouped(use, dZ, G):
        kh, kw, c_in, mult = use.weight_shape.as_list()
        x, padding = geometry.explicitly_padded(use.op)
        grad = tf.raw_ops.DepthwiseConv2dNativeBackpropFilter(
            input=geometry.fold_groups(x, G, use.rows.k),       # [T, H, W, G*Cin]
            filter_sizes=geometry.sizes([kh, kw, geometry.mul(G, c_in), mult]),
            out_backprop=geometry.fold_groups(dZ, G, use.rows.k),  # [T, Ho, Wo, G*Cin*M]
            strides=list(use.op.get_attr("strides")), padding=padding,
            data_format="NHWC")                                   # [kh, kw, G*Cin, M]
        grad = tf.reshape(grad, _shapes.constant([kh, kw, -1, c_in, mult]))
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

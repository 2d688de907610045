"""Rule for DepthwiseConv2dNative (Keras DepthwiseConv2D / SeparableConv2D's depthwise part).

Identity (Rochette et al. 2019, arXiv 1912.06015; as for Conv2D, per channel): output
channel c*M + m at position p is sum_{u,v} x_p[u, v, c] W[u, v, c, m], so
    grad_i(W)[u, v, c, m] = sum_p x_ip[u, v, c] dz_ip[c, m],
with the patches of `tf.image.extract_patches` ordered (kh, kw, Cin).

Covered: NHWC, any strides, SAME/VALID/explicit padding, dilations; the filter static.
(Keras builds dilated depthwise convolutions with SpaceToBatchND, which mixes examples'
rows, so those fall back to towers.)
"""

import tensorflow as tf

from pertower.rules import _rows
from pertower.rules import conv2d
from pertower.rules import registry as registry_lib


class DepthwiseConv2DRule(registry_lib.Rule):
    """Per-example depthwise filter gradients from input patches."""

    def match(self, op, slot, analysis):
        rows = conv2d.check_convolution(op, slot, analysis)
        if isinstance(rows, str):
            return rows
        return registry_lib.Use(op, slot, self, op.inputs[0], op.outputs[0],
                                op.inputs[1].shape, rows)

    def per_group(self, use, dZ, G):
        kh, kw, c_in, mult = use.weight_shape.as_list()
        x_patches = tf.reshape(
            _rows.to_groups(conv2d.patches(use.op, kh, kw), G, 1),
            _rows.group_shape(G, [-1, kh * kw, c_in]))   # [G, P, kh*kw, Cin]
        dZ_g = tf.reshape(_rows.to_groups(dZ, G, 1),
                          _rows.group_shape(G, [-1, c_in, mult]))  # [G, P, Cin, M]
        grad = tf.einsum("gpuc,gpcm->gucm", x_patches, dZ_g)   # [G, kh*kw, Cin, M]
        return tf.reshape(grad, _rows.group_shape(G, [kh, kw, c_in, mult]))


    def clipped_sum(self, use, dZ, factors):
        # sum_i f_i grad_i(W): the filter gradient of the batch with dZ scaled per
        # example (dilated filters form the per-example gradients instead)
        if not conv2d.plain_filter_gradient(use.op):
            return registry_lib.default_clipped_sum(self, use, dZ, factors)
        return conv2d.filter_gradient(tf.raw_ops.DepthwiseConv2dNativeBackpropFilter, use,
                                      _rows.scale_rows(dZ, factors))


def register(registry):
    """Adds the DepthwiseConv2dNative rule to `registry`."""
    registry.register("DepthwiseConv2dNative", DepthwiseConv2DRule())

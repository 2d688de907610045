"""Rule for Conv2D (and Conv1D, which lowers to ExpandDims + Conv2D + Squeeze).

Identity (Rochette, Manoel, Tramel 2019, "Efficient per-example gradient computations
in convolutional neural networks", arXiv 1912.06015; the unfold form of Opacus'
grad_sample/conv.py and of BackPACK): a convolution is a dense layer applied at every
output position p to the patch x_p of the input that p sees,
    z_p = W^T x_p   (W as [kh*kw*Cin, Cout]),
so grad_i(W) = sum_p x_ip ⊗ dz_ip, with the patches taken by `tf.image.extract_patches`
with the op's strides, dilations (rates) and padding (explicit padding applied with
`tf.pad` first), ordered (kh, kw, Cin) like the filter.

Grouped convolutions (Keras' `groups=`, a filter [kh, kw, Cin/g, Cout] on an input of
Cin channels): input channel group j (channels j*Cin/g ... (j+1)*Cin/g - 1) feeds only
the output channels j*Cout/g ... (j+1)*Cout/g - 1 (the grouping of TensorFlow's Conv2D
kernel), so the identity holds group by group:
    grad_i(W)[:, :, :, group j] = sum_p x_ip[group j] ⊗ dz_ip[group j].

Covered: NHWC, any strides, SAME/VALID/explicit padding, dilations, groups; the filter
static and the input's channels static. Squared norms use the ghost form
sum_{p,q} (x_ip·x_iq)(dz_ip·dz_iq) when positions are few and the convolution is not
grouped, else the gradient is formed. The clipped sum
sum_i f_i grad_i(W) is the batch filter gradient (Conv2DBackpropFilter) with example
i's dZ scaled by f_i (Bu et al. 2023, arXiv 2210.00038).
"""

import tensorflow as tf

from pertower.rules import _rows
from pertower.rules import registry as registry_lib


def patches(op, filter_height, filter_width):
    """[N, Ho, Wo, kh*kw*Cin]: the input patch each output position of `op` sees."""
    x = op.inputs[0]
    padding = op.get_attr("padding").decode()
    if padding == "EXPLICIT":
        pairs = op.get_attr("explicit_paddings")
        x = tf.pad(x, [pairs[0:2], pairs[2:4], pairs[4:6], pairs[6:8]])
        padding = "VALID"
    strides = op.get_attr("strides")
    dilations = op.get_attr("dilations")
    return tf.image.extract_patches(
        x, sizes=[1, filter_height, filter_width, 1], strides=[1, strides[1], strides[2], 1],
        rates=[1, dilations[1], dilations[2], 1], padding=padding)


def check_convolution(op, slot, analysis):
    """The activation's Rows when `op` (Conv2D or DepthwiseConv2dNative) is covered,
    else a reason string."""
    if slot != 1:
        return "the weight is the convolution's input, not its filter"
    if op.get_attr("data_format") != b"NHWC":
        return f"data_format {op.get_attr('data_format').decode()} (only NHWC is covered)"
    if not op.inputs[1].shape.is_fully_defined():
        return "the filter's shape is not static"
    if groups(op) is None:
        return (f"the filter's {op.inputs[1].shape[2]} input channels do not divide the "
                f"input's channels ({op.inputs[0].shape[-1]}) into groups")
    return _rows.example_rows(analysis, op.inputs[0], op.outputs[0])


def groups(op):
    """g, the number of channel groups of the convolution `op` (1 for an ordinary one),
    or None when the input's channels are not static or not a multiple of the filter's
    input channels (or the output channels not a multiple of g)."""
    if op.type != "Conv2D":
        return 1
    channels = op.inputs[0].shape.with_rank_at_least(1)[-1]
    _, _, c_in, c_out = op.inputs[1].shape.as_list()
    channels = tf.compat.dimension_value(channels)
    if channels is None or channels % c_in or c_out % (channels // c_in):
        return None
    return channels // c_in


class Conv2DRule(registry_lib.Rule):
    """Per-example filter gradients from input patches."""

    def match(self, op, slot, analysis):
        rows = check_convolution(op, slot, analysis)
        if isinstance(rows, str):
            return rows
        return registry_lib.Use(op, slot, self, op.inputs[0], op.outputs[0],
                                op.inputs[1].shape, rows)

    def per_group(self, use, dZ, G):
        kh, kw, c_in, c_out = use.weight_shape.as_list()
        g = groups(use.op)
        x_patches = _rows.to_groups(patches(use.op, kh, kw), G, 1)  # [G, k*Ho*Wo, kh*kw*g*Cin]
        dZ_g = _rows.to_groups(dZ, G, 1)                           # [G, k*Ho*Wo, Cout]
        if g == 1:
            grad = tf.einsum("gpc,gpo->gco", x_patches, dZ_g)     # [G, kh*kw*Cin, Cout]
            return tf.reshape(grad, _rows.group_shape(G, [kh, kw, c_in, c_out]))
        # the patches' channels (kh, kw, g*Cin) and the outputs by group:
        # [G, P, kh*kw*g*Cin] -> [G, P, kh*kw, g, Cin]; [G, P, Cout] -> [G, P, g, Cout/g]
        x_patches = tf.reshape(x_patches, tf.concat(
            [tf.shape(x_patches)[:2], [kh * kw, g, c_in]], axis=0))
        dZ_g = tf.reshape(dZ_g, tf.concat([tf.shape(dZ_g)[:2], [g, c_out // g]], axis=0))
        grad = tf.einsum("gpkjc,gpjo->gkcjo", x_patches, dZ_g)    # [G, kh*kw, Cin, g, Cout/g]
        return tf.reshape(grad, _rows.group_shape(G, [kh, kw, c_in, c_out]))

    def squared_norms(self, use, dZ, B):
        kh, kw, c_in, c_out = use.weight_shape.as_list()
        if groups(use.op) != 1:
            return None
        positions = _rows.static_size(use.output.shape[1:3])
        if positions is None or not _rows.ghost_is_cheaper(use.rows.k * positions,
                                                           kh * kw * c_in, c_out):
            return None
        return _rows.dense_squared_norms(patches(use.op, kh, kw), dZ, B,
                                         use.rows.k * positions)


    def clipped_sum(self, use, dZ, factors):
        # sum_i f_i grad_i(W): the filter gradient of the batch with dZ scaled per
        # example; grouped or dilated filters form the per-example gradients instead
        # (TensorFlow's CPU Conv2DBackpropFilter without oneDNN refuses both)
        if not plain_filter_gradient(use.op):
            return registry_lib.default_clipped_sum(self, use, dZ, factors)
        return filter_gradient(tf.raw_ops.Conv2DBackpropFilter, use,
                               _rows.scale_rows(dZ, factors))


def plain_filter_gradient(op):
    """Whether TensorFlow's batch filter gradient runs everywhere for `op`: no groups
    and no dilation."""
    return groups(op) == 1 and all(d == 1 for d in op.get_attr("dilations"))


def filter_gradient(backprop_filter, use, out_backprop):
    """[*w.shape]: the batch filter gradient of `use.op` (Conv2D or
    DepthwiseConv2dNative) for the output gradient `out_backprop`, with the op's own
    strides, padding, dilations and data format."""
    op = use.op
    attrs = dict(strides=op.get_attr("strides"), padding=op.get_attr("padding"),
                 explicit_paddings=op.get_attr("explicit_paddings"),
                 data_format=op.get_attr("data_format"), dilations=op.get_attr("dilations"))
    if backprop_filter is tf.raw_ops.Conv2DBackpropFilter:
        attrs["use_cudnn_on_gpu"] = op.get_attr("use_cudnn_on_gpu")
    grad = backprop_filter(input=op.inputs[0], filter_sizes=use.weight_shape.as_list(),
                           out_backprop=out_backprop, **attrs)
    grad.set_shape(use.weight_shape)
    return grad


def register(registry):
    """Adds the Conv2D rule to `registry`."""
    registry.register("Conv2D", Conv2DRule())

"""Rule for Conv3D (tf_keras Conv3D, `tf.nn.conv3d`), NDHWC.

Notation: N images (N = G*T), G groups of contiguous examples, T images per group;
D, H, W the input's depth, height, width; Do, Ho, Wo the output's, P = Do*Ho*Wo;
W the filter [kd, kh, kw, Cin, Cout]; s, d the strides and dilations.

Identity (Rochette, Manoel, Tramel 2019, arXiv 1912.06015, for 2-D convolutions; the
same argument in 3-D): the convolution is a dense layer applied at every output
position p to the patch x_p of the input that p sees, z_p = W^T x_p, so
    grad_g(W)[u, v, w, c, o] = sum_{t in g, p} x_tp[u, v, w, c] dz_tp[o].
Computed as `conv2d`'s "shifts" way in 3-D: per filter tap (u, v, w) the input values
it multiplies are a strided slice of the padded input,
x'[:, u*d : : s, v*d : : s, w*d : : s, :] ([N, Do, Ho, Wo, Cin], no patches written;
`tf.extract_volume_patches` has no dilations), and
    grad_g(W)[u, v, w] = sum_{t in g, p} x'_tp(u, v, w) ⊗ dz_tp,
one batched matmul [G, T*P, Cin]^T x [G, T*P, Cout] -> [G, Cin, Cout] per tap, stacked to
[G, kd*kh*kw, Cin, Cout]; with thin input channels (Cin < 8) the taps are concatenated
along the channels first and contracted by ONE matmul, [G, kd*kh*kw*Cin, Cout].

The clipped sum sum_i f_i grad_i(W) (DP-SGD) is TensorFlow's batch filter gradient
(Conv3DBackpropFilterV2) with example i's dZ scaled by f_i (Bu et al. 2023, arXiv
2210.00038), when the filter is not dilated (its CPU kernel refuses dilations); else
the per-example gradients are formed and contracted. Squared norms are formed.

Keras builds a dilated Conv3D without oneDNN as SpaceToBatchND -> Conv3D ->
BatchToSpaceND: the rows of A and dZ are then the blocks of `lattice.Interleaved`, which
`_conv_views.regroup` puts example-major first (the sums do not depend on the order of
the rows).

Channel groups (Keras' Conv3D(groups=g), run in a jit-compiled function: `function_call`):
input channel group j feeds only output group j, so the identity holds group by group,
grad_g(W)[u, v, w, :, group j] = sum x'_tp(u, v, w)[group j] ⊗ dz_tp[group j]; the taps
side by side, [G, T*P, k^3, g, Cin], and ONE contraction with dZ [G, T*P, g, Cout/g]
for every tap and group; their clipped sum is formed.

Covered: NDHWC, any strides, SAME/VALID, dilations, channel groups; the filter and the
spatial sizes static. Also Conv3DBackpropInputV2 (Conv3DTranspose), through the
Conv3D of dZ (`Conv3DTransposeRule`).
"""

import tensorflow as tf

from pertower._convolution import views as _conv_views
from pertower._convolution.geometry import check_convolution, groups, padded_input
from pertower._convolution.geometry import taps as geometry_taps
from pertower._layout import _rows
from pertower.rules import registry as registry_lib

__all__ = ["Conv3DRule", "Conv3DTransposeRule", "register"]

_THIN_CHANNELS = 8


class Conv3DRule(registry_lib.Rule):
    """Per-example filter gradients of Conv3D (the 3-D "shifts" way)."""

    def match(self, op, slot, analysis):
        shapes = (op.inputs[0].shape[1:], op.outputs[0].shape[1:4])
        if op.inputs[0].shape.rank != 5 or not all(s.is_fully_defined() for s in shapes):
            return "the input's and output's depths, heights, widths and channels are not static"
        view = _conv_views.view_use(self, op, slot, analysis)   # SpaceToBatchND blocks
        if view is not None:
            return view
        rows = check_convolution(op, slot, analysis)
        if isinstance(rows, str):
            return rows
        return registry_lib.Use(op, slot, self, op.inputs[0], op.outputs[0],
                                op.inputs[1].shape, rows)

    @staticmethod
    def _layout(use, tensor):
        if isinstance(use, _conv_views.ViewUse):
            return use.view.layout(tensor)        # example-major rows
        return tensor

    def per_group(self, use, dZ, G):
        kd, kh, kw, c_in, c_out = use.weight_shape.as_list()
        kernel = [kd, kh, kw]
        x = padded_input(use.op, *kernel, crop=False, x=self._layout(use, use.activation))
        taps = geometry_taps(use.op, kernel, x)                   # k^3 x [N, Do, Ho, Wo, Cin]
        dZ_g = _rows.to_groups(self._layout(use, dZ), G, 1)       # [G, T*P, Cout]
        g = groups(use.op)
        if g > 1:   # every tap and group in one contraction: [G, T*P, k^3, g, Cin]
            rows = tf.reshape(_rows.to_groups(tf.concat(taps, axis=-1), G, 1),
                              _rows.group_shape(G, [-1, kd * kh * kw, g, c_in]))
            dZ_g = tf.reshape(dZ_g, _rows.group_shape(G, [-1, g, c_out // g]))
            grad = tf.einsum("gpkjc,gpjo->gkcjo", rows, dZ_g)   # [G, k^3, Cin, g, Cout/g]
        elif c_in < _THIN_CHANNELS:
            rows = _rows.to_groups(tf.concat(taps, axis=-1), G, 1)  # [G, T*P, k^3*Cin]
            grad = tf.matmul(rows, dZ_g, transpose_a=True)          # [G, k^3*Cin, Cout]
        else:
            grad = tf.stack([tf.matmul(_rows.to_groups(tap, G, 1), dZ_g, transpose_a=True)
                             for tap in taps], axis=1)              # [G, k^3, Cin, Cout]
        return tf.reshape(grad, _rows.group_shape(G, [kd, kh, kw, c_in, c_out]))

    def clipped_sum(self, use, dZ, factors):
        # sum_i f_i grad_i(W): the batch filter gradient of dZ scaled per example
        op = use.op
        if (list(op.get_attr("dilations")) != [1] * 5 or groups(op) != 1 or
                isinstance(use, _conv_views.ViewUse)):
            return registry_lib.default_clipped_sum(self, use, dZ, factors)
        grad = tf.raw_ops.Conv3DBackpropFilterV2(
            input=op.inputs[0], filter_sizes=use.weight_shape.as_list(),
            out_backprop=_rows.scale_rows(dZ, factors), strides=op.get_attr("strides"),
            padding=op.get_attr("padding"), data_format="NDHWC",
            dilations=op.get_attr("dilations"))
        grad.set_shape(use.weight_shape)
        return grad


class _TransposedView:
    """The forward Conv3D of a Conv3DBackpropInputV2: its input is dZ, its output
    gradient A."""

    def inner(self, use, dZ):
        op = use.op
        dZ = tf.identity(dZ)
        dZ.set_shape(op.outputs[0].shape)                     # (static sizes for the taps)
        forward = tf.raw_ops.Conv3D(input=dZ, filter=op.inputs[1], strides=op.get_attr(
            "strides"), padding=op.get_attr("padding"), data_format="NDHWC",
            dilations=op.get_attr("dilations")).op
        return (registry_lib.Use(forward, 1, use.rule, dZ, forward.outputs[0],
                                 use.weight_shape, use.rows), use.activation)


class Conv3DTransposeRule(registry_lib.Rule):
    """Per-example filter gradients of Conv3DBackpropInputV2 (tf_keras Conv3DTranspose,
    `tf.nn.conv3d_transpose`), NDHWC: as for `conv2d_transpose`, the op applies the
    adjoint of x -> conv3d(x, W) to A, so its filter gradient is that of the Conv3D of
    dZ with W at the output gradient A (TensorFlow's `_Conv3DBackpropInputGrad`:
    Conv3DBackpropFilterV2(dZ, A)); kept per example, `Conv3DRule` on that Conv3D."""

    def __init__(self):
        self.convolution = Conv3DRule()

    def match(self, op, slot, analysis):
        if slot != 1:
            return ("the weight is the transposed convolution's data or output shape, not "
                    "its filter")
        if op.get_attr("data_format") != b"NDHWC":
            return f"data_format {op.get_attr('data_format').decode()} (only NDHWC is covered)"
        static = (op.inputs[1].shape, op.inputs[2].shape[1:], op.outputs[0].shape[1:])
        if op.outputs[0].shape.rank != 5 or not all(s.is_fully_defined() for s in static):
            return "the filter's, input's and output's sizes (but the batch) are not static"
        if op.outputs[0].shape[4] != op.inputs[1].shape[3]:
            return "its output's channels are not the filter's (grouped convolutions)"
        rows = _rows.example_rows(analysis, op.inputs[2], op.outputs[0])
        if isinstance(rows, str):
            return rows
        return _conv_views.ViewUse(op, slot, self, op.inputs[2], op.outputs[0],
                                   op.inputs[1].shape, rows, view=_TransposedView())

    def per_group(self, use, dZ, G):
        return self.convolution.per_group(*use.view.inner(use, dZ), G)

    def clipped_sum(self, use, dZ, factors):
        return self.convolution.clipped_sum(*use.view.inner(use, dZ), factors)


def register(registry):
    """Adds the Conv3D and Conv3DBackpropInputV2 rules to `registry`."""
    registry.register("Conv3D", Conv3DRule())
    registry.register("Conv3DBackpropInputV2", Conv3DTransposeRule())

"""Rules for Conv3D (tf_keras Conv3D, `tf.nn.conv3d`) and Conv3DBackpropInputV2
(Conv3DTranspose, `tf.nn.conv3d_transpose`), NDHWC: the N-dimensional convolution rule
of `conv2d` (`ConvolutionRule`, `TransposedRule`) in 3-D.

Identity (Rochette, Manoel, Tramel 2019, arXiv 1912.06015, the same argument in 3-D):
    grad_g(W)[u, v, w, c, o] = sum_{t in g, p} x_tp[u, v, w, c] dz_tp[o],
computed by "shifts" (per tap (u, v, w) a strided slice of the padded input; the taps
side by side where the positions are few or the channels thin, `_convolution.ways`).
Conv3DBackpropInputV2 applies the adjoint of x -> conv3d(x, W) to its data A, so its
filter gradient is that of the Conv3D of dZ with W at the output gradient A
(TensorFlow's `_Conv3DBackpropInputGrad`), as for `conv2d_transpose`.

Keras builds a dilated Conv3D without oneDNN as SpaceToBatchND -> Conv3D ->
BatchToSpaceND, and a grouped one in a jit-compiled function (`function_call`); both are
covered. The clipped sum is TensorFlow's Conv3DBackpropFilterV2 of the scaled dZ where
the filter is neither dilated nor grouped; squared norms are formed.

Covered: NDHWC, any strides, SAME/VALID, dilations, channel groups; the filter and the
spatial sizes static.
"""

from pertower import _context
from pertower.rules import conv2d

__all__ = ["Conv3DRule", "Conv3DTransposeRule", "register"]


class Conv3DRule(conv2d.ConvolutionRule):
    """Per-example filter gradients of Conv3D.

    Args:
      options: a `conv2d.ConvOptions` (default: strategy "auto").
    """

    @_context.public("rules.conv3d.Conv3DRule")
    def __init__(self, options=None):
        super().__init__(options)


class Conv3DTransposeRule(conv2d.TransposedRule):
    """Per-example filter gradients of Conv3DBackpropInputV2 through the Conv3D of dZ.

    Args:
      options: a `conv2d.ConvOptions` (default: strategy "auto").
    """

    @_context.public("rules.conv3d.Conv3DTransposeRule")
    def __init__(self, options=None):
        super().__init__(options)


def register(registry):
    """Adds the Conv3D and Conv3DBackpropInputV2 rules to `registry`."""
    registry.register("Conv3D", Conv3DRule())
    registry.register("Conv3DBackpropInputV2", Conv3DTransposeRule())

"""Rules for Conv3D (tf_keras Conv3D, `tf.nn.conv3d`) and Conv3DBackpropInputV2
(Conv3DTranspose), NDHWC: `conv2d`'s N-dimensional rules in 3-D (its identity,
grad_g(W)[u, v, w, c, o] = sum_{t in g, p} x_tp[u, v, w, c] dz_tp[o], by "shifts"; the
transposed op as in `conv2d_transpose`). Also covered: a dilated Conv3D without oneDNN
(SpaceToBatchND blocks), a grouped one (Keras' jit-compiled call: `function_call`); the
clipped sum is Conv3DBackpropFilterV2 of the scaled dZ unless dilated or grouped;
squared norms are formed. The filter and the spatial sizes static.
"""

from pertower import _context
from pertower.rules import conv2d

__all__ = ["Conv3DRule", "Conv3DTransposeRule", "register"]


class Conv3DRule(conv2d.ConvolutionRule):
    """Per-example filter gradients of Conv3D (`options`: a `conv2d.ConvOptions`)."""

    @_context.public("rules.conv3d.Conv3DRule")
    def __init__(self, options=None):
        super().__init__(options)


class Conv3DTransposeRule(conv2d.TransposedRule):
    """Per-example filter gradients of Conv3DBackpropInputV2 through the Conv3D of dZ
    (`options`: a `conv2d.ConvOptions`)."""

    @_context.public("rules.conv3d.Conv3DTransposeRule")
    def __init__(self, options=None):
        super().__init__(options)


def register(registry):
    """Adds the Conv3D and Conv3DBackpropInputV2 rules to `registry`."""
    registry.register("Conv3D", Conv3DRule())
    registry.register("Conv3DBackpropInputV2", Conv3DTransposeRule())

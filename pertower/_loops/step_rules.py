"""Rules of reads inside a loop body that read more than A_t and dZ_t, computed on every
step at once (notation: `pertower._loops`).

A body op cannot hand its own inputs out of the loop; what its rule reads besides A and
dZ is rebuilt outside it:
- `StepBroadcast`: a two-input broadcast op (`rules.broadcast`) on A_all and the weight's
  value before the loop (the same at every step).
- `StepConvolution`: a convolution (`rules.conv2d.ConvolutionRule`: Conv2D, Conv3D,
  DepthwiseConv2dNative; tf_keras' ConvLSTM1D/2D/3D cells) on A_all, [B*k*T, H, W, Cin]:
  its ways read the op's data input, attributes and static shapes only, so the body
  op's convolution laid on A_all (never run) gives each quantity over example i's k*T
  images: grad_i(W) = sum over t of grad_i,t(W) (Rochette et al. 2019, arXiv
  1912.06015, per step).
"""

import dataclasses

import tensorflow as tf

from pertower._convolution import geometry
from pertower.rules import registry as registry_lib

__all__ = ["STEP_CONVOLUTION_MODULES", "STEP_CONVOLUTION_OP_TYPES", "StepBroadcast",
           "StepConvolution"]

# the convolutions whose built-in rules read only A (the op's input 0), the op's
# attributes and static shapes: rebuilt on A_all (`StepConvolution`)
STEP_CONVOLUTION_OP_TYPES = frozenset({"Conv2D", "Conv3D", "DepthwiseConv2dNative"})
STEP_CONVOLUTION_MODULES = frozenset({"pertower.rules.conv2d", "pertower.rules.conv3d",
                                      "pertower.rules.depthwise_conv2d"})


class StepBroadcast(registry_lib.Rule):
    """A broadcast rule (`rules.broadcast`) reading the body tensor `weight` (the weight,
    or a piece or function of it): the op is rebuilt on A_all, [B*k*T, ...] (its other
    input's steps), and the weight's value before the loop (the same at every step);
    grad_i(w) sums over example i's rows of every step."""

    def __init__(self, rule, loop, weight):
        self.rule, self.loop, self.weight = rule, loop, weight

    def per_group(self, use, dZ, G):
        inputs = [use.activation] * 2
        inputs[use.slot] = self.loop.outside(self.weight, build=True)
        return self.rule.per_group(use, dZ, G, inputs)

    # sum_i f_i grad_i(w): the one-group gradient of dZ scaled per example
    clipped_sum = registry_lib.batch_gradient_clipped_sum


class StepConvolution(registry_lib.ForwardingRule):
    """The convolution rule `rule` of a body op, on the built use of every step: its `Use`
    of a convolution with the body op's attributes on A_all, [B*k*T, H, W, Cin], and a
    filter of the weight's shape (built once per A_all, never run); dZ_all, [B*k*T, Ho,
    Wo, Cout], is that convolution's output gradient, k*T images per example."""

    def __init__(self, rule):
        self.rule = rule
        self._ops = {}   # A_all ref -> the convolution on it

    def inner(self, use, dZ):
        key = use.activation.ref()
        if key not in self._ops:
            stand_in = tf.zeros(use.weight_shape, use.activation.dtype)   # only its shape is read
            self._ops[key] = geometry.convolution_like(use.op, use.activation, stand_in)
        op = self._ops[key]
        return dataclasses.replace(use, op=op, slot=1, rule=self.rule, output=op.outputs[0]), dZ

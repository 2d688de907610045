"""Rule for FusedBatchNorm(V2/V3) in inference mode (Keras BatchNormalization called
with training=False): batch normalization with the moving statistics.

Notation: A the op's input x, [B*k, H, W, C] (NHWC) or [B*k, C, H, W] (NCHW); dZ the
gradient at its output y; mu, sigma2 the moving mean and variance [C]; eps its epsilon.

Identity: the statistics do not depend on the batch, so with y = gamma * (x - mu) /
sqrt(sigma2 + eps) + beta (per channel), summing over example i's rows and positions,
    grad_i(gamma) = rsqrt(sigma2 + eps) * sum dz * (x - mu),    grad_i(beta) = sum dz
(Ioffe & Szegedy 2015, arXiv 1502.03167, section 3: TensorFlow's FusedBatchNormGrad
with is_training=False, kept per example), in the dtype of `scale`.

Covered: is_training=False, NHWC, NCHW, NDHWC, NCDHW, the weight as `scale` (input 1)
or `offset` (input 2); the moving statistics get no gradient and fall back.
"""

import tensorflow as tf

from pertower._layout import _shapes
from pertower.rules import registry as registry_lib

__all__ = ["FusedBatchNormRule", "register"]

_SCALE, _OFFSET = 1, 2
_OP_TYPES = ("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3")


class FusedBatchNormRule(registry_lib.Rule):
    """Per-example sums of dZ * x_hat (gamma) and of dZ (beta) over positions."""

    def match(self, op, slot, analysis):
        if slot == 0:
            return "the weight is the normalized input x, not the scale or offset"
        if slot not in (_SCALE, _OFFSET):
            return (f"the weight is a moving statistic (input {slot}), which TensorFlow's "
                    "gradient in inference mode leaves out")
        if op.get_attr("is_training"):
            return ("the op normalizes with the batch's own statistics "
                    "(is_training=True); call the layer with training=False")
        if op.inputs[0].shape.rank is None:
            return "its input has no static rank"
        return self.example_use(op, slot, analysis)

    def per_group(self, use, dZ, G):
        A = use.activation                                   # [G*k, ...] with C on `channel`
        rank = A.shape.rank
        channel = 1 if use.op.get_attr("data_format").startswith(b"NC") else rank - 1
        dtype = use.op.inputs[_SCALE].dtype                  # float32 for float16 inputs
        term = tf.cast(dZ, dtype)                             # [G*k, ...]
        if use.slot == _OFFSET:
            return _shapes.group_sum(term, G, use.rows.k, channel)               # [G, C]
        # sum dz * x_hat = rsqrt(sigma2 + eps) * sum dz * (x - mu): [C] applied to [G, C]
        mean = use.op.inputs[3]                               # [C]
        if channel != rank - 1:                               # [C] -> [C, 1, ...] (NC...)
            mean = tf.reshape(mean, _shapes.constant([-1] + [1] * (rank - 1 - channel)))
        term = term * (tf.cast(A, dtype) - mean)              # [G*k, ...]
        scale = tf.math.rsqrt(use.op.inputs[4] + _shapes.constant(
            use.op.get_attr("epsilon"), dtype))               # [C]
        return _shapes.group_sum(term, G, use.rows.k, channel) * scale          # [G, C]

    # sum_i f_i grad_i(w): the one-group (batch) gradient of dZ scaled per example
    clipped_sum = registry_lib.batch_gradient_clipped_sum


def register(registry):
    """Adds the FusedBatchNorm rules to `registry`."""
    registry_lib.register_each(registry, _OP_TYPES, FusedBatchNormRule())

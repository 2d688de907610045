"""Convolutions that the NHWC rules compute on a re-laid-out copy ("views").

Notation (as in `conv2d`): N images, B examples, k rows per example; A the op's
batch-side input, dZ the gradient at its output, W the filter.

A filter gradient is a sum over images and positions of (input patch) ⊗ (output
gradient), so it does not depend on how the images are ordered on axis 0 or on where
the channel axis is, as long as A and dZ are re-laid-out alike. Three views:

    "NCHW"          A and dZ transposed to NHWC ([N, C, H, W] -> [N, H, W, C]) with the
                    strides, dilations and explicit paddings permuted alike.
    blocks          a convolution between SpaceToBatchND and BatchToSpaceND (a dilated
                    convolution as TensorFlow builds it without oneDNN): example i owns
                    rows j*B*inner + i*inner + t of A and dZ (`lattice.Interleaved`);
                    [blocks, B*inner, ...] -> [B*inner, blocks, ...] puts them
                    example-major, k = inner*blocks rows per example.
    transposed      Conv2DBackpropInput (`conv2d_transpose`) and
                    DepthwiseConv2dNativeBackpropInput (`depthwise_conv2d`): the filter
                    gradient of the forward convolution the op transposes, with dZ as its
                    input and A as its output gradient (`TransposedView`).

Each view builds, at gradient time, an NHWC convolution op on the re-laid-out input
(never run: only its input, attributes and static output shape are read) and the
`Use` of it with example-major rows, and hands them to the NHWC rule's ways.
"""

import dataclasses

import tensorflow as tf

from pertower import _batch_axis
from pertower._layout import _rows
from pertower.rules import registry as registry_lib

__all__ = ["ViewUse", "View", "TransposedView", "TransposedRule", "view_use",
           "nhwc_convolution", "to_nhwc", "regroup"]

_TO_NHWC = (0, 2, 3, 1)
_TRANSPOSED_FILTER, _TRANSPOSED_DATA = 1, 2   # the inputs of a transposed convolution


@dataclasses.dataclass(frozen=True)
class ViewUse(registry_lib.Use):
    """A `Use` that its rule computes through `view` (a `View`); `rows` are those of the
    re-laid-out (example-major) A."""

    view: object = None


@dataclasses.dataclass(frozen=True)
class View:
    """How to re-lay-out a convolution's A and dZ.

    Attributes:
      nchw: A and dZ are [N, C, H, W] (transposed to NHWC).
      blocks: None, or (inner, blocks) of the Interleaved rows of A and dZ.
    """

    nchw: bool = False
    blocks: tuple = None

    def layout(self, tensor):
        """`tensor` (A or dZ) as [N, H, W, C] with example-major rows."""
        if self.nchw:
            tensor = to_nhwc(tensor)
        if self.blocks is not None:
            tensor = regroup(tensor, self.blocks[1])
        return tensor

    def inner(self, use, dZ):
        """(the `Use` of the NHWC convolution on the re-laid-out A, its dZ)."""
        x = self.layout(use.activation)
        op = nhwc_convolution(use.op, x, use.op.inputs[1], self.nchw)
        inner = registry_lib.Use(op, 1, use.rule, x, op.outputs[0], use.weight_shape,
                                 use.rows)
        return inner, self.layout(dZ)


@dataclasses.dataclass(frozen=True)
class TransposedView:
    """The forward convolution of a transposed one (Conv2DBackpropInput,
    DepthwiseConv2dNativeBackpropInput: filter at input 1, A at input 2): its input is
    dZ, its output gradient A (both moved to NHWC when `nchw`)."""

    nchw: bool

    def inner(self, use, dZ):
        """(the `Use` of the forward NHWC convolution of dZ, A as its output gradient)."""
        layout = to_nhwc if self.nchw else (lambda t: t)
        x = layout(dZ)                                         # [N, H, W, Cf]
        op = nhwc_convolution(use.op, x, use.op.inputs[1], self.nchw)
        inner = registry_lib.Use(op, 1, use.rule, x, op.outputs[0], use.weight_shape,
                                 use.rows)
        return inner, layout(use.activation)                   # A: [N, Ho, Wo, Of]


class TransposedRule(registry_lib.Rule):
    """A rule for a transposed convolution (filter at input 1, data at input 2) that
    hands the forward convolution of dZ, with A as its output gradient
    (`TransposedView`), to `self.convolution`, the rule of that forward op.
    Subclasses set `self.convolution` and may refuse more in `_refuse(op)`."""

    convolution = None

    def _refuse(self, op):   # pylint: disable=unused-argument
        """Why the op's layout is not covered beyond the shared checks, or None."""
        return None

    def match(self, op, slot, analysis):
        if slot != _TRANSPOSED_FILTER:
            return ("the weight is the transposed convolution's data or output shape, not "
                    "its filter")
        data_format = op.get_attr("data_format").decode()
        if data_format not in ("NHWC", "NCHW"):
            return f"data_format {data_format} (NHWC and NCHW are covered)"
        if not op.inputs[_TRANSPOSED_FILTER].shape.is_fully_defined():
            return "the filter's shape is not static"
        refused = self._refuse(op)
        if refused is not None:
            return refused
        rows = _rows.example_rows(analysis, op.inputs[_TRANSPOSED_DATA], op.outputs[0])
        if isinstance(rows, str):
            return rows
        return ViewUse(op, slot, self, op.inputs[_TRANSPOSED_DATA], op.outputs[0],
                       op.inputs[_TRANSPOSED_FILTER].shape, rows,
                       view=TransposedView(data_format == "NCHW"))

    def per_group(self, use, dZ, G):
        return self.convolution.per_group(*use.view.inner(use, dZ), G)

    def clipped_sum(self, use, dZ, factors):
        return self.convolution.clipped_sum(*use.view.inner(use, dZ), factors)


def to_nhwc(tensor):
    """[N, C, H, W] -> [N, H, W, C]."""
    return tf.transpose(tensor, _TO_NHWC)


def regroup(tensor, blocks):
    """[blocks*R, ...] -> [R*blocks, ...]: row j*R + r moves to row r*blocks + j, so
    that the rows of example i (rows j*B*inner + i*inner + t, R = B*inner) are
    contiguous."""
    rest = [_rows.dim(tensor, axis) for axis in range(1, tensor.shape.rank)]
    split = tf.reshape(tensor, _rows.group_shape(blocks, [-1] + rest))   # [blocks, R, ...]
    moved = tf.transpose(split, [1, 0] + list(range(2, tensor.shape.rank + 1)))
    out = tf.reshape(moved, _rows.group_shape(-1, rest))                 # [R*blocks, ...]
    out.set_shape(tensor.shape)
    return out


def _permuted(values, nchw):
    values = list(values)
    return [values[j] for j in _TO_NHWC] if nchw else values


def nhwc_convolution(op, x, w, nchw):
    """The NHWC op of `op`'s type (Conv2D or DepthwiseConv2dNative; the forward
    convolution of a Conv2DBackpropInput is a Conv2D, of a
    DepthwiseConv2dNativeBackpropInput a DepthwiseConv2dNative) on `x` with filter `w` and
    op's strides, padding and dilations (permuted from NCHW when `nchw`)."""
    padding = op.get_attr("padding")
    pairs = list(op.get_attr("explicit_paddings"))
    if pairs and nchw:
        pairs = [p for j in _TO_NHWC for p in pairs[2 * j:2 * j + 2]]
    attrs = dict(strides=_permuted(op.get_attr("strides"), nchw), padding=padding,
                 explicit_paddings=pairs, dilations=_permuted(op.get_attr("dilations"), nchw),
                 data_format="NHWC")
    if op.type.startswith("DepthwiseConv2dNative"):
        return tf.raw_ops.DepthwiseConv2dNative(input=x, filter=w, **attrs).op
    return tf.raw_ops.Conv2D(input=x, filter=w, **attrs).op


def view_use(rule, op, slot, analysis):
    """A `ViewUse` of the filter at `slot` of `op` (Conv2D or DepthwiseConv2dNative)
    when op is NCHW or reads the blocks of a SpaceToBatchND; None when op is NHWC on
    example-major rows (the rule's own case); else a string saying why not."""
    nchw = op.get_attr("data_format") == b"NCHW"
    value = analysis.value(op.inputs[0])
    interleaved = isinstance(value, _batch_axis.Interleaved)
    if not nchw and not interleaved:
        return None
    if slot != 1:
        return "the weight is the convolution's input, not its filter"
    if not op.inputs[1].shape.is_fully_defined():
        return "the filter's shape is not static"
    if interleaved:
        out = analysis.value(op.outputs[0])
        if nchw or not isinstance(out, _batch_axis.Interleaved) or out[:2] != value[:2]:
            return "its input's blocks (SpaceToBatchND) are not its output's"
        view = View(blocks=(value.inner, value.blocks))
        rows = _batch_axis.Rows(0, value.inner * value.blocks, value.E)
    else:
        rows = _rows.example_rows(analysis, op.inputs[0], op.outputs[0])
        if isinstance(rows, str):
            return rows
        view = View(nchw=True)
    if op.type == "Conv2D" and (op.inputs[0].shape.rank is None or tf.compat.dimension_value(
            op.inputs[0].shape[1 if nchw else -1]) != op.inputs[1].shape[2]):
        return "grouped convolutions are covered in NHWC only"
    return ViewUse(op, slot, rule, op.inputs[0], op.outputs[0], op.inputs[1].shape, rows,
                   view=view)

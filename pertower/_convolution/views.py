"""Convolutions that the channels-last ways compute as another one ("views"), built at
gradient time (never run). A filter gradient is a sum over images and positions of
(input patch) ⊗ (output gradient), so the order of the images and the place of the
channel axis do not matter as long as A and dZ are re-laid-out alike:

    NCHW        A and dZ transposed to NHWC, the attributes permuted alike.
    blocks      between SpaceToBatchND and BatchToSpaceND (a dilated convolution
                without oneDNN) example i owns rows j*B*inner + i*inner + t of A and dZ
                (`lattice.Interleaved`); `regroup` puts them example-major.
    transposed  the forward convolution of dZ, A as its output gradient
                (`rules.conv2d_transpose`).
    depthwise   a Conv2D with g = C groups (filter [kh, kw, 1, C*M], output o reading
                input channel o // M) is depthwise_conv2d(x, reshape(W, [kh, kw, C, M])).
"""

import dataclasses

import tensorflow as tf

from pertower import _batch_axis
from pertower._layout import _rows
from pertower._layout import _shapes
from pertower._convolution.geometry import convolution_like, group_target, groups

__all__ = ["View", "view_of", "transposed_view_of", "regroup", "depthwise_like",
           "as_depthwise", "to_grouped"]

_TO_NHWC = (0, 2, 3, 1)
_FILTER, _DATA = 1, 2   # the inputs of a transposed convolution


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


@dataclasses.dataclass(frozen=True)
class View:
    """How a convolution is computed as a channels-last one: A and dZ transposed from
    NCHW (`nchw`), their Interleaved rows' (inner, blocks) put example-major (`blocks`),
    and/or (`transposed`) the forward convolution of dZ with A as its output gradient."""

    nchw: bool = False
    blocks: tuple = None
    transposed: bool = False

    def layout(self, tensor):
        """`tensor` (A or dZ) channels last, with example-major rows."""
        if self.nchw:
            tensor = tf.transpose(tensor, _TO_NHWC)            # [N, C, H, W] -> [N, H, W, C]
        if self.blocks is not None:
            tensor = regroup(tensor, self.blocks[1])
        return tensor

    def inner(self, use, dZ):
        """(the channels-last convolution op, its output gradient)."""
        x, out_grad = (dZ, use.activation) if self.transposed else (use.activation, dZ)
        x = self.layout(x)
        if self.transposed and not x.shape[1:].is_fully_defined():   # (static for the taps)
            shape = use.op.outputs[0].shape
            x = tf.identity(x)
            x.set_shape([shape[j] for j in _TO_NHWC] if self.nchw else shape)
        op, w = use.op, use.op.inputs[_FILTER]
        if not self.nchw:
            return convolution_like(op, x, w), self.layout(out_grad)
        pairs = list(op.get_attr("explicit_paddings"))
        strides, dilations = (op.get_attr(name) for name in ("strides", "dilations"))
        return convolution_like(
            op, x, w, explicit_paddings=[p for j in _TO_NHWC for p in pairs[2 * j:2 * j + 2]],
            strides=[strides[j] for j in _TO_NHWC],
            dilations=[dilations[j] for j in _TO_NHWC]), self.layout(out_grad)


def view_of(op, analysis):
    """(a `View`, the re-laid-out A's rows) when `op` (its filter static) is NCHW or
    reads SpaceToBatchND blocks; None when it is channels last on example-major rows;
    else why not."""
    nchw = op.get_attr("data_format") == b"NCHW"
    value = analysis.value(op.inputs[0])
    interleaved = isinstance(value, _batch_axis.Interleaved)
    if not nchw and not interleaved:
        return None
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
    return view, rows


def transposed_view_of(op, slot, analysis):
    """(a transposed `View`, A's rows) of the filter of the transposed convolution `op`
    (filter at input 1, A at input 2), else a string saying why not."""
    if slot != _FILTER:
        return "the weight is the transposed convolution's data or output shape, not its filter"
    data_format = op.get_attr("data_format").decode()
    if data_format not in ("NHWC", "NCHW", "NDHWC"):
        return f"data_format {data_format} (NHWC, NCHW and NDHWC are covered)"
    w = op.inputs[_FILTER].shape
    if not w.is_fully_defined():
        return "the filter's shape is not static"
    if w.rank == 5 and not (op.inputs[_DATA].shape[1:].is_fully_defined() and
                            op.outputs[0].shape[1:].is_fully_defined()):
        return "the filter's, input's and output's sizes (but the batch) are not static"
    channels = op.outputs[0].shape.with_rank(w.rank)[1 if data_format == "NCHW" else -1]
    if tf.compat.dimension_value(channels) != w[-2]:
        return "its output's channels are not the filter's (grouped convolutions)"
    rows = _rows.example_rows(analysis, op.inputs[_DATA], op.outputs[0])
    if isinstance(rows, str):
        return rows
    return View(nchw=data_format == "NCHW", transposed=True), rows


def depthwise_like(op):
    """Whether `op` is a Conv2D whose every group has one input channel (g = C > 1)."""
    if op.type != "Conv2D" or not op.inputs[1].shape.is_fully_defined():
        return False
    g = groups(op)
    return g is not None and g > 1 and op.inputs[1].shape.as_list()[2] == 1


def as_depthwise(use):
    """`use` (`depthwise_like`) as a DepthwiseConv2dNative's, filter [kh, kw, C, M]."""
    kh, kw, _, c_out = use.weight_shape.as_list()
    c = groups(use.op)
    shape = [kh, kw, c, c_out // c]
    w = tf.reshape(use.op.inputs[1], _shapes.constant(shape))
    op = convolution_like(use.op, use.activation, w, "DepthwiseConv2dNative")
    return dataclasses.replace(use, op=op, output=op.outputs[0],
                               weight_shape=tf.TensorShape(shape))


def to_grouped(gradients, use, leading):
    """[*leading, kh, kw, C, M] -> [*leading, kh, kw, 1, C*M] (`leading`: [] or [G])."""
    if not leading:
        return tf.reshape(gradients, _shapes.constant(use.weight_shape.as_list()))
    return tf.reshape(gradients, group_target(leading[0], use.weight_shape.as_list()))

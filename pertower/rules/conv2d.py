"""Rule for Conv2D (and Conv1D, which lowers to ExpandDims + Conv2D + Squeeze).

Notation:
    N   images in the batch (N = G*T)        G   groups of contiguous examples
    T   images per group (k per example)     H, W    input height, width
    Ho, Wo  output height, width             P = Ho*Wo  output positions per image
    kh, kw  filter size    Cin, Cout  input, output channels    s, d  strides, dilations

Identity (Rochette, Manoel, Tramel 2019, "Efficient per-example gradient computations
in convolutional neural networks", arXiv 1912.06015): a convolution is a dense layer
applied at every output position p to the patch x_p of the input that p sees,
    z_p = W^T x_p   (W as [kh*kw*Cin, Cout]),
so  grad_g(W)[u, v, c, o] = sum_{t in g, p} x_tp[u, v, c] dz_tp[o].
Four ways of computing it, all exact (each tested against the oracle):

    "shifts"     per filter tap (u, v), the input values the tap multiplies are a
                 strided slice of the padded input, x'[:, u*d : : s, v*d : : s, :]
                 ([N, Ho, Wo, Cin], no patches written), so
                     grad_g(W)[u, v] = sum_{t in g, p} x'_tp(u, v) ⊗ dz_tp,
                 one batched matmul [G, T*P, Cin]^T x [G, T*P, Cout] -> [G, Cin, Cout]
                 per tap, stacked to [G, kh*kw, Cin, Cout] (example axis first: no
                 transpose after). With thin taps (Cin < `ConvOptions.thin_channels`)
                 or few positions (P < `ConvOptions.few_positions`) those matmuls are
                 too small to run well, so the slices of the input moved channels-first
                 ([G, Cin, T, H', W']) are stacked along the contracted rows instead,
                 [G, kh*kw*Cin, T*P], and ONE matmul with dZ [G, T*P, Cout] gives
                 [G, kh*kw*Cin, Cout] in the filter's order. Grouped convolutions take
                 one contraction per tap and group. Any dtype; any oneDNN setting.
    "patches"    the patches of `tf.image.extract_patches` ([N, Ho, Wo, kh*kw*Cin],
                 ordered like the filter) and ONE batched matmul per group
                 (the unfold form of Opacus' grad_sample/conv.py and of BackPACK).
    "grouped"    the batch folded into channels: x as [T, H, W, G*Cin] and dZ as
                 [T, Ho, Wo, G*Cout] are a grouped convolution's input and output
                 gradient (G groups of Cin -> Cout), so ONE `Conv2DBackpropFilter`
                 with filter size [kh, kw, Cin, G*Cout] gives every group's gradient
                 (Rochette et al. 2019, section 3, the batch as groups).
    "depthwise"  Rochette et al.'s depthwise form: the input channels are the batch
                 and the examples the channels, x as [Cin, H', W', N] (padded), dZ as
                 the filter [Ho, Wo, N, Cout]; ONE `DepthwiseConv2dNative` with stride d
                 and dilation s gives [Cin, kh, kw, N*Cout], summed over each group's T.

Cost model ("auto"). Measured on a 2-core AVX-512 CPU (TF 2.21, float32, B = 64, SAME,
stride 1), ms per layer of the filter gradients alone on random x and dZ (variables,
results not fetched), every way in one graph timed in turn, min of 15 runs; the
machine ran other jobs (load ~9 on 2 cores), so figures vary by ~30% and more. "batch"
is the batch filter gradient (one Conv2DBackpropFilter) for scale; shifts/t is the
matmul per tap, shifts/s the stacked taps:

    oneDNN on (TF_ENABLE_ONEDNN_OPTS=1)
    H   Cin Cout k    P  | batch patches grouped shifts/t shifts/s | P*k^2/sqrt(Cin*Cout)
    32    3   32 3 1024  |   1.7   25.7     6.1     3.6      3.5   |  940
    16   32   64 3  256  |  12.1   35.4    23.9    26.3     26.0   |   51
     8   64   64 3   64  |   7.8   15.8    18.2    10.5     15.4   |    9
    32    1   16 5 1024  |   1.1   54.0     3.2     8.4      2.7   | 6400
    16    8    8 3  256  |   0.8    2.9     1.0     1.4      1.7   |  288
    16   64   64 1  256  |   2.0    3.8     6.6     2.2      2.3   |    4
     8  256  256 3   64  |  82     140     361      95      124     |    2.3
     4  128  128 3   16  |   3.9   19.7    88.8    20.0     15.7   |    1.1
     2  256  256 3    4  |   4.4   13.9   355      26.9     14.6   |    0.14
    oneDNN off (TF_ENABLE_ONEDNN_OPTS=0; "grouped" cannot run)
    32    3   32 3 1024  |   5.7   87.6      -     52.1      8.2
    16   32   64 3  256  |  13.3   25.5      -     20.0     14.8
     8   64   64 3   64  |   6.8   17.5      -     17.4     14.7
    32    1   16 5 1024  |   5.4   31.9      -      3.1      4.3
    16    8    8 3  256  |   1.7    4.2      -      1.6      2.7
    16   64   64 1  256  |   4.1    5.9      -      4.0      5.5
     8  256  256 3   64  |  70     224       -     267      176
     4  128  128 3   16  |   3.4   32.4      -     34.2     31.6
     2  256  256 3    4  |   5.1   89.3      -    120       86.3
At B = 128 (oneDNN on, min of 11) the CIFAR-net layers (rows 1-4) gave batch 3.1,
13.0, 6.4, 1.6; grouped 12.9, 20.4, 16.1, 6.2; shifts (the way "auto" takes) 6.9,
22.1, 13.6, 5.0; patches 42.5, 32.1, 17.3, 46.1.

"depthwise" was slower than "patches" in every row of an earlier run (e.g. 114 and
79 ms on the first two) and is not picked. The shifts beat the patches nearly
everywhere (`extract_patches` writes the k^2 copies slowly; slices and matmuls do
not), and the grouped backward-filter kernel beats the shifts only where it runs well
(many positions per channel pair) and the channels are not thin. So "auto" picks
"grouped" when oneDNN runs it (float32, no groups), Cin >= `thin_channels` (8) and
P*k^2/sqrt(Cin*Cout) >= `grouped_threshold` (20); else "shifts"; and "patches" when
the heights and widths are not static (the shifts' slices need them). "grouped"
needs float32 and TensorFlow's oneDNN CPU kernels (its Eigen kernels, used with
TF_ENABLE_ONEDNN_OPTS=0 and by default on CPUs without AVX-512, refuse grouped
convolutions); "depthwise" needs float32, and oneDNN for a strided convolution (its
strides become the depthwise convolution's dilations).

Squared norms (Bu, Mao, Xu 2022, "Scalable and efficient training of large
convolutional neural networks with differential privacy", arXiv 2205.10683, mixed
ghost clipping): per example, the ghost norm
    ||grad_i(W)||^2 = sum_{p,q} (x_ip·x_iq)(dz_ip·dz_iq)
costs ~2 P^2 (kh*kw*Cin + Cout) and forming the gradient ~2 P kh*kw*Cin*Cout; the rule
takes the cheaper, per layer (`Conv2DRule.norm_strategy`).

Grouped convolutions (Keras' `groups=`, a filter [kh, kw, Cin/g, Cout] on an input of
Cin channels): input channel group j feeds only the output channels
j*Cout/g ... (j+1)*Cout/g - 1 (the grouping of TensorFlow's Conv2D kernel), so the
identity holds group by group, grad_i(W)[:, :, :, group j] = sum_p x_ip[group j] ⊗
dz_ip[group j]; they take the "shifts" way (or "patches" when the sizes are not
static) and form their norms.

The clipped sum sum_i f_i grad_i(W) (DP-SGD) is the batch filter gradient
(Conv2DBackpropFilter) with example i's dZ scaled by f_i (Bu et al. 2023, arXiv
2210.00038); grouped or dilated filters form the per-example gradients instead
(TensorFlow's CPU Conv2DBackpropFilter without oneDNN refuses both).

Covered: NHWC, any strides, SAME/VALID/explicit padding, dilations, groups; the filter
static (and, for groups, the input's channels).
"""

import dataclasses
import math

import tensorflow as tf

from pertower.rules import _rows
from pertower.rules import registry as registry_lib

__all__ = ["STRATEGIES", "ConvOptions", "Conv2DRule", "patches", "check_convolution",
           "explicitly_padded", "fold_groups", "mul", "onednn_enabled", "groups",
           "plain_filter_gradient", "filter_gradient", "spatial_pads", "padded_input", "taps",
           "register"]

STRATEGIES = ("auto", "patches", "grouped", "depthwise", "shifts")


@dataclasses.dataclass(frozen=True)
class ConvOptions:
    """How `Conv2DRule` computes per-example filter gradients.

    Attributes:
      strategy: "auto" (by the cost model above), or one of "shifts", "patches",
        "grouped", "depthwise" to force that way for every convolution it covers (a
        convolution the forced way cannot compute falls back to the towers, with the
        reason).
      grouped_threshold: "auto" picks "grouped" (where it runs and Cin >=
        `thin_channels`) when P*k^2/sqrt(Cin*Cout) is at least this, else "shifts".
      onednn: whether TensorFlow's oneDNN CPU kernels (which run grouped and dilated
        depthwise convolutions) are on; None asks TensorFlow (`onednn_enabled`).
      thin_channels: below this many input channels "auto" does not pick "grouped",
        and "shifts" stacks the taps into one matmul.
      few_positions: below this many output positions per image "shifts" stacks the
        taps into one matmul (else one matmul per tap).

    Example:
      registry = pertower.rules.default_registry()
      registry.register("Conv2D", conv2d.Conv2DRule(conv2d.ConvOptions("grouped")))
      pertower.per_example_gradients(ys, xs, rules=registry)
    """

    strategy: str = "auto"
    grouped_threshold: float = 20.0
    onednn: bool = None
    thin_channels: int = 8
    few_positions: int = 64

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ValueError(f"pertower.rules.conv2d.ConvOptions: `strategy` must be one of "
                             f"{', '.join(STRATEGIES)}, but received {self.strategy!r}.")
        for name in ("thin_channels", "few_positions"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"pertower.rules.conv2d.ConvOptions: `{name}` must be an "
                                 f"int >= 0, but received {value!r}.")


def onednn_enabled():
    """Whether this process's TensorFlow runs its oneDNN CPU kernels (False when it
    does not say)."""
    try:
        # pylint: disable-next=import-outside-toplevel
        from tensorflow.python.util import _pywrap_util_port
        return bool(_pywrap_util_port.IsMklEnabled())
    except (ImportError, AttributeError):
        return False


def _attrs(op):
    """(strides, dilations, padding, explicit pairs) of a Conv2D-like op."""
    padding = op.get_attr("padding").decode()
    pairs = op.get_attr("explicit_paddings") if padding == "EXPLICIT" else None
    return list(op.get_attr("strides")), list(op.get_attr("dilations")), padding, pairs


def explicitly_padded(op):
    """(x, padding): op's input with any explicit padding applied by `tf.pad`, and the
    padding ("SAME"/"VALID") that then gives op's output positions."""
    x = op.inputs[0]
    _, _, padding, pairs = _attrs(op)
    if padding == "EXPLICIT":
        x = tf.pad(x, [pairs[0:2], pairs[2:4], pairs[4:6], pairs[6:8]])
        padding = "VALID"
    return x, padding


def patches(op, filter_height, filter_width):
    """[N, Ho, Wo, kh*kw*Cin]: the input patch each output position of `op` sees."""
    x, padding = explicitly_padded(op)
    strides, dilations, _, _ = _attrs(op)
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


def fold_groups(tensor, G):
    """[G*T, H, W, C] -> [T, H, W, G*C]: each group's images side by side in channels
    (group g's channels are g*C ... g*C + C - 1)."""
    h, w, c = (_rows.dim(tensor, axis) for axis in (1, 2, 3))
    split = tf.reshape(tensor, _rows.group_shape(G, [-1, h, w, c]))   # [G, T, H, W, C]
    moved = tf.transpose(split, [1, 2, 3, 0, 4])                       # [T, H, W, G, C]
    return tf.reshape(moved, _rows.group_shape(-1, [h, w, mul(G, c)]))  # [T, H, W, G*C]


def mul(G, c):
    """G*c, an int when G is."""
    return G * c if isinstance(G, int) else G * tf.constant(c, G.dtype)


def spatial_pads(op, kh, kw):
    """[(before, after)] for H and W such that a VALID convolution of the padded input
    with op's strides and dilations gives op's output positions exactly, cropping
    rows and columns no output position reads; None unless the spatial sizes are static."""
    strides, dilations, padding, pairs = _attrs(op)
    x_shape, z_shape = op.inputs[0].shape, op.outputs[0].shape
    sizes = [tf.compat.dimension_value(d) for d in (x_shape[1], x_shape[2], z_shape[1],
                                                   z_shape[2])]
    if any(d is None for d in sizes):
        return None
    pads = []
    for axis, (size, out, k) in enumerate([(sizes[0], sizes[2], kh), (sizes[1], sizes[3], kw)]):
        s, d = strides[axis + 1], dilations[axis + 1]
        needed = (out - 1) * s + (k - 1) * d + 1          # input extent the outputs read
        if padding == "EXPLICIT":
            before = pairs[2 * (axis + 1)]
        elif padding == "SAME":
            before = max(needed - size, 0) // 2
        else:
            before = 0
        pads.append((before, needed - size - before))     # after < 0: crop
    return pads


def padded_input(op, kh, kw):
    """[N, H', W', C]: op's input padded (and cropped) by `spatial_pads`, so that a
    VALID convolution of it with op's strides and dilations gives op's output positions
    and reads every row and column; needs static spatial sizes."""
    (top, bottom), (left, right) = spatial_pads(op, kh, kw)
    x = op.inputs[0]
    x = tf.pad(x, [[0, 0], [max(top, 0), max(bottom, 0)], [max(left, 0), max(right, 0)],
                   [0, 0]])
    height, width = _rows.static_dims(x)[1:3]             # ints in both shape modes
    return x[:, :height + min(bottom, 0), :width + min(right, 0), :]


def taps(op, kh, kw, tensor=None, axes=(1, 2)):
    """[[..., Ho, Wo, ...]] for every filter tap (u, v), u-major: the input values each
    output position of `op` multiplies by the filter's tap (u, v), a strided slice of
    `padded_input` (rows u*d, u*d + s, ..., columns likewise; no copy of the patches).

    Args:
      op: the Conv2D or DepthwiseConv2dNative op (static spatial sizes).
      kh, kw: the filter's height and width.
      tensor: `padded_input(op, kh, kw)` (default) or a transpose of it whose height
        and width are the axes `axes`.
      axes: the height and width axes of `tensor`.
    """
    strides, dilations, _, _ = _attrs(op)
    if tensor is None:
        tensor = padded_input(op, kh, kw)             # [N, H', W', C]
    out_h, out_w = (tf.compat.dimension_value(d) for d in op.outputs[0].shape[1:3])
    result = []
    for u in range(kh):
        for v in range(kw):
            index = [slice(None)] * tensor.shape.rank
            top, left = u * dilations[1], v * dilations[2]
            index[axes[0]] = slice(top, top + (out_h - 1) * strides[1] + 1, strides[1])
            index[axes[1]] = slice(left, left + (out_w - 1) * strides[2] + 1, strides[2])
            result.append(tensor[tuple(index)])
    return result                                     # kh*kw x [..., Ho, Wo, ...]


class Conv2DRule(registry_lib.Rule):
    """Per-example filter gradients of Conv2D, by the way `options` says.

    Args:
      options: a `ConvOptions` (default: strategy "auto").
    """

    def __init__(self, options=None):
        if options is None:
            options = ConvOptions()
        if not isinstance(options, ConvOptions):
            raise TypeError("pertower.rules.conv2d.Conv2DRule: `options` must be a "
                            f"ConvOptions, but received {options!r}.")
        self.options = options

    def match(self, op, slot, analysis):
        rows = check_convolution(op, slot, analysis)
        if isinstance(rows, str):
            return rows
        use = registry_lib.Use(op, slot, self, op.inputs[0], op.outputs[0],
                               op.inputs[1].shape, rows)
        if self.options.strategy != "auto":
            missing = self._cannot(self.options.strategy, use)
            if missing:
                return f"the forced strategy {self.options.strategy!r} {missing}"
        return use

    def _cannot(self, strategy, use):
        """Why `strategy` cannot compute `use` (a phrase), or None when it can."""
        if strategy == "patches":
            return None
        if strategy == "shifts":
            if spatial_pads(use.op, 1, 1) is None:
                return "needs static input and output heights and widths"
            return None
        if groups(use.op) != 1:
            return f"does not take grouped convolutions (groups={groups(use.op)})"
        if use.op.inputs[0].dtype != tf.float32:
            return (f"needs float32 (TensorFlow has no CPU kernel for it in "
                    f"{use.op.inputs[0].dtype.name})")
        onednn = self.options.onednn
        if onednn is None:
            onednn = onednn_enabled()
        if strategy == "grouped" and not onednn:
            return ("needs TensorFlow's oneDNN CPU kernels (its other CPU kernels refuse "
                    "grouped convolutions)")
        if strategy == "depthwise":
            if spatial_pads(use.op, 1, 1) is None:
                return "needs static input and output heights and widths"
            if not onednn and _attrs(use.op)[0] != [1, 1, 1, 1]:
                return ("needs TensorFlow's oneDNN CPU kernels for a strided convolution "
                        "(its other CPU kernels refuse dilated depthwise convolutions)")
        return None

    def strategy(self, use):
        """The way `per_group` computes `use`: "shifts", "grouped", "patches" or
        "depthwise" (the cost model in the module docstring)."""
        if self.options.strategy != "auto":
            return self.options.strategy
        kh, kw, c_in, c_out = use.weight_shape.as_list()
        positions = _rows.static_size(use.output.shape[1:3])
        if positions is None or self._cannot("shifts", use):
            return "patches"      # shifts need static heights and widths, and so do these
        if not self._cannot("grouped", use) and c_in >= self.options.thin_channels:
            ratio = positions * kh * kw / math.sqrt(c_in * c_out)
            if ratio >= self.options.grouped_threshold:
                return "grouped"
        return "shifts"

    def _stacks_taps(self, use):
        """Whether "shifts" stacks the taps into one matmul (thin input channels or few
        positions) rather than running one matmul per tap."""
        c_in = use.weight_shape.as_list()[2]
        positions = _rows.static_size(use.output.shape[1:3])
        return groups(use.op) == 1 and (c_in < self.options.thin_channels or
                                        positions < self.options.few_positions)

    def per_group(self, use, dZ, G):
        strategy = self.strategy(use)
        if strategy == "grouped":
            return self._grouped(use, dZ, G)
        if strategy == "depthwise":
            return self._depthwise(use, dZ, G)
        if strategy == "shifts":
            return self._shifts(use, dZ, G)
        return self._patches(use, dZ, G)

    @staticmethod
    def _patches(use, dZ, G):
        kh, kw, c_in, c_out = use.weight_shape.as_list()
        g = groups(use.op)
        x_patches = _rows.to_groups(patches(use.op, kh, kw), G, 1)  # [G, T*Ho*Wo, kh*kw*g*Cin]
        dZ_g = _rows.to_groups(dZ, G, 1)                           # [G, T*Ho*Wo, Cout]
        if g == 1:
            grad = tf.matmul(x_patches, dZ_g, transpose_a=True)    # [G, kh*kw*Cin, Cout]
            return tf.reshape(grad, _rows.group_shape(G, [kh, kw, c_in, c_out]))
        # the patches' channels (kh, kw, g*Cin) and the outputs by group:
        # [G, P, kh*kw*g*Cin] -> [G, P, kh*kw, g, Cin]; [G, P, Cout] -> [G, P, g, Cout/g]
        x_patches = tf.reshape(x_patches, tf.concat(
            [tf.shape(x_patches)[:2], [kh * kw, g, c_in]], axis=0))
        dZ_g = tf.reshape(dZ_g, tf.concat([tf.shape(dZ_g)[:2], [g, c_out // g]], axis=0))
        grad = tf.einsum("gpkjc,gpjo->gkcjo", x_patches, dZ_g)    # [G, kh*kw, Cin, g, Cout/g]
        return tf.reshape(grad, _rows.group_shape(G, [kh, kw, c_in, c_out]))

    def _shifts(self, use, dZ, G):
        kh, kw, c_in, c_out = use.weight_shape.as_list()
        g = groups(use.op)
        dZ_g = _rows.to_groups(dZ, G, 1)                          # [G, T*Ho*Wo, Cout]
        if self._stacks_taps(use):
            # thin or short taps: one matmul over the taps stacked along the contracted rows
            x = padded_input(use.op, kh, kw)                      # [G*T, H', W', Cin]
            height, width = x.shape.as_list()[1:3]
            x = tf.reshape(x, _rows.group_shape(G, [-1, height, width, c_in]))
            x = tf.transpose(x, [0, 4, 1, 2, 3])                  # [G, Cin, T, H', W']
            rows = tf.concat(taps(use.op, kh, kw, x, axes=(3, 4)), axis=1)
            rows = tf.reshape(rows, _rows.group_shape(G, [kh * kw * c_in, -1]))
            grad = tf.matmul(rows, dZ_g)                          # [G, kh*kw*Cin, Cout]
            return tf.reshape(grad, _rows.group_shape(G, [kh, kw, c_in, c_out]))
        if g > 1:
            dZ_g = tf.reshape(dZ_g, tf.concat([tf.shape(dZ_g)[:2], [g, c_out // g]], 0))
        per_tap = []                                              # kh*kw x [G, Cin, Cout]
        for x_tap in taps(use.op, kh, kw):                        # [G*T, Ho, Wo, g*Cin]
            x_g = _rows.to_groups(x_tap, G, 1)                    # [G, T*Ho*Wo, g*Cin]
            if g == 1:
                per_tap.append(tf.matmul(x_g, dZ_g, transpose_a=True))
                continue
            x_g = tf.reshape(x_g, tf.concat([tf.shape(x_g)[:2], [g, c_in]], 0))
            tap = tf.einsum("gpjc,gpjo->gcjo", x_g, dZ_g)         # [G, Cin, g, Cout/g]
            per_tap.append(tf.reshape(tap, _rows.group_shape(G, [c_in, c_out])))
        grad = tf.stack(per_tap, axis=1)                          # [G, kh*kw, Cin, Cout]
        return tf.reshape(grad, _rows.group_shape(G, [kh, kw, c_in, c_out]))

    @staticmethod
    def _grouped(use, dZ, G):
        kh, kw, c_in, c_out = use.weight_shape.as_list()
        strides, dilations, _, _ = _attrs(use.op)
        x, padding = explicitly_padded(use.op)
        filter_sizes = _rows.group_shape(kh, [kw, c_in, mul(G, c_out)])
        grad = tf.raw_ops.Conv2DBackpropFilter(
            input=fold_groups(x, G),                  # [T, H, W, G*Cin]
            filter_sizes=filter_sizes,
            out_backprop=fold_groups(dZ, G),          # [T, Ho, Wo, G*Cout]
            strides=strides, padding=padding, dilations=dilations,
            data_format="NHWC")                       # [kh, kw, Cin, G*Cout]
        grad = tf.reshape(grad, _rows.group_shape(kh, [kw, c_in, G, c_out]))
        return tf.transpose(grad, [3, 0, 1, 2, 4])    # [G, kh, kw, Cin, Cout]

    @staticmethod
    def _depthwise(use, dZ, G):
        kh, kw, c_in, c_out = use.weight_shape.as_list()
        strides, dilations, _, _ = _attrs(use.op)
        x = padded_input(use.op, kh, kw)              # [N, H', W', Cin]
        per_image = tf.raw_ops.DepthwiseConv2dNative(
            input=tf.transpose(x, [3, 1, 2, 0]),      # [Cin, H', W', N]
            filter=tf.transpose(dZ, [1, 2, 0, 3]),    # [Ho, Wo, N, Cout]
            strides=[1, dilations[1], dilations[2], 1], padding="VALID",
            dilations=[1, strides[1], strides[2], 1])  # [Cin, kh, kw, N*Cout]
        per_image = tf.reshape(per_image, [c_in, kh, kw, -1, c_out])  # [Cin, kh, kw, N, Cout]
        per_image = tf.transpose(per_image, [3, 1, 2, 0, 4])         # [N, kh, kw, Cin, Cout]
        grouped = tf.reshape(per_image, _rows.group_shape(G, [-1, kh, kw, c_in, c_out]))
        return tf.reduce_sum(grouped, axis=1)         # [G, kh, kw, Cin, Cout]

    def norm_strategy(self, use):
        """"ghost" or "formed": the cheaper way to the squared norms of `use`'s
        per-example gradients (Bu et al. 2022, mixed ghost clipping), or "formed" when
        the positions are not static."""
        kh, kw, c_in, c_out = use.weight_shape.as_list()
        positions = _rows.static_size(use.output.shape[1:3])
        if positions is None or groups(use.op) != 1:
            return "formed"
        return ("ghost" if _rows.ghost_norm_is_cheaper(use.rows.k * positions,
                                                       kh * kw * c_in, c_out)
                else "formed")

    def squared_norms(self, use, dZ, B):
        # None when forming is cheaper: the engine then forms the per-example gradients
        # itself and keeps them, so that a clipped sum contracts them with the factors
        # instead of running a second (reweighted) filter gradient
        if self.norm_strategy(use) != "ghost":
            return None
        kh, kw = use.weight_shape.as_list()[:2]
        positions = _rows.static_size(use.output.shape[1:3])
        return _rows.dense_squared_norms(patches(use.op, kh, kw), dZ, B,
                                         use.rows.k * positions)

    def clipped_sum(self, use, dZ, factors):
        # sum_i f_i grad_i(W): the filter gradient of the batch with dZ scaled per example
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


def register(registry, options=None):
    """Adds the Conv2D rule to `registry` (with `options`, a `ConvOptions`)."""
    registry.register("Conv2D", Conv2DRule(options))

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
Three ways of computing it, all exact (each tested against the oracle):

    "shifts"     per filter tap (u, v), the input values the tap multiplies are a
                 strided slice of the padded input, x'[:, u*d : : s, v*d : : s, :]
                 ([N, Ho, Wo, Cin], no patches written), so
                     grad_g(W)[u, v] = sum_{t in g, p} x'_tp(u, v) ⊗ dz_tp,
                 one batched matmul [G, T*P, Cin]^T x [G, T*P, Cout] -> [G, Cin, Cout]
                 per tap, stacked to [G, kh*kw, Cin, Cout]. Laid out by
                 `_convolution.ways.tap_layout`: a 1x1 filter is ONE matmul of the
                 (strided) input; with few positions (P < `ConvOptions.few_positions`)
                 or T*P < Cout the taps go side by side in channels, [G, T*P,
                 kh*kw*Cin] (the patches, ONE ExtractImagePatches), and ONE matmul writes
                 [G, kh*kw*Cin, Cout]; with thin taps (Cin < `ConvOptions.thin_channels`)
                 the input moves channels-first and the taps stack along the contracted
                 rows (`_convolution.taps`). Grouped convolutions take one contraction per
                 tap and group. Any dtype; any oneDNN setting.
    "patches"    the patches of `tf.image.extract_patches` ([N, Ho, Wo, kh*kw*Cin],
                 ordered like the filter) and ONE batched matmul per group
                 (the unfold form of Opacus' grad_sample/conv.py and of BackPACK).
    "grouped"    the batch folded into channels: x as [T, H, W, G*Cin] and dZ as
                 [T, Ho, Wo, G*Cout] are a grouped convolution's input and output
                 gradient (G groups of Cin -> Cout), so ONE `Conv2DBackpropFilter`
                 with filter size [kh, kw, Cin, G*Cout] gives every group's gradient
                 (Rochette et al. 2019, section 3, the batch as groups). Needs float32
                 and TensorFlow's oneDNN CPU kernels (its Eigen kernels, used with
                 TF_ENABLE_ONEDNN_OPTS=0 and by default on CPUs without AVX-512, refuse
                 grouped convolutions).

The strategy value "depthwise" (a way removed: Rochette et al.'s input channels as the
batch, one DepthwiseConv2dNative, slower than "patches" on every shape measured) means
"grouped".

The choice ("auto"), from the shapes. The shifts and the patches write, per example,
the input values the taps multiply, T*P*kh*kw*Cin numbers, and contract them with dZ;
the grouped backward-filter kernel reads the input in place and writes the result,
kh*kw*Cin*Cout numbers per example. So "auto" takes "grouped" where the kernel runs,
the filter has more than one tap (a 1x1 filter is one matmul of the input as it is),
the taps are not thin (Cin >= `thin_channels`) and the taps written would be at least
the result written, T*P >= Cout; else "shifts"; and "patches" where the heights and
widths are not static (the shifts' slices need them). A filter larger than its map takes
its live taps only (`_convolution.live_taps`: the taps that read only padding have zero
gradient). The sweep behind this rule, with oneDNN on and off, is in docs/conv_ways.md
(benchmarks/conv_ways.py).

oneDNN. With TF_ENABLE_ONEDNN_OPTS=1 forced on a 2-core AVX2 CPU (TF 2.21),
TensorFlow's own float32 Conv2DBackpropFilter of an ungrouped 1x1 convolution with
stride 2 on an even-sized input (8x8; 16x16) is wrong against float64 numpy on every
run for thin channels: relative errors 0.2-1.1 for Cin = 1..5 at 8x8 and 5..7 at
16x16 (Cout 4 or 16), while every other shape of a grid of 729 (1x1 to 3x3 filters,
strides 1-3, 1-12 input channels, 1, 2 or 4 groups, 8x8 to 16x16) and of 192 larger
ones (Cin 8-64, 16x16 and 32x32) was right, grouped kernels included. Its
DepthwiseConv2dNativeBackpropFilter is wrong likewise for a 1x1 stride-2 filter on one
channel at 8x8 (4 of 192 shapes; `depthwise_conv2d` takes the same care). "auto" never
picks "grouped" for such thin channels; with one group (B = 1, or a clipped sum) the
"grouped" way and the clipped sum would be that kernel itself, so for 1x1 filters with
strides under oneDNN (`untrusted_filter_gradient`) they take the shifts (one matmul of
a strided slice, exact) instead, and so does a forced "grouped" unless the number of
groups is a static int > 1.

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
static (and, for groups, the input's channels). NCHW and the blocks of a SpaceToBatchND
(a dilated convolution as TensorFlow builds it without oneDNN) through `_conv_views`:
the same ways on A and dZ re-laid-out to NHWC with example-major rows.
"""

import dataclasses

import tensorflow as tf

from pertower import _context
from pertower._convolution import grouped as _conv_grouped
from pertower._convolution import live_taps as _live_taps
from pertower._convolution import options as _conv_options
from pertower._convolution import norms as _conv_norms
from pertower._convolution import views as _conv_views
from pertower._convolution import ways as _conv_ways
from pertower._convolution import squares as conv2d_squares
from pertower.rules import depthwise_conv2d
from pertower._layout import _rows
from pertower.rules import registry as registry_lib
from pertower._convolution.geometry import (
    check_convolution, filter_gradient, groups, patches, plain_filter_gradient,
    spatial_pads)

__all__ = ["STRATEGIES", "ConvOptions", "Conv2DRule", "onednn_enabled",
           "untrusted_filter_gradient", "register"]

# the options live in `_conv_options` (the depthwise rule reads them too); public here
STRATEGIES = _conv_options.STRATEGIES
ConvOptions = _conv_options.ConvOptions
onednn_enabled = _conv_options.onednn_enabled
untrusted_filter_gradient = _conv_options.untrusted_filter_gradient

class Conv2DRule(registry_lib.Rule):
    """Per-example filter gradients of Conv2D, by the way `options` says.

    Args:
      options: a `ConvOptions` (default: strategy "auto").
    """

    @_context.public("rules.conv2d.Conv2DRule")
    def __init__(self, options=None):
        if options is None:
            options = ConvOptions()
        if not isinstance(options, ConvOptions):
            raise _context.error(TypeError, "`options` must be a ConvOptions, but received "
                                            f"{options!r}.")
        self.options = options
        self._depthwise_rule = None

    def _depthwise(self):
        """The depthwise rule (same options) that computes a Conv2D with one input
        channel per group (`_conv_grouped`)."""
        if self._depthwise_rule is None:
            self._depthwise_rule = depthwise_conv2d.DepthwiseConv2DRule(self.options)
        return self._depthwise_rule

    def match(self, op, slot, analysis):
        view = _conv_views.view_use(self, op, slot, analysis)   # NCHW, SpaceToBatchND blocks
        if view is not None:
            return view
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
        if groups(use.op) != 1:      # "grouped" (and "depthwise", which means it)
            return f"does not take grouped convolutions (groups={groups(use.op)})"
        if use.op.inputs[0].dtype != tf.float32:
            return (f"needs float32 (TensorFlow has no CPU kernel for it in "
                    f"{use.op.inputs[0].dtype.name})")
        if not _conv_options.onednn_runs(self.options):
            return ("needs TensorFlow's oneDNN CPU kernels (its other CPU kernels refuse "
                    "grouped convolutions)")
        return None

    def strategy(self, use):
        """The way `per_group` computes `use`: "shifts", "grouped" or "patches" (the
        rule in the module docstring; a forced "depthwise" means "grouped")."""
        if self.options.strategy != "auto":
            return {"depthwise": "grouped"}.get(self.options.strategy, self.options.strategy)
        kh, kw, c_in, c_out = use.weight_shape.as_list()
        positions = _rows.static_size(use.output.shape[1:3])
        if positions is None or self._cannot("shifts", use):
            return "patches"      # shifts need static heights and widths, and so do these
        rows = positions * (use.rows.k if use.rows is not None and
                            isinstance(use.rows.k, int) else 1)          # T*P per example
        if (kh * kw > 1 and c_in >= self.options.thin_channels and rows >= c_out and
                not self._cannot("grouped", use)):
            return "grouped"
        return "shifts"

    def untrusted_filter_gradient(self, use):
        """Whether TensorFlow's own Conv2DBackpropFilter is not used for `use`
        (`untrusted_filter_gradient`)."""
        return untrusted_filter_gradient(use, self.options)

    def per_group(self, use, dZ, G):
        if isinstance(use, _conv_views.ViewUse):   # the NHWC ways on a re-laid-out copy
            return self.per_group(*use.view.inner(use, dZ), G)
        if _conv_grouped.depthwise_like(use.op):   # g = C groups: the depthwise rule's ways
            depthwise = self._depthwise()
            return _conv_grouped.to_grouped(
                depthwise.per_group(_conv_grouped.as_depthwise(use, depthwise), dZ, G),
                use, [G])
        live = _live_taps.per_group_of_live_taps(self.per_group, use, dZ, G)
        if live is not None:      # a filter larger than its map: the live taps only
            return live
        strategy = self.strategy(use)
        if (strategy == "grouped" and not (isinstance(G, int) and G > 1) and
                self.untrusted_filter_gradient(use)):
            strategy = "shifts"   # (one group, or maybe one: TensorFlow's own kernel)
        if strategy == "grouped":
            return _conv_ways.by_grouped(use, dZ, G)
        if strategy == "shifts":
            return _conv_ways.by_shifts(self.options, use, dZ, G)
        return _conv_ways.by_patches(use, dZ, G)

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
        if isinstance(use, _conv_views.ViewUse):
            return self.squared_norms(*use.view.inner(use, dZ), B)
        # None when forming is cheaper: the engine forms and keeps the per-example gradients
        # (a clipped sum contracts them, no second reweighted filter gradient)
        if self.norm_strategy(use) != "ghost":
            return None
        kh, kw = use.weight_shape.as_list()[:2]
        positions = _rows.static_size(use.output.shape[1:3])
        return _rows.dense_squared_norms(patches(use.op, kh, kw), dZ, B, use.rows.k * positions)

    def formed_norms(self, use, dZ, G):
        """Where the norms are formed ("formed" by `norm_strategy`): the per-group
        gradients in the filter's order, [G, kh*kw*Cin, Cout], from the taps of the
        channels-first input (`_conv_norms.formed_norms`: one batched matmul, or with a
        static G and oneDNN off, tap rows in chunks of whole groups and a MatMul per
        group up to `_conv_norms.FEW_GROUPS`), and their squared norms (a
        `registry.FormedNorms`); None elsewhere (the engine forms `per_group`), and where
        `strategy` picks "grouped" (one grouped backward-filter op forms them)."""
        if isinstance(use, _conv_views.ViewUse):
            return self.formed_norms(*use.view.inner(use, dZ), G)
        if self.norm_strategy(use) != "formed" or self.strategy(use) == "grouped":
            return None
        return _conv_norms.formed_norms(self.options, use, dZ, G)

    def sum_squared(self, use, dZ_columns, B, per_example=False):
        if not isinstance(use, _conv_views.ViewUse) and _conv_grouped.depthwise_like(use.op):
            depthwise = self._depthwise()
            out = depthwise.sum_squared(_conv_grouped.as_depthwise(use, depthwise),
                                        dZ_columns, B, per_example)
            return (None if out is None else
                    _conv_grouped.to_grouped(out, use, [B] if per_example else []))
        # the wide filter (C*Cout outputs): every tap in one matmul (`conv2d_squares`)
        rule = (Conv2DRule(dataclasses.replace(self.options, few_positions=2 ** 31))
                if self.options.strategy == "auto" else self)
        return conv2d_squares.sum_squared(rule, use, dZ_columns, B, per_example)

    def sum_squared_size(self, use, C, per_example=False):
        return conv2d_squares.formed_size(use, C, per_example)

    def clipped_sum(self, use, dZ, factors):
        # sum_i f_i grad_i(W): the filter gradient of the batch with dZ scaled per example
        if isinstance(use, _conv_views.ViewUse):
            return self.clipped_sum(*use.view.inner(use, dZ), factors)
        if _conv_grouped.depthwise_like(use.op):
            depthwise = self._depthwise()
            return _conv_grouped.to_grouped(depthwise.clipped_sum(
                _conv_grouped.as_depthwise(use, depthwise), dZ, factors), use, [])
        if not plain_filter_gradient(use.op):
            return registry_lib.default_clipped_sum(self, use, dZ, factors)
        if self.untrusted_filter_gradient(use):   # one group of "shifts": one matmul
            return registry_lib.batch_gradient_clipped_sum(self, use, dZ, factors)
        return filter_gradient(tf.raw_ops.Conv2DBackpropFilter, use,
                               _rows.scale_rows(dZ, factors))


def register(registry, options=None):
    """Adds the Conv2D rule to `registry` (with `options`, a `ConvOptions`)."""
    registry.register("Conv2D", Conv2DRule(options))

"""Rule for Conv2D (and Conv1D, which lowers to it), and the one N-dimensional
convolution rule that Conv2D, Conv3D, DepthwiseConv2dNative and the transposed
convolutions register (`ConvolutionRule`, `TransposedRule`).

Notation: N = G*T images (G groups of T, k per example), P output positions per image,
K = prod(kernel) filter taps, Cin, Cout channels, s, d strides and dilations, g groups.

Identity (Rochette, Manoel, Tramel 2019, arXiv 1912.06015): a convolution is a dense
layer applied at every output position p to the patch x_p it sees, z_p = W^T x_p
(W as [K*Cin, Cout]), so
    grad_g(W)[u, c, o] = sum_{t in g, p} x_tp[u, c] dz_tp[o]   (u a filter tap).
Channel groups: input group j feeds only output group j, so it holds group by group.
Its ways (`_convolution.ways`), all exact:

    "shifts"   per tap u, the strided slice x'[:, u*d : : s, ..., :] of the padded input
               and one batched matmul [G, T*P, Cin]^T x [G, T*P, Cout] (`ways.tap_layout`).
    "patches"  the patches [N, Ho, Wo, K*Cin] and ONE batched matmul (Opacus, BackPACK).
    "grouped"  (2-D) x as [T, H, W, G*Cin] and dZ as [T, Ho, Wo, G*Cout] are a grouped
               convolution's input and output gradient: ONE Conv2DBackpropFilter of size
               [kh, kw, Cin, G*Cout] (Rochette et al., section 3); float32 and oneDNN
               only (Eigen refuses grouped convolutions).
    "examples" the one-example loop in the graph (`ways.by_examples`).

"auto": "grouped" where it runs, K > 1, Cin >= `thin_channels` and T*P >= Cout (it reads
the input in place; the shifts and patches write T*P*K*Cin numbers per example); else
"examples" where `ways.per_example_calls_pay`; else "shifts"; "patches" where the spatial
sizes are not static (docs/conv_ways.md). A filter larger than its map takes its live
taps only (`geometry.live_range`). NCHW, SpaceToBatchND blocks and a Conv2D with one
input channel per group are computed as another convolution (`_convolution.views`).

oneDNN (TF 2.21): the float32 Conv2DBackpropFilter of an ungrouped 1x1 stride-2
convolution on an 8x8 or 16x16 input is wrong for Cin 1..7 (its depthwise kernel for one
channel), so one group of such filters takes the shifts (`untrusted_filter_gradient`).

Squared norms: the ghost norm sum_{p,q} (x_ip·x_iq)(dz_ip·dz_iq) (Bu, Mao, Xu 2022,
arXiv 2205.10683), ~2 P^2 (K*Cin + Cout), or the formed gradient, ~2 P K*Cin*Cout: the
cheaper per Conv2D (`norm_strategy`). The clipped sum sum_i f_i grad_i(W) is the batch
filter gradient of dZ with example i's rows scaled by f_i (Bu et al. 2023, arXiv
2210.00038); grouped or dilated filters form the per-example gradients.

Covered: channels last, NCHW, any strides, SAME/VALID/explicit padding, dilations,
groups; the filter static (for groups, the input's channels; in 3-D all but the batch).
"""

import dataclasses
import math

import tensorflow as tf

from pertower import _context
from pertower._convolution import norms as _conv_norms
from pertower._convolution import squares as _conv_squares
from pertower._convolution import views as _conv_views
from pertower._convolution import ways as _conv_ways
from pertower._convolution.options import (  # (public here: `rules.conv2d.ConvOptions`)
    STRATEGIES, ConvOptions, onednn_enabled, onednn_runs, untrusted_filter_gradient)
from pertower._convolution.geometry import (
    attributes, filter_gradient, groups, patches, per_group_of_live_taps,
    spatial_pads)
from pertower._layout import _rows
from pertower.rules import registry as registry_lib

__all__ = ["STRATEGIES", "ConvOptions", "ConvolutionRule", "Conv2DRule", "TransposedRule",
           "ViewUse", "onednn_enabled", "untrusted_filter_gradient", "register"]


@dataclasses.dataclass(frozen=True)
class ViewUse(registry_lib.Use):
    """A `Use` that its rule computes through `view` (`_convolution.views`); `rows` are
    those of the re-laid-out (example-major) A."""

    view: object = None

    def inner(self, dZ):
        """(the `Use` of the view's channels-last convolution, its dZ)."""
        op, dZ = self.view.inner(self, dZ)
        return registry_lib.Use(op, 1, self.rule, op.inputs[0], op.outputs[0],
                                self.weight_shape, self.rows), dZ


def _depthwise(op):
    return op.type == "DepthwiseConv2dNative"


class ConvolutionRule(registry_lib.Rule):
    """Per-example filter gradients of Conv2D, Conv3D or DepthwiseConv2dNative, by the
    way `options` (a `ConvOptions`, default "auto") says."""

    def __init__(self, options=None):
        if options is None:
            options = ConvOptions()
        if not isinstance(options, ConvOptions):
            raise _context.error(TypeError, "`options` must be a ConvOptions, but received "
                                            f"{options!r}.")
        self.options = options

    def match(self, op, slot, analysis):
        if op.type == "Conv3D" and (op.inputs[0].shape.rank != 5 or not (
                op.inputs[0].shape[1:].is_fully_defined() and
                op.outputs[0].shape[1:4].is_fully_defined())):
            return "the input's and output's depths, heights, widths and channels are not static"
        if slot != 1:
            return "the weight is the convolution's input, not its filter"
        if not op.inputs[1].shape.is_fully_defined():
            return "the filter's shape is not static"
        view = _conv_views.view_of(op, analysis)   # NCHW, SpaceToBatchND blocks
        if view is not None:
            return view if isinstance(view, str) else ViewUse(
                op, slot, self, op.inputs[0], op.outputs[0], op.inputs[1].shape, view[1],
                view=view[0])
        if op.get_attr("data_format") not in (b"NHWC", b"NDHWC"):
            return (f"data_format {op.get_attr('data_format').decode()} (only channels last, "
                    "NHWC or NDHWC, is covered)")
        if groups(op) is None:
            return (f"the filter's {op.inputs[1].shape[-2]} input channels do not divide "
                    f"the input's channels ({op.inputs[0].shape[-1]}) into groups")
        rows = _rows.example_rows(analysis, op.inputs[0], op.outputs[0])
        if isinstance(rows, str):
            return rows
        use = registry_lib.Use(op, slot, self, op.inputs[0], op.outputs[0],
                               op.inputs[1].shape, rows)
        strategy = self.options.strategy
        if _depthwise(op):
            if strategy in ("grouped", "depthwise") and not self._depthwise_grouped_runs(op):
                return f"the forced strategy {strategy!r} needs float32 and no dilation"
        elif strategy != "auto":
            missing = self._cannot(strategy, use)
            if missing:
                return f"the forced strategy {strategy!r} {missing}"
        return use

    @staticmethod
    def _depthwise_grouped_runs(op):
        # (TensorFlow's depthwise kernels: equal row and column strides, float32, no dilation)
        strides = list(op.get_attr("strides"))
        return (op.inputs[0].dtype == tf.float32 and strides[1] == strides[2] and
                list(op.get_attr("dilations")) == [1, 1, 1, 1])

    def _cannot(self, strategy, use):
        """Why `strategy` cannot compute `use` (a phrase), or None when it can."""
        kernel = use.weight_shape.as_list()[:-2]
        if strategy == "patches":
            return None
        if strategy == "shifts":
            if spatial_pads(use.op, *[1] * len(kernel)) is None:
                return "needs static input and output heights and widths"
            return None
        if groups(use.op) != 1:      # "grouped" (and "depthwise", which means it), "examples"
            return f"does not take grouped convolutions (groups={groups(use.op)})"
        if strategy == "examples":
            return None
        if len(kernel) != 2:
            return "does not take 3-D convolutions"
        if use.op.inputs[0].dtype != tf.float32:
            return (f"needs float32 (TensorFlow has no CPU kernel for it in "
                    f"{use.op.inputs[0].dtype.name})")
        if not onednn_runs(self.options):
            return ("needs TensorFlow's oneDNN CPU kernels (its other CPU kernels refuse "
                    "grouped convolutions)")
        return None

    def strategy(self, use, G=None):
        """The way `per_group` computes `use` (the module docstring): "shifts", "grouped",
        "examples" or "patches"; depthwise: "grouped", "examples" or "patches" for `G`
        groups. A forced way is kept ("auto" alone asks `ways.per_example_calls_pay`)."""
        forced = self.options.strategy
        if forced == "examples":
            return "examples"
        if _depthwise(use.op):
            if forced in ("patches", "shifts") or not self._depthwise_grouped_runs(use.op):
                return "patches"
            if (not (isinstance(G, int) and G > 1) and
                    untrusted_filter_gradient(use, self.options)):
                return "patches"
            if forced == "auto" and _conv_ways.per_example_calls_pay(use, self.options):
                return "examples"
            return "grouped"
        if forced != "auto":
            return {"depthwise": "grouped"}.get(forced, forced)
        shape = use.weight_shape.as_list()
        rows = _conv_ways.positions_per_example(use)                     # T*P per example
        if rows is None or self._cannot("shifts", use):
            return "patches"      # shifts need static spatial sizes, and so do these
        if (math.prod(shape[:-2]) > 1 and
                shape[-2] >= self.options.thin_channels and rows >= shape[-1] and
                not self._cannot("grouped", use)):
            return "grouped"
        return "examples" if _conv_ways.per_example_calls_pay(use, self.options) else "shifts"

    def per_group(self, use, dZ, G):
        if isinstance(use, ViewUse):   # the channels-last ways on a re-laid-out copy
            return self.per_group(*use.inner(dZ), G)
        if _conv_views.depthwise_like(use.op):   # g = C groups: the depthwise ways
            return _conv_views.to_grouped(
                self.per_group(_conv_views.as_depthwise(use), dZ, G), use, [G])
        live = per_group_of_live_taps(self.per_group, use, dZ, G)
        if live is not None:      # a filter larger than its map: the live taps only
            return live
        strategy = self.strategy(use, G)
        if (strategy == "grouped" and not _depthwise(use.op) and
                not (isinstance(G, int) and G > 1) and
                untrusted_filter_gradient(use, self.options)):
            strategy = "shifts"   # (one group, or maybe one: TensorFlow's own kernel)
        if strategy == "examples" and untrusted_filter_gradient(use, self.options):
            strategy = "patches" if _depthwise(use.op) else "shifts"
        if strategy == "examples":
            return _conv_ways.by_examples(use, dZ, G)
        if strategy == "grouped":
            return _conv_ways.by_grouped(self.options, use, dZ, G)
        if strategy == "shifts":
            return _conv_ways.by_shifts(self.options, use, dZ, G)
        return _conv_ways.by_patches(use, dZ, G)

    def norm_strategy(self, use):
        """"ghost" or "formed", the cheaper way to `use`'s squared norms (the module
        docstring); "formed" unless an ungrouped Conv2D of static positions and k (in a
        loop without static maximum_iterations, k*T is not)."""
        positions = use.output.shape[1:-1].num_elements()
        if (positions is None or use.rows.k is None or use.op.type != "Conv2D"
                or groups(use.op) != 1):
            return "formed"
        kh, kw, c_in, c_out = use.weight_shape.as_list()
        return ("ghost" if _rows.ghost_norm_is_cheaper(use.rows.k * positions,
                                                       kh * kw * c_in, c_out)
                else "formed")

    def squared_norms(self, use, dZ, B):
        if isinstance(use, ViewUse):
            return self.squared_norms(*use.inner(dZ), B)
        # None where forming is cheaper: the engine forms and keeps them
        if self.norm_strategy(use) != "ghost":
            return None
        kh, kw = use.weight_shape.as_list()[:2]
        positions = use.output.shape[1:3].num_elements()
        return _rows.dense_squared_norms(patches(use.op, kh, kw), dZ, B, use.rows.k * positions)

    def formed_norms(self, use, dZ, G):
        """A `registry.FormedNorms` of a Conv2D's per-group gradients [G, kh*kw*Cin, Cout]
        (`_convolution.norms`) where `norm_strategy` forms them and `strategy` is not
        "grouped"; else None (the engine forms `per_group`)."""
        if isinstance(use, ViewUse):
            return self.formed_norms(*use.inner(dZ), G)
        if (use.op.type != "Conv2D" or self.norm_strategy(use) != "formed" or
                self.strategy(use) == "grouped"):
            return None
        formed = _conv_norms.formed_norms(self.options, use, dZ, G)
        return None if formed is None else registry_lib.FormedNorms(*formed)

    def sum_squared(self, use, dZ_columns, B, per_example=False):
        if not isinstance(use, ViewUse) and _conv_views.depthwise_like(use.op):
            out = self.sum_squared(_conv_views.as_depthwise(use), dZ_columns, B, per_example)
            return (None if out is None else
                    _conv_views.to_grouped(out, use, [B] if per_example else []))
        # the wide filter (C*Cout outputs): every tap in one matmul (`_convolution.squares`)
        rule = (ConvolutionRule(dataclasses.replace(self.options, few_positions=2 ** 31))
                if self.options.strategy == "auto" and not _depthwise(use.op) else self)
        return _conv_squares.sum_squared(rule, use, dZ_columns, B, per_example)

    def sum_squared_size(self, use, C, per_example=False):
        return _conv_squares.formed_size(use, C, per_example)

    def clipped_sum(self, use, dZ, factors):
        # sum_i f_i grad_i(W): the filter gradient of the batch with dZ scaled per example
        if isinstance(use, ViewUse):
            return self.clipped_sum(*use.inner(dZ), factors)
        if _conv_views.depthwise_like(use.op):
            return _conv_views.to_grouped(self.clipped_sum(
                _conv_views.as_depthwise(use), dZ, factors), use, [])
        strides, dilations, _, _ = attributes(use.op)
        if (groups(use.op) != 1 or any(d != 1 for d in dilations) or
                (_depthwise(use.op) and strides[1] != strides[2])):   # no kernel of TF's
            return super().clipped_sum(use, dZ, factors)
        if untrusted_filter_gradient(use, self.options):   # one group of "shifts"
            return registry_lib.batch_gradient_clipped_sum(self, use, dZ, factors)
        return filter_gradient(use, _rows.scale_rows(dZ, factors))


class TransposedRule(registry_lib.Rule):
    """Per-example filter gradients of a transposed convolution (filter at input 1, data
    A at input 2) by `ConvolutionRule` (with `options`) on the forward convolution of dZ
    with A as its output gradient (the identity: `conv2d_transpose`)."""

    def __init__(self, options=None):
        self.convolution = ConvolutionRule(options)

    def match(self, op, slot, analysis):
        view = _conv_views.transposed_view_of(op, slot, analysis)
        if isinstance(view, str):
            return view
        return ViewUse(op, slot, self, op.inputs[2], op.outputs[0], op.inputs[1].shape,
                       view[1], view=view[0])

    def per_group(self, use, dZ, G):
        return self.convolution.per_group(*use.inner(dZ), G)

    def squared_norms(self, use, dZ, B):
        return self.convolution.squared_norms(*use.inner(dZ), B)

    def clipped_sum(self, use, dZ, factors):
        return self.convolution.clipped_sum(*use.inner(dZ), factors)


class Conv2DRule(ConvolutionRule):
    """Per-example filter gradients of Conv2D (`options`: a `ConvOptions`)."""

    @_context.public("rules.conv2d.Conv2DRule")
    def __init__(self, options=None):
        super().__init__(options)

    def kfac_rows(self, use):
        if use.op.type != "Conv2D":
            return None
        if groups(use.op) != 1:
            return (f"{use.op.name!r} is a grouped convolution ({groups(use.op)} groups), "
                    "whose filter's GGN block has no single Kronecker form")
        kh, kw, c_in, _ = use.weight_shape.as_list()
        return tf.reshape(patches(use.op, kh, kw), [-1, kh * kw * c_in])   # [R, kh*kw*Cin] (KFC)


def register(registry, options=None):
    """Adds the Conv2D rule to `registry` (with `options`, a `ConvOptions`)."""
    registry.register("Conv2D", Conv2DRule(options))

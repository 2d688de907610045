"""The convolution rules' options (`ConvOptions`, public as `rules.conv2d.ConvOptions`;
the choice of way its fields tune is in `rules.conv2d`'s docstring) and the oneDNN
question they ask."""

import dataclasses

import tensorflow as tf

from pertower import _context
from pertower import _tf
from pertower._convolution.geometry import attributes

__all__ = ["STRATEGIES", "ConvOptions", "onednn_enabled", "onednn_runs",
           "untrusted_filter_gradient"]

STRATEGIES = ("auto", "patches", "grouped", "depthwise", "shifts", "examples")


@dataclasses.dataclass(frozen=True)
class ConvOptions:
    """How the convolution rules compute per-example filter gradients.

    Attributes:
      strategy: "auto" (the rule from the shapes in `rules.conv2d`'s docstring), or
        "shifts", "patches", "grouped", "examples" to force that way on every convolution
        it covers (the others fall back to the towers, with the reason). "depthwise" means
        "grouped"; for depthwise convolutions "shifts" means "patches".
      grouped_threshold: no longer read; accepted so that code passing it still runs.
      onednn: whether TensorFlow's oneDNN CPU kernels are on; None asks TensorFlow
        (`onednn_enabled`). With them off, a stride-1 convolution's input gradient may
        run as a forward convolution (`rules._input_gradients`).
      thin_channels: below this many input channels "auto" does not pick "grouped", and
        "shifts" stacks the taps into one matmul (`ways.tap_layout`).
      few_positions: below this many output positions per image "shifts" puts the taps
        side by side (else one matmul per tap); None: `ways.FEW_POSITIONS` (512).

    Example:
      registry = pertower.rules.default_registry()
      registry.register("Conv2D", conv2d.Conv2DRule(conv2d.ConvOptions("grouped")))
      pertower.per_example_gradients(ys, xs, rules=registry)
    """

    strategy: str = "auto"
    grouped_threshold: float = 20.0
    onednn: bool = None
    thin_channels: int = 8
    few_positions: int = None

    @_context.public("rules.conv2d.ConvOptions")
    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise _context.error(ValueError, f"`strategy` must be one of "
                                             f"{', '.join(STRATEGIES)}, but received "
                                             f"{self.strategy!r}.")
        for name in ("thin_channels", "few_positions"):
            value = getattr(self, name)
            if value is None and name == "few_positions":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise _context.error(ValueError, f"`{name}` must be an int >= 0, but "
                                                 f"received {value!r}.")


def onednn_enabled():
    """Whether TensorFlow runs its oneDNN CPU kernels (False when it does not say)."""
    return bool(_tf.onednn_enabled())


def onednn_runs(options):
    """Whether oneDNN's kernels run for a rule with `options` (a `ConvOptions` or None):
    `options.onednn` where set, else `onednn_enabled()`."""
    onednn = None if options is None else options.onednn
    return onednn_enabled() if onednn is None else bool(onednn)


def untrusted_filter_gradient(use, options):
    """Whether the rules keep `use` away from TensorFlow's one-group backward-filter
    kernel: oneDNN on (`options.onednn`, else asked), float32, a 1x1 filter with a
    stride > 1 (see "oneDNN" in `rules.conv2d`'s docstring)."""
    return (onednn_runs(options) and use.op.inputs[0].dtype == tf.float32 and
            all(k == 1 for k in use.weight_shape.as_list()[:-2]) and
            max(attributes(use.op)[0]) > 1)

"""The lattice of the batch-axis analysis: what one tensor's values owe to the batch.

Notation (as in every core module):
    B   examples in the batch          k   rows per example on a tensor's batch axis
    E   elements per example           S   the ops between the batch and `ys`

Every tensor of S gets one value:

    INDEPENDENT   computed without the batch (weights, constants).
    SIZE          depends on the batch through its size only (tf.shape(x)[0], tf.range
                  of it, a Fill of it).
    Rows(lead, k, E)
                  axis `lead` is the batch axis: k consecutive entries per example, each
                  from its own example alone; E (when known) the elements per example.
                  When every axis before `lead` has static size 1 the flat data is B
                  blocks of E elements, the "row layout" the rules need (`contiguous`).
    UNKNOWN       depends on the batch, but the batch axis was lost.
    Example(index)
                  one example's values inside a TF1 loop over the examples (`functions`).
    Interleaved(inner, blocks, E)
                  axis 0 is [blocks, B*inner] flattened: example i owns the rows
                  j*B*inner + i*inner + t (j < blocks, t < inner), SpaceToBatchND's
                  layout (`transfer_blocks`).

INDEPENDENT < SIZE < Rows < UNKNOWN: `join` gives the value of a tensor that is one of
two values (the branches of a cond, a loop variable over iterations).
"""

import collections
import dataclasses

import tensorflow as tf
from pertower import _context

__all__ = ["Rows", "Example", "Interleaved", "INDEPENDENT", "SIZE", "UNKNOWN", "Coupling",
           "Coupled", "Lost", "complete", "contiguous", "join", "describe", "TensorMap"]


Rows = collections.namedtuple("Rows", ["lead", "k", "E"])
Example = collections.namedtuple("Example", ["index"])   # index: a tensor's name
Interleaved = collections.namedtuple("Interleaved", ["inner", "blocks", "E"])


class _Marker:
    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return self.name


INDEPENDENT = "independent"   # (a string: `== "independent"` keeps working)
SIZE = "meta"
UNKNOWN = _Marker("UNKNOWN")


def depends_on_values(value):
    """Whether `value` carries the batch's values (Rows, Example or UNKNOWN)."""
    return isinstance(value, (Rows, Example, Interleaved)) or value is UNKNOWN


def complete(layout, shape):
    """Fills in k from E (or E from k) with the static shape; None when rows would
    straddle examples or the shape has no axis `lead`."""
    if shape.rank is None or shape.rank <= layout.lead:
        return None
    lead, k, E = layout
    rest = 1   # prod(shape[lead + 1:]) when static
    for d in shape.as_list()[lead + 1:]:
        rest = None if rest is None or d is None else rest * d
    if rest is not None:
        if k is None and E is not None:
            if rest == 0 or E % rest:
                return None
            k = E // rest
        elif E is None and k is not None:
            E = k * rest
        elif k is not None and E is not None and k * rest != E:
            return None
    return Rows(lead, k, E)


def contiguous(layout, shape):
    """Whether a Rows layout is a row layout: every axis before `lead` has static size 1."""
    if not isinstance(layout, Rows) or layout.lead < 0 or shape.rank is None:
        return False
    return all(tf.compat.dimension_value(d) == 1 for d in shape[:layout.lead])


def join(first, second):
    """The value of a tensor that is `first` or `second`."""
    if first == second:
        return first
    order = [INDEPENDENT, SIZE]
    if first in order and second in order:
        return SIZE
    if first in order and isinstance(second, Rows):
        return second if first is INDEPENDENT else UNKNOWN
    if second in order and isinstance(first, Rows):
        return first if second is INDEPENDENT else UNKNOWN
    if isinstance(first, Rows) and isinstance(second, Rows) and first.lead == second.lead:
        return Rows(first.lead, first.k if first.k == second.k else None,
                    first.E if first.E == second.E else None)
    return UNKNOWN


def describe(tensor):
    return f"{tensor.name!r} (shape {tensor.shape})"


@dataclasses.dataclass(frozen=True)
class Coupling:
    """An op that makes one example's value depend on other examples: `reason`, what
    it does along the batch axis ("reduces (Mean) over axis 0, the batch axis of its
    input 'x:0' (shape (None, 5))"); `advice`, what to do instead."""

    op: tf.Operation
    reason: str
    advice: str

    def message(self, lead=""):
        """The refusal, with `lead` (a first, more likely fix) in front."""
        return _context.prefixed(
            f"{lead}the op {self.op.name!r} ({self.op.type}) between "
            f"the batch and `ys` couples the examples of the batch: it {self.reason}. So "
            "each example's value depends on the other examples, its per-example "
            "gradient is not defined, and computing each example on its own (as the "
            f"towers and the per-op rules do) would give another function than `ys`. "
            f"{self.advice}")


class Coupled(Exception):
    """Raised by a transfer function when its op couples examples."""

    def __init__(self, reason, advice):
        super().__init__(reason)
        self.reason = reason
        self.advice = advice


class Lost(Exception):
    """Raised by a transfer function when it cannot follow the batch axis (why)."""

    @property
    def reason(self):
        return self.args[0]


def matched(found, reason):
    """`found` (a pattern matched at an op), or raises Lost(reason) when it is None."""
    if found is None:
        raise Lost(reason)
    return found


class TensorMap:
    """A dict keyed by tensors through `tensor.ref()` (tensors of function graphs are
    not hashable)."""

    def __init__(self):
        self._items = {}

    def __contains__(self, tensor):
        return tensor.ref() in self._items

    def __getitem__(self, tensor):
        return self._items[tensor.ref()]

    def __setitem__(self, tensor, value):
        self._items[tensor.ref()] = value

    def get(self, tensor, default=None):
        return self._items.get(tensor.ref(), default)


BATCH_NORM_ADVICE = (
    "This is batch normalization in training mode (a tf_keras BatchNormalization "
    "called with training=True, or in the symbolic learning phase, or tf.nn.moments / "
    "fused_batch_norm over the batch): call the layer with training=False (inference "
    "mode, which normalizes with the moving averages and works with pertower; a whole "
    "tf_keras model, e.g. a tf_keras.applications network, on new inputs: `inputs = "
    "tf_keras.Input(shape)`, `tf_keras.Model(inputs, network(inputs, training=False))`; "
    "set its BatchNormalization layers' trainable=False to freeze their scale and "
    "offset too), or normalize each example on its own (LayerNormalization, "
    "GroupNormalization).")
REDUCTION_ADVICE = (
    "Reduce over the non-batch axes only (for example axis=list(range(1, rank))), so "
    "that `ys` keeps one independent row per example; normalize per example "
    "(LayerNormalization) instead of over the batch.")
POSITION_ADVICE = (
    "Select, order or shift examples before they enter the graph (feed them in the "
    "order you want), and index only the non-batch axes between the batch and `ys`.")
CONTRACTION_ADVICE = (
    "Contract only non-batch axes (x @ W, not x^T @ x or x @ x^T); a statistic "
    "over the whole batch has no per-example gradient.")


def advice_for(op, advice):
    """Batch-norm advice for ops from a batch-normalization name scope."""
    name = op.name.lower()
    if "batch_norm" in name or "batchnorm" in name or "moments" in name:
        return BATCH_NORM_ADVICE
    return advice

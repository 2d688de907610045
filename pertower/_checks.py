"""Argument checks shared by the public functions (each error names the argument, what
was received and what to do), the warning about weights `ys` does not reach, and the
Keras 3 variables' TF variables.
"""

import math
import numbers
import sys
import warnings

import tensorflow as tf

from pertower import _context
from pertower import _graph_walk as graph_walk
from pertower import _tf
from pertower import _weight_reads

__all__ = ["UNCONNECTED_DEFAULT", "UnconnectedWeightsWarning", "as_list", "check_memory_limit",
           "device_list", "optional_seed", "positive_int", "require_graph_mode",
           "require_graph_tensor", "unconnected_gradients_value", "unreached_weights",
           "warn_unconnected", "weight_list"]

_GRAPH_MODE_HINT = (
    "pertower works on TF1-style graphs run in a tf.compat.v1.Session. Switch to "
    "graph mode with tf.compat.v1.disable_eager_execution() (or "
    "tf.compat.v1.disable_v2_behavior() for fully legacy code) before building the "
    "model, or build everything inside `with tf.Graph().as_default():`.")


def require_graph_mode():
    """Raises RuntimeError when eager execution is on."""
    if tf.executing_eagerly():
        raise RuntimeError(f"{_context.prefix()} needs graph mode, but eager execution is "
                           "on. " + _GRAPH_MODE_HINT)


def require_graph_tensor(value, argument):
    """Returns `value` when it is a symbolic `tf.Tensor`; raises otherwise."""
    if isinstance(value, tf.Variable):
        raise _context.error(TypeError, f"`{argument}` must be a tensor computed from the "
                             f"batch, but received the variable {value.name!r}.")
    if not isinstance(value, tf.Tensor):
        raise _context.error(TypeError, f"`{argument}` must be a tf.Tensor, but received "
                             f"{type(value).__name__} ({value!r:.80}).")
    if not hasattr(value, "graph") or not hasattr(value, "op"):
        raise _context.error(RuntimeError,
                             f"`{argument}` is an eager tensor. " + _GRAPH_MODE_HINT)
    return value


def as_list(value):
    """`value` as a list: a list or tuple is copied, anything else wrapped."""
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def unconnected_gradients_value(value):
    """Normalizes `unconnected_gradients` to a `tf.UnconnectedGradients` member."""
    try:
        return tf.UnconnectedGradients(value)
    except ValueError:
        raise _context.error(ValueError, "`unconnected_gradients` must be 'zero' or 'none' "
                             f"(or a tf.UnconnectedGradients member), but received "
                             f"{value!r}.") from None


def real_number(value, argument, low=-math.inf, high=math.inf,
                low_open=False, high_open=False, wanted=None):
    """`value` as a float in [low, high] (or open ends); raises TypeError for a
    non-number, ValueError for NaN or a value outside; `wanted`: what the message asks."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _context.error(TypeError, f"`{argument}` must be "
                        f"{wanted or 'a number'}, but received {type(value).__name__} "
                        f"({value!r:.80}).")
    value = float(value)
    too_low = value <= low if low_open else value < low
    too_high = value >= high if high_open else value > high
    if math.isnan(value) or too_low or too_high:
        interval = (("(" if low_open else "[") + f"{low:g}, {high:g}" +
                    (")" if high_open else "]"))
        raise _context.error(ValueError, f"`{argument}` must be "
                         f"{wanted or 'in ' + interval}, but received {value!r}.")
    return value


def fed_batch_size_check(b, axis, B, built, advice, name="check_batch_size", given=None):
    """A run-time assertion that the batch fed to `b` has B examples on axis `axis`."""
    fed = tf.shape(b)[axis]
    given = given or f"batch_size={B}"
    message = tf.strings.join([
        f"pertower: {built} were built for a batch of {B} examples ({given}), but "
        f"the batch fed to {b.name} has ", tf.strings.as_string(fed),
        f" examples. Feed batches of {B} examples, {advice}"])
    return tf.debugging.Assert(tf.equal(fed, B), [message], name=name)


def positive_int(value, argument, low=1):
    """`value` as an int when it is an integer >= `low` (1 or 0); raises ValueError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise _context.error(
            ValueError, f"`{argument}` must be a {'non-negative' if low == 0 else 'positive'} "
            f"integer, but received {value!r}.")
    return int(value)


def optional_seed(seed):
    """`seed` as an int, or None; raises TypeError for anything else."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)):
        raise _context.error(TypeError, "`seed` must be an int or None, but received "
                             f"{type(seed).__name__} ({seed!r:.80}).")
    return None if seed is None else int(seed)


def device_list(devices):
    """`devices` as a tuple of canonical device strings, or None; raises on bad input."""
    if devices is None:
        return None
    if isinstance(devices, (str, bytes)) or not isinstance(devices, (list, tuple)):
        raise _context.error(TypeError, "`devices` must be a list of device strings (for "
                             f"example ['/cpu:0', '/cpu:1']), but received {devices!r:.80}.")
    if not devices:
        raise _context.error(ValueError, "`devices` is empty; pass at least one "
                         "device string, or None to leave placement to TensorFlow.")
    canonical = []
    for j, device in enumerate(devices):
        if isinstance(device, tf.DeviceSpec):
            device = device.to_string()
        if not isinstance(device, str):
            raise _context.error(TypeError, f"`devices[{j}]` must be a device "
                            f"string, but received {type(device).__name__} ({device!r:.80}).")
        try:
            canonical.append(tf.DeviceSpec.from_string(device).to_string())
        except (ValueError, TypeError) as error:
            raise _context.error(ValueError, f"`devices[{j}]` ({device!r}) is not a "
                             f"device string: {error}") from None
    return tuple(canonical)


def renamed_argument(value, old_value, argument, old_argument):
    """(the value of `argument`, the name it was given by), `old_argument` being its
    deprecated name (a DeprecationWarning); both is a TypeError."""
    if old_value is None:
        return value, argument
    if value is not None:
        raise _context.error(TypeError, f"`{old_argument}` is a deprecated name of "
                             f"`{argument}`, and both were given ({old_argument}={old_value!r}, "
                             f"{argument}={value!r}). Pass only {argument}=.")
    warnings.warn(
        _context.prefixed(f"`{old_argument}` is deprecated; pass "
                          f"{argument}={old_value!r} instead."), DeprecationWarning, stacklevel=3)
    return old_value, old_argument


def _is_keras3_variable(x):
    """Whether `x` is a Keras 3 `keras.Variable` (duck-typed, Keras 3 is not imported)."""
    module = type(x).__module__ or ""
    return ((module == "keras" or module.startswith("keras."))
            and not isinstance(x, (tf.Variable, tf.Tensor)) and hasattr(x, "value"))


class Partitions:
    """Each `PartitionedVariable` of `xs` split into its partitions in `flat`; `join`
    puts the results back: [G, *p_1.shape], ..., [G, *p_P.shape] -> [G, *x.shape]."""

    def __init__(self, xs):
        self.flat = []
        self._layout = []   # per entry of xs: (start in flat, count, axis or None)
        for x in xs:
            if isinstance(x, _tf.PartitionedVariable):
                parts = list(x)
                counts = _tf.partitions(x)
                axis = next((a for a, c in enumerate(counts) if c > 1), 0)
                self._layout.append((len(self.flat), len(parts), axis))
                self.flat.extend(parts)
            else:
                self._layout.append((len(self.flat), 1, None))
                self.flat.append(x)

    def join(self, results, lead=1):
        """One result per entry of `xs` from one per entry of `flat`, after `lead`
        leading axes; a None part makes the entry None, sparse parts are made dense."""
        joined = []
        for start, count, axis in self._layout:
            if axis is None:
                joined.append(results[start])
                continue
            parts = results[start:start + count]
            if any(p is None for p in parts):
                joined.append(None)
                continue
            parts = [p.to_dense() if hasattr(p, "to_dense") else tf.convert_to_tensor(p)
                     for p in parts]
            joined.append(tf.concat(parts, axis=lead + axis))   # [*lead, *x.shape]
        return joined


def weight_list(xs, argument):
    """`xs` as a list, a Keras 3 variable replaced by its TF variable; refuses a
    PartitionedVariable."""
    weights = as_list(xs)
    for k, x in enumerate(weights):
        if isinstance(x, _tf.PartitionedVariable):
            raise _context.error(
                TypeError, f"`{argument}[{k}]` is the PartitionedVariable "
                f"{x.name!r} ({len(list(x))} partitions), which this function does not "
                f"take whole; pass its partitions instead, e.g. `list(variable)` in "
                f"`{argument}`.")
        if not _is_keras3_variable(x):
            continue
        value = x.value
        if not isinstance(value, (tf.Variable, tf.Tensor)) or not hasattr(value, "graph"):
            raise _context.error(
                TypeError, f"`{argument}[{k}]` is a Keras 3 variable "
                f"({getattr(x, 'path', None) or getattr(x, 'name', '?')}) whose value is "
                f"{type(value).__name__}, not a graph-mode TensorFlow variable. Build the "
                "model with the graph-mode Keras: `import tf_keras as keras`, or set "
                "TF_USE_LEGACY_KERAS=1 before TensorFlow is imported so that tf.keras is "
                "Keras 2; or build the Keras 3 model in graph mode, after "
                "tf.compat.v1.disable_eager_execution().")
        weights[k] = value
    return weights


class _DefaultZero(str):
    """Equal to "zero" everywhere; told apart from a "zero" the caller passed by identity."""

    __slots__ = ()


# The public functions' default `unconnected_gradients`: zeros for weights `ys` does not
# reach, with an `UnconnectedWeightsWarning` naming them; an explicit "zero" is silent.
UNCONNECTED_DEFAULT = _DefaultZero("zero")


class UnconnectedWeightsWarning(UserWarning):
    """Some weights passed in `xs` are not reached by `ys`: their results are zeros."""


# How many unreached weights a warning names before "and N more".
_NAMED_IN_WARNING = 5


def _user_stacklevel():
    """The `stacklevel` of the first frame outside pertower (the caller's line)."""
    frame, level = sys._getframe(1), 1  # pylint: disable=protected-access
    while frame is not None and (frame.f_globals.get("__name__") or "").split(".")[0] \
            == "pertower":
        frame, level = frame.f_back, level + 1
    return level


def unreached_weights(ys, xs):
    """The names of the entries of `xs` `ys` does not reach, or None for bad arguments."""
    if not isinstance(ys, tf.Tensor) or not isinstance(getattr(ys, "graph", None), tf.Graph):
        return None
    try:
        weights = weight_list(xs, "xs")
        with ys.graph.as_default():
            upstream = graph_walk.upstream_ops([ys])
            reads = [_weight_reads.weight_reads(x, k, upstream, ())
                     for k, x in enumerate(weights)]
    except (TypeError, ValueError, NotImplementedError, AttributeError):
        return None
    return [r.name for r in reads if not r.reached]


def warn_unconnected(ys, xs, unconnected_gradients, argument="xs",
                     outcome=None, reads=None, ys_argument="ys", remedy=None):
    """Warns (`UnconnectedWeightsWarning`) when `ys` does not reach some entries of `xs`
    and `unconnected_gradients` is `UNCONNECTED_DEFAULT`. `argument`, `ys_argument`:
    the public names; `outcome`: what unreached weights get, for a function without
    `unconnected_gradients`; `remedy`: other advice; `reads`: the `WeightReads` of xs."""
    if unconnected_gradients is not UNCONNECTED_DEFAULT:
        return
    if reads is not None:
        names = [r.name for r in reads if not r.reached]
    else:
        names = unreached_weights(ys, xs)
    if not names:
        return
    listing = ", ".join(names[:_NAMED_IN_WARNING])
    if len(names) > _NAMED_IN_WARNING:
        listing += f" and {len(names) - _NAMED_IN_WARNING} more"
    count = len(as_list(xs))
    if outcome is None:
        outcome = "their gradients are zeros"
        remedy = remedy or (
            f"Leave them out of `{argument}`, or pass unconnected_gradients='zero' to keep "
            "the zeros without this warning ('none' gives None for them).")
    else:
        remedy = remedy or f"Leave them out of `{argument}`."
    warnings.warn(
        _context.prefixed(
            f"`{ys_argument}` does not depend on {len(names)} of the {count} weights in "
            f"`{argument}` ({listing}), so {outcome}. {remedy}"),
        UnconnectedWeightsWarning, stacklevel=_user_stacklevel())


def check_memory_limit(memory_limit):
    """Raises unless `memory_limit` is None, a positive number of bytes or inf."""
    if memory_limit is None:
        return
    if isinstance(memory_limit, bool) or not isinstance(memory_limit, numbers.Real) or not (
            memory_limit > 0):
        raise _context.error(
            ValueError, "`memory_limit` must be a positive number of bytes, "
            "None (the default: half of the machine's physical memory) or float('inf') (no "
            f"limit), but received {memory_limit!r}.")


def grad_ys_like(ys, grad_ys):
    """grad_ys as a tensor of ys's dtype and shape (None stays None)."""
    if grad_ys is None:
        return None
    grad_ys = tf.convert_to_tensor(grad_ys, dtype=ys.dtype)
    if not ys.shape.is_compatible_with(grad_ys.shape):
        raise _context.error(ValueError, "`grad_ys` must have the shape of `ys`, "
                         f"{ys.shape}, but has shape {grad_ys.shape}.")
    return grad_ys

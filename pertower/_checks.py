"""Argument checks shared by the public functions.

Every check raises an error that names the argument, says what was received and
what to do instead. Nothing here builds graph ops.
"""

import numbers
import warnings

import tensorflow as tf

_GRAPH_MODE_HINT = (
    "pertower works on TF1-style graphs run in a tf.compat.v1.Session. Switch to "
    "graph mode with tf.compat.v1.disable_eager_execution() (or "
    "tf.compat.v1.disable_v2_behavior() for fully legacy code) before building the "
    "model, or build everything inside `with tf.Graph().as_default():`."
)


def require_graph_mode(function_name):
    """Raises RuntimeError when eager execution is on."""
    if tf.executing_eagerly():
        raise RuntimeError(
            f"pertower.{function_name} needs graph mode, but eager execution is on. "
            + _GRAPH_MODE_HINT
        )


def require_graph_tensor(value, argument, function_name):
    """Returns `value` when it is a symbolic `tf.Tensor`; raises otherwise."""
    if isinstance(value, tf.Variable):
        raise TypeError(
            f"pertower.{function_name}: `{argument}` must be a tensor computed from the "
            f"batch, but received the variable {value.name!r}."
        )
    if not isinstance(value, tf.Tensor):
        raise TypeError(
            f"pertower.{function_name}: `{argument}` must be a tf.Tensor, but received "
            f"{type(value).__name__} ({value!r:.80})."
        )
    if not hasattr(value, "graph") or not hasattr(value, "op"):
        raise RuntimeError(
            f"pertower.{function_name}: `{argument}` is an eager tensor. " + _GRAPH_MODE_HINT
        )
    return value


def static_batch_size(tensor):
    """The static size of axis 0 as an int, or None (rank unknown or axis not static).

    Works for the Dimension objects of TF1 behaviour too."""
    if tensor.shape.rank is None or tensor.shape.rank == 0:
        return None
    return tf.compat.dimension_value(tensor.shape[0])


def as_list(value):
    """`value` as a list: a list or tuple is copied, anything else wrapped."""
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def unconnected_gradients_value(value, function_name):
    """Normalizes `unconnected_gradients` to a `tf.UnconnectedGradients` member."""
    try:
        return tf.UnconnectedGradients(value)
    except ValueError:
        raise ValueError(
            f"pertower.{function_name}: `unconnected_gradients` must be 'zero' or 'none' "
            f"(or a tf.UnconnectedGradients member), but received {value!r}."
        ) from None


def positive_int(value, argument, function_name):
    """Returns `value` as an int when it is a positive integer; raises otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(
            f"pertower.{function_name}: `{argument}` must be a positive integer, but "
            f"received {value!r}.")
    return int(value)


def device_list(devices, function_name):
    """`devices` as a tuple of canonical device strings, or None; raises on bad input."""
    if devices is None:
        return None
    if isinstance(devices, (str, bytes)) or not isinstance(devices, (list, tuple)):
        raise TypeError(
            f"pertower.{function_name}: `devices` must be a list of device strings (for "
            f"example ['/cpu:0', '/cpu:1']), but received {devices!r:.80}.")
    if not devices:
        raise ValueError(f"pertower.{function_name}: `devices` is empty; pass at least one "
                         "device string, or None to leave placement to TensorFlow.")
    canonical = []
    for j, device in enumerate(devices):
        if isinstance(device, tf.DeviceSpec):
            device = device.to_string()
        if not isinstance(device, str):
            raise TypeError(f"pertower.{function_name}: `devices[{j}]` must be a device "
                            f"string, but received {type(device).__name__} ({device!r:.80}).")
        try:
            canonical.append(tf.DeviceSpec.from_string(device).to_string())
        except (ValueError, TypeError) as error:
            raise ValueError(f"pertower.{function_name}: `devices[{j}]` ({device!r}) is not a "
                             f"device string: {error}") from None
    return tuple(canonical)


def renamed_argument(value, old_value, argument, old_argument, function_name):
    """The value of `argument`, given either by its name or by the deprecated keyword
    `old_argument` (which warns with a DeprecationWarning); giving both is an error.

    Returns:
      (value, the name the value was given by).
    """
    if old_value is None:
        return value, argument
    if value is not None:
        raise TypeError(
            f"pertower.{function_name}: `{old_argument}` is a deprecated name of "
            f"`{argument}`, and both were given ({old_argument}={old_value!r}, "
            f"{argument}={value!r}). Pass only {argument}=.")
    warnings.warn(
        f"pertower.{function_name}: `{old_argument}` is deprecated; pass "
        f"{argument}={old_value!r} instead.", DeprecationWarning, stacklevel=3)
    return old_value, old_argument

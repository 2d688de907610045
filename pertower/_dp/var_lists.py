"""The variables a DP step trains: the default list, and those without a gradient.

Notation:
    x   one variable of var_list
"""

import warnings

import tensorflow as tf

from pertower import _checks
from pertower import _context
from pertower import _plan

__all__ = ["variables", "without_gradient_free"]


def variables(var_list):
    """`var_list` flattened (a PartitionedVariable's parts, Keras 3 variables' tf.Variable),
    or the graph's trainable variables when None; every entry, non-float ones included."""
    if var_list is None:
        var_list = tf.compat.v1.trainable_variables() + tf.compat.v1.get_collection(
            tf.compat.v1.GraphKeys.TRAINABLE_RESOURCE_VARIABLES)
        var_list = list({id(v): v for v in var_list}.values())
        if not var_list:
            raise _context.error(ValueError, "the graph has no trainable variables; "
                                 "pass `var_list`.")
    else:
        var_list = _checks.weight_list(
            _checks.Partitions(_checks.as_list(var_list)).flat, "var_list")
        if not var_list:
            raise _context.error(ValueError, "`var_list` is empty.")
    return var_list


def without_gradient_free(var_list):
    """The floating-point entries of `var_list`. The others (an int64 `global_step`, a
    tf.string variable) have no gradient: as TensorFlow's optimizers and TF Privacy do,
    they get the gradient None, and a warning names them."""
    kept = [v for v in var_list if v.dtype.base_dtype.is_floating]
    skipped = [v for v in var_list if not v.dtype.base_dtype.is_floating]
    if skipped:
        names = ", ".join(f"{_plan.weight_name(v)} ({v.dtype.base_dtype.name})"
                          for v in skipped)
        warnings.warn(_context.prefixed(
            f"{len(skipped)} of the variables in `var_list` are not floating-point "
            f"({names}): they have no gradient, so they get the gradient None and "
            "apply_gradients leaves them as they are. Leave them out of `var_list`."),
            stacklevel=4)
    if not kept:
        raise _context.error(ValueError, (
            "`var_list` has no floating-point variable to compute gradients for "
            f"(received {len(var_list)} of other dtypes); pass the model's weights."))
    return kept

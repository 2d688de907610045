"""What both DP optimizers share of the `tf.compat.v1.train.Optimizer` interface."""

import warnings

import tensorflow as tf

from pertower import _checks
from pertower import _context
from pertower import _plan

__all__ = ["GATE_OP", "GATE_GRAPH", "ONE_LOSS_PER_EXAMPLE", "WrappedOptimizer",
           "check_compute_arguments", "variables"]

GATE_OP = tf.compat.v1.train.Optimizer.GATE_OP
GATE_GRAPH = tf.compat.v1.train.Optimizer.GATE_GRAPH

# What a reduced loss is told.
ONE_LOSS_PER_EXAMPLE = (
    "DP needs one loss per example: pass the unreduced loss, [B] (e.g. "
    "tf.nn.sparse_softmax_cross_entropy_with_logits, or a Keras loss with "
    "reduction='none'), not its mean.")


def check_compute_arguments(loss, grad_loss, gate_gradients):
    """Raises for a `loss` that is not a graph tensor of known rank, a `grad_loss`, or
    an unknown `gate_gradients`."""
    _checks.require_graph_mode()
    if callable(loss) and not isinstance(loss, tf.Tensor):
        raise _context.error(TypeError, "`loss` must be a graph tensor, not a callable "
                             "(that is the eager API, which pertower does not serve).")
    _checks.require_graph_tensor(loss, "loss")
    if grad_loss is not None:
        raise _context.error(
            ValueError, "`grad_loss` must be None: DP-SGD weighs every example's loss "
            "equally; scale the loss instead.")
    if gate_gradients not in (tf.compat.v1.train.Optimizer.GATE_NONE, GATE_OP, GATE_GRAPH):
        raise _context.error(ValueError, "`gate_gradients` must be GATE_NONE, GATE_OP or "
                             f"GATE_GRAPH, but received {gate_gradients!r}.")
    if loss.shape.rank is None:   # (a scalar is refused by the request)
        raise _context.error(ValueError, f"`loss` ({loss.name}) has shape {loss.shape}, "
                             f"but {ONE_LOSS_PER_EXAMPLE}")


def variables(var_list):
    """(every variable, the floating-point ones): `var_list` flattened (a
    PartitionedVariable's parts, Keras 3 variables' tf.Variable), or the graph's
    trainable variables when None. The others (an int64 `global_step`, a tf.string
    variable) get the gradient None, as in TensorFlow's optimizers, and a warning."""
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
    return var_list, kept


class WrappedOptimizer:
    """`minimize` and the wrapped optimizer's slots and variables, for a subclass with
    `optimizer`, `compute_gradients` and `apply_gradients`."""

    def minimize(self, loss, global_step=None, var_list=None, gate_gradients=GATE_OP,
                 aggregation_method=None, colocate_gradients_with_ops=False, name=None,
                 grad_loss=None, batch=None, batch_size=None, batch_axis=None,
                 max_batch_size=None):
        """`compute_gradients` then `apply_gradients`, as
        `tf.compat.v1.train.Optimizer.minimize`; returns the training op."""
        grads_and_vars = self.compute_gradients(
            loss, var_list=var_list, batch=batch, batch_size=batch_size,
            gate_gradients=gate_gradients, aggregation_method=aggregation_method,
            colocate_gradients_with_ops=colocate_gradients_with_ops, grad_loss=grad_loss,
            batch_axis=batch_axis, max_batch_size=max_batch_size)
        return self.apply_gradients(grads_and_vars, global_step=global_step, name=name)

    def get_slot(self, var, name):
        """The wrapped optimizer's slot (e.g. Adam's "m")."""
        return self.optimizer.get_slot(var, name)

    def get_slot_names(self):
        return self.optimizer.get_slot_names()

    def variables(self):
        """The wrapped optimizer's variables (slots, Adam's beta powers)."""
        return self.optimizer.variables()

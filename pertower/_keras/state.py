"""The Keras optimizers' DP state and apply step (`pertower.keras`): the face DPOptimizer
wraps (`KerasApply`, the Keras optimizer's own `apply_gradients` plus the unclipped
gradient of the loss's data-independent terms) and the DP step's variables made as Keras
weights (`DPStateWeights`)."""

import tensorflow as tf
import tf_keras

from pertower import _context

__all__ = ["KerasApply", "DPStateWeights", "plus", "regularization_gradients"]


class KerasApply(tf.compat.v1.train.Optimizer):
    """The `tf.compat.v1.train.Optimizer` face DPOptimizer wraps: its apply_gradients is
    the Keras optimizer's."""

    def __init__(self, keras_optimizer):
        super().__init__(use_locking=False, name=type(keras_optimizer).__name__)
        self.keras_optimizer = keras_optimizer
        self.added_gradients = {}   # id(variable) -> the gradient of R, added unclipped

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        pairs = [(plus(g, self.added_gradients.get(id(v))), v) for g, v in grads_and_vars]
        return self.keras_optimizer.apply_gradients(pairs, name=name)


def plus(gradient, added):
    """gradient + added, made in the current graph (all of Keras' gradients must share
    one: inside the accumulator's tf.cond branch)."""
    if gradient is None:
        return None
    return tf.identity(gradient) if added is None else gradient + added


def regularization_gradients(regularization, params):
    """{id(x): dR/dx} for the data-independent terms R of a Keras loss (`_keras.loss`),
    added to the noised mean gradient unclipped; {} without R."""
    if regularization is None:
        return {}
    gradients = tf.gradients(regularization, params)
    return {id(x): tf.convert_to_tensor(g) for x, g in zip(params, gradients)
            if g is not None}


class DPStateWeights:
    """The DP step's own variables (the accumulator's sums, count, unclipped count and
    run counter with gradient_accumulation_steps > 1; adaptive clipping's C), made as
    weights of the Keras optimizer (`add_weight`), after its own weights in `weights`:
    HDF5 `model.save` / `load_model` and `model.save_weights` / `load_weights` (a
    tf.train checkpoint of the model) keep them, so a save mid-accumulation resumes the
    same logical batch. A SavedModel (save_format="tf") holds them too, but tf_keras'
    `load_model` of a SavedModel restores no optimizer state in graph mode ("Slots
    cannot be restored from saved_model"): the loaded optimizer starts afresh.

    They are made when the training op is built (`fit`'s first call), after a load:
    an HDF5 `load_model` calls `set_weights` before, so their saved values wait in
    `pending`; `model.load_weights` of a TensorFlow checkpoint restores them as they
    are made (a `tf.compat.v1.train.Checkpoint(...).restore(path)` of your own needs
    its `run_restore_ops()` again after the first `fit` builds them). A variable whose
    shape grows (the efficient tree's buffer of `DPFTRLTreeAggregationOptimizer`
    without restart_period; with one it has a fixed shape and is saved) cannot be a
    Keras weight: it is made and initialized here but not saved, so a restored
    efficient tree continues its releases and seed but not the buffer's values,
    and its first release that reads a lost level fails, naming the fix (`_dp.tree`)."""

    def __init__(self, keras_optimizer):
        self.keras_optimizer = keras_optimizer
        self.variables = []
        self.unsaved = []        # made here, initialized here, not among `weights`
        self.pending = None      # saved values of variables not made yet
        self.dp_gradients_built = False   # (then apply_gradients is allowed)
        self._adding = False

    def creator(self, next_creator, **kwargs):
        """A `tf.variable_creator_scope` creator: the variable as a Keras weight."""
        if self._adding:         # add_weight's own creation
            return next_creator(**kwargs)
        shape = kwargs.get("shape")
        if shape is not None and not tf.TensorShape(shape).is_fully_defined():
            # a buffer that grows (the efficient tree's): not a Keras weight, not saved
            variable = next_creator(**kwargs)
            self.unsaved.append(variable)
            return variable
        initial = kwargs["initial_value"]
        value = initial() if callable(initial) else initial
        name = "_".join(kwargs["name"].split("/")[-2:])   # e.g. dp_accumulator_sum_0
        self._adding = True
        try:
            dtype = tf.as_dtype(kwargs.get("dtype") or value.dtype).base_dtype
            variable = self.keras_optimizer.add_weight(
                name, value.shape, dtype=dtype, initializer=lambda shape, dtype=None: value,
                trainable=False)
        finally:
            self._adding = False
        self.variables.append(variable)
        return variable

    def initialize(self, made):
        """Initializes the variables `made` (Keras does not), then gives them the
        values `pending` from an HDF5 file, if any. (In TF2's `fit` they are made
        eagerly, outside the function, and initialized as they are made.)"""
        if tf.compat.v1.executing_eagerly_outside_functions():
            return
        # in tf_keras' session (tf.compat.v1.keras is Keras 3 without TF_USE_LEGACY_KERAS);
        # not those a checkpoint restored as they were made (`model.load_weights`)
        backend = tf_keras.backend
        fresh = [v for v, done in zip(made, backend.batch_get_value(
            [tf.compat.v1.is_variable_initialized(v) for v in made])) if not done]
        backend.batch_set_value(list(zip(fresh, backend.batch_get_value(
            [v.initial_value for v in fresh]))))
        if self.pending is not None and self.variables:
            if len(self.pending) != len(self.variables):
                raise _context.error(
                    ValueError, f"the saved optimizer has {len(self.pending)} DP state "
                    f"weights, but this one makes {len(self.variables)}: load the model "
                    "with the optimizer's saved arguments (gradient_accumulation_steps, "
                    "adaptive_clipping) and the same model.")
            tf_keras.backend.batch_set_value(list(zip(self.variables, self.pending)))
            self.pending = None

"""DP-SGD for tf_keras' `model.fit`, under TensorFlow Privacy's names.

`DPKerasSGDOptimizer`, `DPKerasAdamOptimizer` and `DPKerasAdagradOptimizer` are
tf_keras' legacy SGD, Adam and Adagrad with TensorFlow Privacy 0.9.0's arguments
(`l2_norm_clip`, `noise_multiplier`, `num_microbatches`,
`gradient_accumulation_steps`, then the wrapped optimizer's own); moving from TensorFlow
Privacy is one import. `make_keras_optimizer_class(cls)` makes one for any other
`tf_keras.optimizers.legacy.Optimizer` subclass.

In graph mode (`tf.compat.v1.disable_eager_execution()`) tf_keras' training loop calls
`get_updates(loss, params)` with `model.total_loss`. Either loss works, with the same DP
step: Keras' default reduction (SUM_OVER_BATCH_SIZE, or AUTO), whose scalar mean is read
back into the per-example losses [B] behind it (`pertower._dp.keras_loss`), or
TensorFlow Privacy's `reduction=tf_keras.losses.Reduction.NONE`, the per-example loss
itself. The step is `pertower.DPOptimizer`'s (its module docstring): the clipped sum,
noised, divided, then applied by the Keras optimizer's own `apply_gradients`, so the
arithmetic and the privacy accounting (`pertower.compute_epsilon`) are the same;
pertower's own options (`clipping`, `expected_batch_size`, `adaptive_clipping`, `seed`)
are keyword arguments.

Weight regularizers (`kernel_regularizer`, `model.add_loss` of a term that reads only
weights) read no example: their gradient is added to the noised mean gradient, unclipped
(a function of the weights, no privacy cost). Keras builds them into the loss of the
default reduction only (with reduction NONE, Keras itself cannot add the scalar
regularizer to the [B] loss: "Shapes must be equal rank"). Refused with a ValueError at
the first `fit`: reduction SUM (a sum over the batch), and a term that reads the
examples without being a mean of per-example losses (an `activity_regularizer`, which
Keras divides by the batch size; `add_loss` of a batch statistic); and a masked output
(`mask_zero`, `Masking`) with the default reduction, which Keras divides by the batch's
count of unmasked entries, so an example's loss depends on the others (pertower's
analysis finds the coupling): use reduction NONE, whose per-example loss averages an
example's entries, masked ones counting as 0 (as TensorFlow Privacy).

The history and `evaluate` report the loss Keras computes: with the default reduction
the mean loss (a scalar per epoch, regularizers included), as in plain tf_keras; with
reduction NONE (as TensorFlow Privacy in graph mode) the per-example values, and a last
batch smaller than the others fails in Keras' averaging of them (plain tf_keras too):
use the default reduction for a scalar history.

Batches of any size train, 0 included (a noise-only step): set `expected_batch_size`,
the divisor of the noised sum. `PoissonSequence` gives `fit` the Poisson batches whose
privacy `pertower.compute_epsilon` accounts; the callback `ExampleScores` keeps each
trained example's gradient norm and TracIn self-influence (mislabelled examples first).

In TensorFlow 2's default mode (eager execution on) tf_keras' `fit` traces `train_step`
into a `tf.function` and calls `minimize(loss, var_list, tape=tape)` there with the
same loss; a `tf.function`'s graph is a graph, so the step is the same
DPOptimizer step, built in it (the batch is the dataset iterator's outputs; the tape is
not used). Keras then averages the loss: `history['loss']` is the mean, and a smaller
last batch is fine. `model.compile(run_eagerly=True)` has no graph and is refused.

Example:
  opt = pertower.keras.DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.1,
                                           learning_rate=0.1)
  model.compile(optimizer=opt, loss=tf_keras.losses.SparseCategoricalCrossentropy(
      from_logits=True))   # or reduction=tf_keras.losses.Reduction.NONE
  model.fit(x, y, batch_size=64, epochs=5)
"""

import dataclasses
import functools

import numpy as np
import tensorflow as tf
import tf_keras

from pertower import _context
from pertower._dp import clipping as clipping_lib
from pertower._dp import ftrl
from pertower._dp import keras_loss
from pertower._dp import optimizer as dp_optimizer
from pertower._keras_callbacks import ExampleScores
from pertower._keras_poisson import PoissonSequence

__all__ = ["make_keras_optimizer_class", "DPKerasSGDOptimizer", "DPKerasAdamOptimizer",
           "DPKerasAdagradOptimizer", "DPFTRLTreeAggregationOptimizer", "PoissonSequence",
           "ExampleScores"]


class _KerasApply(tf.compat.v1.train.Optimizer):
    """The `tf.compat.v1.train.Optimizer` face DPOptimizer wraps: its apply_gradients is
    the Keras optimizer's."""

    def __init__(self, keras_optimizer):
        super().__init__(use_locking=False, name=type(keras_optimizer).__name__)
        self.keras_optimizer = keras_optimizer
        self.added_gradients = {}   # id(variable) -> the gradient of R, added unclipped

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        pairs = [(_plus(g, self.added_gradients.get(id(v))), v) for g, v in grads_and_vars]
        return self.keras_optimizer.apply_gradients(pairs, name=name)


def _plus(gradient, added):
    """gradient + added, made in the current graph (all of Keras' gradients must share
    one: inside the accumulator's tf.cond branch)."""
    if gradient is None:
        return None
    return tf.identity(gradient) if added is None else gradient + added


def _regularization_gradients(regularization, params):
    """{id(x): dR/dx} for the data-independent terms R of a Keras loss (`_dp.keras_loss`),
    added to the noised mean gradient unclipped; {} without R."""
    if regularization is None:
        return {}
    gradients = tf.gradients(regularization, params)
    return {id(x): tf.convert_to_tensor(g) for x, g in zip(params, gradients)
            if g is not None}


class _DPStateWeights:
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
    shape grows (the efficient tree's buffer of `DPFTRLTreeAggregationOptimizer`) cannot
    be a Keras weight: it is made and initialized here but not saved, so a restored
    efficient tree continues its releases and seed but not the buffer's values."""

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


def _as_keras_class(method):
    """The method runs as a public call named after the Keras class
    ("pertower.keras.DPKerasSGDOptimizer: ..."), DPOptimizer's errors included."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with _context.public_call(f"keras.{type(self).__name__}", hold=True):
            return method(self, *args, **kwargs)

    return wrapper


def _check_in_function(optimizer):
    """TF2's `fit` (eager execution on) runs `train_step` in a `tf.function`, whose
    graph (a FuncGraph) pertower differentiates as any other; the batch is the
    iterator's outputs there, and the variables DPOptimizer makes (an accumulator, an
    adaptive clip norm) are made once, outside the function. `run_eagerly=True` runs
    the step eagerly, with no graph: refused."""
    if tf.executing_eagerly():
        raise _context.error(
            RuntimeError, f"{type(optimizer).__name__}'s DP step needs a graph, but "
            "model.fit runs train_step "
            "eagerly (model.compile(run_eagerly=True), or "
            "tf.config.run_functions_eagerly(True)): leave run_eagerly at False so that "
            "fit traces train_step into a tf.function, or call "
            "tf.compat.v1.disable_eager_execution() at the start of the program.")


@_context.public("make_keras_optimizer_class")
def make_keras_optimizer_class(cls):
    """A DP subclass of the tf_keras legacy optimizer class `cls` (TensorFlow Privacy's
    `make_keras_optimizer_class`).

    The class takes `(l2_norm_clip, noise_multiplier, num_microbatches=None,
    gradient_accumulation_steps=1, *args, seed=None, clipping="flat",
    expected_batch_size=None, adaptive_clipping=None, **kwargs)`, `*args` and
    `**kwargs` going to `cls` (e.g. `learning_rate`), the others as in
    `pertower.DPOptimizer` (`adaptive_clipping` also as the dict of a
    `pertower.AdaptiveClipping`'s fields). Its `get_config` holds them, so `model.save`
    and `tf_keras.models.load_model(path, custom_objects={name: the class})` round-trip
    it; the accumulator's and adaptive clipping's variables are among its `weights`
    (`_DPStateWeights`). Errors raised inside its methods name the class
    ("pertower.keras.DPKerasSGDOptimizer: ..."). Graph mode, or TF2's
    `fit` (a traced `train_step`; not `run_eagerly=True`).

    Raises:
      TypeError: `cls` is not a subclass of `tf_keras.optimizers.legacy.Optimizer`.
      The class raises ValueError for bad arguments (as `pertower.DPOptimizer`) and for
      a loss it cannot read per example (the module docstring), RuntimeError in eager
      mode and for `apply_gradients` before any DP gradient was built.
    """
    if not (isinstance(cls, type) and issubclass(cls, tf_keras.optimizers.legacy.Optimizer)):
        raise _context.error(
            TypeError, "`cls` must be a subclass of tf_keras.optimizers.legacy.Optimizer "
            f"(e.g. tf_keras.optimizers.legacy.SGD), but received {cls!r:.80}.")

    class DPOptimizerClass(cls):  # pylint: disable=missing-class-docstring
        __doc__ = (f"DP-SGD around `{cls.__module__}.{cls.__name__}` "
                   "(`pertower.keras.make_keras_optimizer_class`).")

        @_as_keras_class
        def __init__(self, l2_norm_clip, noise_multiplier, num_microbatches=None,
                     gradient_accumulation_steps=1, *args, seed=None, clipping="flat",
                     expected_batch_size=None, adaptive_clipping=None, **kwargs):
            super().__init__(*args, **kwargs)
            self._state = _DPStateWeights(self)
            if isinstance(adaptive_clipping, dict):   # as get_config gives it
                adaptive_clipping = clipping_lib.AdaptiveClipping(**adaptive_clipping)
            self._dp = dp_optimizer.DPOptimizer(
                _KerasApply(self), l2_norm_clip, noise_multiplier,
                num_microbatches=num_microbatches, seed=seed, clipping=clipping,
                expected_batch_size=expected_batch_size,
                adaptive_clipping=adaptive_clipping,
                gradient_accumulation_steps=gradient_accumulation_steps)

        def get_config(self):
            config = super().get_config()
            dp, options = self._dp, self._dp.clipping_options
            config.update(
                l2_norm_clip=dp.l2_norm_clip, noise_multiplier=dp.noise_multiplier,
                num_microbatches=dp.num_microbatches,
                gradient_accumulation_steps=dp.gradient_accumulation_steps, seed=dp.seed,
                clipping=options.kind, expected_batch_size=options.expected_batch_size,
                adaptive_clipping=(None if options.adaptive is None
                                   else dataclasses.asdict(options.adaptive)))
            return config

        @_as_keras_class
        def minimize(self, loss, var_list, grad_loss=None, name=None, tape=None):
            """DPOptimizer's training op for the per-example `loss` ([B]); `tape` is not
            used (pertower differentiates the graph) and `grad_loss` must be None. In graph
            mode the variables it makes (the Keras optimizer's own too) are initialized, as
            `fit` would; in TF2's `fit` it is built inside `train_step`'s tf.function."""
            if tf.compat.v1.executing_eagerly_outside_functions():
                _check_in_function(self)
                split = keras_loss.split_loss(loss)
                return self._train_op(split.per_example, var_list, split.data_independent,
                                      grad_loss=grad_loss, name=name)
            before = set(map(id, tf.compat.v1.global_variables()))
            train_op = self._train_op(loss, var_list, grad_loss=grad_loss, name=name)
            # those of the DP step were initialized as they were made
            before.update(map(id, self._state.variables + self._state.unsaved))
            made = [v for v in tf.compat.v1.global_variables() if id(v) not in before]
            if made:
                self._state.initialize(made)
            return train_op

        @property
        def weights(self):
            """The Keras optimizer's weights, then the DP step's (`_DPStateWeights`)."""
            return super().weights + self._state.variables

        def variables(self):
            return self.weights

        @_as_keras_class
        def set_weights(self, weights):
            """As the Keras optimizer's; values past its own weights go to the DP
            step's, kept until the training op makes them if it has not yet."""
            own = len(super().weights)
            if self._state.variables or len(weights) <= own:
                return super().set_weights(weights)
            super().set_weights(weights[:own])
            self._state.pending = [np.array(w) for w in weights[own:]]   # h5py: read now
            return None

        def _train_op(self, loss, var_list, regularization=None, grad_loss=None,
                      name=None):
            self._dp.optimizer.added_gradients = _regularization_gradients(
                regularization, var_list)
            grads_and_vars = self._compute_gradients(loss, var_list, grad_loss)
            return self._dp.apply_gradients(grads_and_vars, name=name)

        @_as_keras_class
        def apply_gradients(self, grads_and_vars, *args, **kwargs):
            """The Keras optimizer's, refused before `get_gradients`, `get_updates` or
            `minimize` (TensorFlow Privacy's check; it raises AssertionError)."""
            if not self._state.dp_gradients_built:
                raise _context.error(
                    RuntimeError, "call get_gradients or get_updates first (or minimize, "
                    "as model.fit does); applying gradients that were not clipped and "
                    "noised would not be differentially private.")
            return super().apply_gradients(grads_and_vars, *args, **kwargs)

        def _compute_gradients(self, loss, var_list, grad_loss=None):
            """DPOptimizer's pairs, its variables made as this optimizer's weights."""
            self._state.dp_gradients_built = True
            made, unsaved = len(self._state.variables), len(self._state.unsaved)
            with tf.variable_creator_scope(self._state.creator):
                grads_and_vars = self._dp.compute_gradients(loss, var_list=var_list,
                                                            grad_loss=grad_loss)
            if len(self._state.variables) > made or len(self._state.unsaved) > unsaved:
                self._state.initialize(self._state.variables[made:]
                                       + self._state.unsaved[unsaved:])
            return grads_and_vars

        @_as_keras_class
        def get_updates(self, loss, params):
            """The training ops of a fit step (tf_keras' v1 loop): the DP step of the
            per-example loss behind `loss` (`model.total_loss`: of reduction NONE [B], or
            the default reduction's scalar mean), plus the unclipped gradient of its
            terms that read no example (weight regularizers; `_dp.keras_loss`)."""
            split = keras_loss.split_loss(loss)
            return [self._train_op(split.per_example, params, split.data_independent)]

        @_as_keras_class
        def get_gradients(self, loss, params):
            """The clipped, noised mean gradient of `loss` (as in `get_updates`) for
            `params` (one batch: without gradient accumulation)."""
            if self._dp.gradient_accumulation_steps > 1:
                raise _context.error(
                    ValueError, "get_gradients computes one batch's gradient, but "
                    f"gradient_accumulation_steps is {self._dp.gradient_accumulation_steps}: "
                    "use get_updates (as model.fit does), which applies every k-th run.")
            split = keras_loss.split_loss(loss)
            pairs = self._compute_gradients(split.per_example, params)
            added = _regularization_gradients(split.data_independent, params)
            return [_plus(g, added.get(id(x))) for g, x in pairs]

    DPOptimizerClass.__name__ = f"DPKeras{cls.__name__}Optimizer"
    DPOptimizerClass.__qualname__ = DPOptimizerClass.__name__
    return DPOptimizerClass


DPKerasSGDOptimizer = make_keras_optimizer_class(tf_keras.optimizers.legacy.SGD)
DPKerasAdamOptimizer = make_keras_optimizer_class(tf_keras.optimizers.legacy.Adam)
DPKerasAdagradOptimizer = make_keras_optimizer_class(tf_keras.optimizers.legacy.Adagrad)


class DPFTRLTreeAggregationOptimizer(DPKerasSGDOptimizer):
    """DP-FTRL for tf_keras' graph-mode `fit` (TensorFlow Privacy 0.9.0's
    `DPFTRLTreeAggregationOptimizer`): tf_keras' legacy SGD (its `learning_rate` and
    `momentum`) on the residuals of tree-aggregated prefix sums of the clipped
    gradients, as `pertower.DPFTRLOptimizer` (`pertower._dp.ftrl`, `pertower._dp.tree`).

    Args:
      l2_norm_clip, noise_multiplier, num_microbatches, gradient_accumulation_steps: as
        in `DPKerasSGDOptimizer` (σ C per tree node).
      var_list_or_model: the model or its variables, as TensorFlow Privacy takes them;
        the tree takes its shapes from the gradients, so None is accepted too.
      restart_period, restart_warmup: the tree's restarts, as in
        `pertower.DPFTRLOptimizer`.
      noise_seed: an int making the noise repeatable, or None.
      *args, **kwargs: tf_keras.optimizers.legacy.SGD's (`learning_rate`, `momentum`).
      efficient_tree: True (default, as TensorFlow Privacy): Honaker's estimator; False:
        the plain tree.

    Example:
      opt = pertower.keras.DPFTRLTreeAggregationOptimizer(
          l2_norm_clip=1.0, noise_multiplier=1.0, var_list_or_model=model,
          restart_period=steps_per_epoch, learning_rate=0.5, momentum=0.9)
      model.compile(optimizer=opt, loss=tf_keras.losses.SparseCategoricalCrossentropy(
          from_logits=True, reduction=tf_keras.losses.Reduction.NONE))
      model.fit(x, y, batch_size=64, epochs=5, shuffle=False)
    """

    def __init__(self, l2_norm_clip, noise_multiplier, var_list_or_model,
                 num_microbatches=None, gradient_accumulation_steps=1, restart_period=None,
                 restart_warmup=None, noise_seed=None, *args, efficient_tree=True, **kwargs):
        with _context.public_call("keras.DPFTRLTreeAggregationOptimizer"):
            super().__init__(l2_norm_clip, noise_multiplier, num_microbatches,
                             gradient_accumulation_steps, *args, seed=noise_seed, **kwargs)
            ftrl.with_tree(self._dp, restart_period, restart_warmup, efficient_tree)

    def get_config(self):
        config = super().get_config()
        tree = self._dp._noise  # pylint: disable=protected-access
        config.update(noise_seed=config.pop("seed"), var_list_or_model=None,
                      restart_period=tree.period, restart_warmup=tree.warmup or None,
                      efficient_tree=tree.efficient)
        return config

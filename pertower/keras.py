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
back into the per-example losses [B] behind it (`pertower._keras.loss`), or
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
from pertower._keras import loss as keras_loss
from pertower._keras import state
from pertower._dp import mechanism as mechanism_lib
from pertower._dp import optimizer as dp_optimizer
from pertower._dp import tree as tree_lib
from pertower._keras.callbacks import ExampleScores
from pertower._keras.poisson import PoissonSequence

__all__ = ["make_keras_optimizer_class", "DPKerasSGDOptimizer", "DPKerasAdamOptimizer",
           "DPKerasAdagradOptimizer", "DPFTRLTreeAggregationOptimizer", "PoissonSequence",
           "ExampleScores"]


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
    expected_batch_size=None, adaptive_clipping=None, mechanism=None, **kwargs)`,
    `*args` and `**kwargs` going to `cls` (e.g. `learning_rate`), the others as in
    `pertower.DPOptimizer` (`adaptive_clipping` also as the dict of a
    `pertower.AdaptiveClipping`'s fields; `mechanism` also as the dict `get_config`
    gives, `_dp.mechanism`). Its `get_config` holds them, so `model.save`
    and `tf_keras.models.load_model(path, custom_objects={name: the class})` round-trip
    it; the accumulator's and adaptive clipping's variables are among its `weights`
    (`pertower._keras.state.DPStateWeights`). Errors raised inside its methods name the class
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
                     expected_batch_size=None, adaptive_clipping=None, mechanism=None,
                     **kwargs):
            super().__init__(*args, **kwargs)
            self._state = state.DPStateWeights(self)
            if isinstance(adaptive_clipping, dict):   # as get_config gives it
                adaptive_clipping = clipping_lib.AdaptiveClipping(**adaptive_clipping)
            self._dp = dp_optimizer.DPOptimizer(
                state.KerasApply(self), l2_norm_clip, noise_multiplier,
                num_microbatches=num_microbatches, seed=seed, clipping=clipping,
                expected_batch_size=expected_batch_size,
                adaptive_clipping=adaptive_clipping,
                gradient_accumulation_steps=gradient_accumulation_steps,
                mechanism=mechanism_lib.from_config(mechanism))

        def get_config(self):
            config = super().get_config()
            dp, options = self._dp, self._dp.clipping_options
            config.update(
                l2_norm_clip=dp.l2_norm_clip, noise_multiplier=dp.noise_multiplier,
                num_microbatches=dp.num_microbatches,
                gradient_accumulation_steps=dp.gradient_accumulation_steps,
                seed=dp.seed if dp.mechanism is None else None,
                clipping=options.kind, expected_batch_size=options.expected_batch_size,
                adaptive_clipping=(None if options.adaptive is None
                                   else dataclasses.asdict(options.adaptive)),
                mechanism=mechanism_lib.to_config(dp.mechanism))
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
            """The Keras optimizer's weights, then the DP step's (`pertower._keras.state.DPStateWeights`)."""
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
            self._dp.optimizer.added_gradients = state.regularization_gradients(
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
            terms that read no example (weight regularizers; `_keras.loss`)."""
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
            added = state.regularization_gradients(split.data_independent, params)
            return [state.plus(g, added.get(id(x))) for g, x in pairs]

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
      efficient_tree: True (default, as TensorFlow Privacy): Honaker's estimator, whose
        buffer is an optimizer weight (saved) when restart_period is given and is not
        saved without it; False: the plain tree.

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
            tree = tree_lib.TreeNoise(noise_seed, restart_period, restart_warmup,
                                      efficient_tree)
            super().__init__(l2_norm_clip, noise_multiplier, num_microbatches,
                             gradient_accumulation_steps, *args, mechanism=tree, **kwargs)

    def get_config(self):
        config = super().get_config()
        tree = self._dp.mechanism
        del config["seed"], config["mechanism"]
        config.update(noise_seed=tree.seed, var_list_or_model=None,
                      restart_period=tree.period, restart_warmup=tree.warmup or None,
                      efficient_tree=tree.efficient)
        return config

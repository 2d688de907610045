"""DP-SGD for tf_keras' `model.fit` in graph mode, under TensorFlow Privacy's names.

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
Keras divides by the batch size; `add_loss` of a batch statistic).

The history and `evaluate` report the loss Keras computes: with the default reduction
the mean loss (a scalar per epoch, regularizers included), as in plain tf_keras; with
reduction NONE (as TensorFlow Privacy in graph mode) the per-example values, and a last
batch smaller than the others fails in Keras' averaging of them (plain tf_keras too):
use the default reduction for a scalar history. Eager execution (TF2's default `fit`)
is refused.

Batches of any size train, 0 included (a noise-only step): set `expected_batch_size`,
the divisor of the noised sum. `PoissonSequence` gives `fit` the Poisson batches whose
privacy `pertower.compute_epsilon` accounts; the callback `ExampleScores` keeps each
trained example's gradient norm and TracIn self-influence (mislabelled examples first).

Example:
  opt = pertower.keras.DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.1,
                                           learning_rate=0.1)
  model.compile(optimizer=opt, loss=tf_keras.losses.SparseCategoricalCrossentropy(
      from_logits=True))   # or reduction=tf_keras.losses.Reduction.NONE
  model.fit(x, y, batch_size=64, epochs=5)
"""

import dataclasses

import tensorflow as tf
import tf_keras

from pertower import _context
from pertower._dp import clipping as clipping_lib
from pertower._dp import keras_loss
from pertower._dp import optimizer as dp_optimizer
from pertower._keras_callbacks import ExampleScores
from pertower._keras_poisson import PoissonSequence

__all__ = ["make_keras_optimizer_class", "DPKerasSGDOptimizer", "DPKerasAdamOptimizer",
           "DPKerasAdagradOptimizer", "PoissonSequence", "ExampleScores"]


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
    it. Graph mode only.

    Raises:
      TypeError: `cls` is not a subclass of `tf_keras.optimizers.legacy.Optimizer`.
    """
    if not (isinstance(cls, type) and issubclass(cls, tf_keras.optimizers.legacy.Optimizer)):
        raise _context.error(
            TypeError, "`cls` must be a subclass of tf_keras.optimizers.legacy.Optimizer "
            f"(e.g. tf_keras.optimizers.legacy.SGD), but received {cls!r:.80}.")

    class DPOptimizerClass(cls):  # pylint: disable=missing-class-docstring
        __doc__ = (f"DP-SGD around `{cls.__module__}.{cls.__name__}` "
                   "(`pertower.keras.make_keras_optimizer_class`).")

        def __init__(self, l2_norm_clip, noise_multiplier, num_microbatches=None,
                     gradient_accumulation_steps=1, *args, seed=None, clipping="flat",
                     expected_batch_size=None, adaptive_clipping=None, **kwargs):
            if tf.compat.v1.executing_eagerly_outside_functions():
                raise _context.error(
                    RuntimeError, f"{type(self).__name__} needs graph mode (tf_keras' v1 "
                    "training loop), but eager execution is on: in TF2's default mode "
                    "model.fit would train without clipping or noise. Call "
                    "tf.compat.v1.disable_eager_execution() at the start of the program, "
                    "or build the model and the optimizer inside `with "
                    "tf.Graph().as_default():`.")
            super().__init__(*args, **kwargs)
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

        def minimize(self, loss, var_list, grad_loss=None, name=None, tape=None):
            """DPOptimizer's training op for the per-example `loss` ([B]); `tape` is not
            used (graph mode) and `grad_loss` must be None."""
            return self._train_op(loss, var_list, grad_loss=grad_loss, name=name)

        def _train_op(self, loss, var_list, regularization=None, grad_loss=None,
                      name=None):
            self._dp.optimizer.added_gradients = _regularization_gradients(
                regularization, var_list)
            before = set(map(id, tf.compat.v1.global_variables()))
            train_op = self._dp.minimize(loss, var_list=var_list, grad_loss=grad_loss,
                                         name=name)
            # the accumulator's and the adaptive clip's variables, which Keras does not
            # initialize
            made = [v for v in tf.compat.v1.global_variables() if id(v) not in before]
            if made:
                tf.compat.v1.keras.backend.get_session().run(
                    tf.compat.v1.variables_initializer(made))
            return train_op

        def get_updates(self, loss, params):
            """The training ops of a fit step (tf_keras' v1 loop): the DP step of the
            per-example loss behind `loss` (`model.total_loss`: of reduction NONE [B], or
            the default reduction's scalar mean), plus the unclipped gradient of its
            terms that read no example (weight regularizers; `_dp.keras_loss`)."""
            split = keras_loss.split_loss(loss)
            return [self._train_op(split.per_example, params, split.data_independent)]

        def get_gradients(self, loss, params):
            """The clipped, noised mean gradient of `loss` (as in `get_updates`) for
            `params` (one batch: without gradient accumulation)."""
            if self._dp.gradient_accumulation_steps > 1:
                raise _context.error(
                    ValueError, "get_gradients computes one batch's gradient, but "
                    f"gradient_accumulation_steps is {self._dp.gradient_accumulation_steps}: "
                    "use get_updates (as model.fit does), which applies every k-th run.")
            split = keras_loss.split_loss(loss)
            pairs = self._dp.compute_gradients(split.per_example, var_list=params)
            added = _regularization_gradients(split.data_independent, params)
            return [_plus(g, added.get(id(x))) for g, x in pairs]

    DPOptimizerClass.__name__ = f"DPKeras{cls.__name__}Optimizer"
    DPOptimizerClass.__qualname__ = DPOptimizerClass.__name__
    return DPOptimizerClass


DPKerasSGDOptimizer = make_keras_optimizer_class(tf_keras.optimizers.legacy.SGD)
DPKerasAdamOptimizer = make_keras_optimizer_class(tf_keras.optimizers.legacy.Adam)
DPKerasAdagradOptimizer = make_keras_optimizer_class(tf_keras.optimizers.legacy.Adagrad)

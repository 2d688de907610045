"""DP-SGD for tf_keras' `model.fit`, under TensorFlow Privacy's names.

`DPKerasSGDOptimizer`, `DPKerasAdamOptimizer` and `DPKerasAdagradOptimizer` are
tf_keras' legacy SGD, Adam and Adagrad with TensorFlow Privacy 0.9.0's arguments
(`l2_norm_clip`, `noise_multiplier`, `num_microbatches`,
`gradient_accumulation_steps`, then the wrapped optimizer's own); moving from TensorFlow
Privacy is one import. `make_keras_optimizer_class(cls)` makes one for any other
`tf_keras.optimizers.legacy.Optimizer` subclass.

In graph mode (`tf.compat.v1.disable_eager_execution()`) tf_keras' training loop calls
`get_updates(loss, params)` with the loss of `model.compile(loss=...)`; with a loss of
`reduction=tf_keras.losses.Reduction.NONE` that is the per-example loss [B]. The step
is `pertower.DPOptimizer`'s (its module docstring): the clipped sum, noised, divided,
then applied by the Keras optimizer's own `apply_gradients`, so the arithmetic and the
privacy accounting (`pertower.compute_epsilon`) are the same; pertower's own options
(`clipping`, `expected_batch_size`, `adaptive_clipping`, `seed`) are keyword arguments.
As with TensorFlow Privacy, Keras then reports that loss as it is: `history['loss']`
and `evaluate` hold per-example values, not their mean, and a last batch smaller than
the others fails in Keras' averaging (plain tf_keras too): use a batch size dividing the
number of examples.

In TensorFlow 2's default mode (eager execution on) tf_keras' `fit` traces `train_step`
into a `tf.function` and calls `minimize(loss, var_list, tape=tape)` there with the
same per-example loss [B]; a `tf.function`'s graph is a graph, so the step is the same
DPOptimizer step, built in it (the batch is the dataset iterator's outputs; the tape is
not used). Keras then averages the loss: `history['loss']` is the mean, and a smaller
last batch is fine. `model.compile(run_eagerly=True)` has no graph and is refused.

Example:
  opt = pertower.keras.DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.1,
                                           learning_rate=0.1)
  model.compile(optimizer=opt, loss=tf_keras.losses.SparseCategoricalCrossentropy(
      from_logits=True, reduction=tf_keras.losses.Reduction.NONE))
  model.fit(x, y, batch_size=64, epochs=5)
"""

import dataclasses

import tensorflow as tf
import tf_keras

from pertower import _context
from pertower._dp import clipping as clipping_lib
from pertower._dp import optimizer as dp_optimizer

__all__ = ["make_keras_optimizer_class", "DPKerasSGDOptimizer", "DPKerasAdamOptimizer",
           "DPKerasAdagradOptimizer"]


class _KerasApply(tf.compat.v1.train.Optimizer):
    """The `tf.compat.v1.train.Optimizer` face DPOptimizer wraps: its apply_gradients is
    the Keras optimizer's."""

    def __init__(self, keras_optimizer):
        super().__init__(use_locking=False, name=type(keras_optimizer).__name__)
        self.keras_optimizer = keras_optimizer

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        return self.keras_optimizer.apply_gradients(grads_and_vars, name=name)


def _minimize_in_function(optimizer, loss, var_list, grad_loss, name):
    """TF2's `fit` (eager execution on): `train_step` runs in a `tf.function`, whose
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
    return optimizer._dp.minimize(  # pylint: disable=protected-access
        loss, var_list=var_list, grad_loss=grad_loss, name=name)


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
    it. Graph mode, or TF2's `fit` (a traced `train_step`; not `run_eagerly=True`).

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
            used (pertower differentiates the graph) and `grad_loss` must be None."""
            if tf.compat.v1.executing_eagerly_outside_functions():
                return _minimize_in_function(self, loss, var_list, grad_loss, name)
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
            """The training ops of a fit step (tf_keras' v1 loop): `minimize`'s."""
            return [self.minimize(loss, params)]

        def get_gradients(self, loss, params):
            """The clipped, noised mean gradient of `loss` ([B]) for `params` (one
            batch: without gradient accumulation)."""
            if self._dp.gradient_accumulation_steps > 1:
                raise _context.error(
                    ValueError, "get_gradients computes one batch's gradient, but "
                    f"gradient_accumulation_steps is {self._dp.gradient_accumulation_steps}: "
                    "use get_updates (as model.fit does), which applies every k-th run.")
            pairs = self._dp.compute_gradients(loss, var_list=params)
            return [g for g, _ in pairs]

    DPOptimizerClass.__name__ = f"DPKeras{cls.__name__}Optimizer"
    DPOptimizerClass.__qualname__ = DPOptimizerClass.__name__
    return DPOptimizerClass


DPKerasSGDOptimizer = make_keras_optimizer_class(tf_keras.optimizers.legacy.SGD)
DPKerasAdamOptimizer = make_keras_optimizer_class(tf_keras.optimizers.legacy.Adam)
DPKerasAdagradOptimizer = make_keras_optimizer_class(tf_keras.optimizers.legacy.Adagrad)

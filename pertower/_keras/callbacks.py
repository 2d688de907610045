"""Per-example quantities on the batches tf_keras' `model.fit` trains on (graph mode).

Notation:
    N   training examples, the rows of `x`     B_t the examples of step t's batch
    w_t the weights step t starts from          η_t its learning rate
    g_i(w) example i's loss gradient over the trainable weights, n_i,t = ||g_i(w_t)||_2

`ExampleScores` adds to each training step's own `sess.run` the fetch of n_i,t for
i in B_t: `pertower.per_example_norms` of the per-example loss the DP step reads from
`model.total_loss` (`_keras.loss`: Keras' default or NONE reduction, weight
regularizers left out). The norms read the step's own activations, no second forward
pass, and a weight a rule covers needs no per-example gradient (`pertower.explain`).
Per example it keeps

    self_influence_i = sum_{t : i in B_t} η_t n_i,t^2

the idealized TracIn of Pruthi et al. 2020 ("Estimating Training Data Influence by
Tracing Gradient Descent", arXiv 2002.08484) with z' = z, summed over the steps that
trained on i: examples the model keeps struggling with score high, mislabelled ones
first (the paper ranks self-influence to find them).

The fetches go through tf_keras' v1 `GraphExecutionFunction.fetches` and
`fetch_callbacks` (its comment: "A Callback can use this to register a function with
access to the output values for a fetch it added"). An example is told by its input row:
each fetched row is looked up among the rows of `x` (distinct, by a 128-bit digest), so
shuffled arrays, `PoissonSequence` and Keras' prefetching threads all key it right.
"""

import functools
import hashlib

import numpy as np
import tensorflow as tf
import tf_keras

from pertower import _context
from pertower import _tf
from pertower._api import norms as norms_api
from pertower._keras import loss as keras_loss

__all__ = ["ExampleScores"]


def _digest(rows):
    """[b] digests of the b rows of a list of arrays [b, ...] (one per model input)."""
    return [hashlib.blake2b(b"".join(np.ascontiguousarray(a[i]).tobytes() for a in rows),
                            digest_size=16).digest() for i in range(len(rows[0]))]


def _learning_rate(optimizer):
    """η_t as a scalar tensor read in the step's run: the optimizer's `learning_rate`
    (a schedule evaluated at its `iterations`)."""
    if optimizer.get_config().get("decay", 0.0):
        raise _context.error(
            ValueError, "the optimizer has a legacy `decay`, which ExampleScores does not "
            "read: pass `learning_rate=` or use a "
            "tf_keras.optimizers.schedules.LearningRateSchedule.")
    rate = optimizer.learning_rate
    if isinstance(rate, tf_keras.optimizers.schedules.LearningRateSchedule):
        rate = rate(optimizer.iterations)
    return tf.cast(tf.convert_to_tensor(rate), tf.float64)


class ExampleScores(tf_keras.callbacks.Callback):
    """A `model.fit` callback: each trained example's gradient norm and TracIn
    self-influence, keyed by its index in `x` (module docstring).

    Args:
      x: the training inputs given to `fit` (or to `PoissonSequence`), a NumPy array
        [N, ...] or a list of them (one per model input), with distinct rows.
      learning_rate: None to read η_t from the model's optimizer at every step, or a
        number to use for every step (1.0: the sum of squared norms).

    Attributes (NumPy arrays over the N examples, accumulated over every `fit` call):
      self_influence: [N], sum over the steps that trained on i of η_t n_i,t^2.
      times_seen: [N], the number of those steps.
      last_norms: [N], n_i,t at the last of them (NaN before any).
      last_step: (indices [b], norms [b], η) of the last step (b = 0 for an empty batch).

    Raises (when `fit` starts, or here):
      TypeError, ValueError: `x` is not arrays sharing N, its rows repeat, the model's
        loss is not a mean of per-example losses (`_keras.loss`: reduction SUM,
        activity terms), the optimizer has a legacy `decay` and no `learning_rate` is
        given, or a trained row is not a row of `x`.

    Example:
      scores = pertower.keras.ExampleScores(x_train)
      model.fit(pertower.keras.PoissonSequence(x_train, y_train, q), epochs=5,
                callbacks=[scores])
      suspects = scores.top(20)            # likely mislabelled first
    """

    @_context.public("ExampleScores")
    def __init__(self, x, learning_rate=None):
        super().__init__()
        arrays = [x] if isinstance(x, np.ndarray) else x
        if not (isinstance(arrays, (list, tuple)) and arrays and all(
                isinstance(a, np.ndarray) and a.ndim >= 1 for a in arrays)):
            raise _context.error(TypeError, "`x` must be the NumPy array [N, ...] of the "
                                 "training inputs, or a list of them (one per model "
                                 f"input), but received {type(x).__name__}.")
        if len({a.shape[0] for a in arrays}) != 1:
            raise _context.error(ValueError, "the arrays of `x` must share N, but have "
                                 f"{[a.shape[0] for a in arrays]} rows.")
        self._x = list(arrays)
        self._fixed_rate = (None if learning_rate is None else float(learning_rate))
        N = arrays[0].shape[0]
        self.self_influence = np.zeros(N)
        self.times_seen = np.zeros(N, np.int64)
        self.last_norms = np.full(N, np.nan)
        self.last_step = (np.zeros(0, np.int64), np.zeros(0), 0.0)
        self._index = None                 # {digest of a row: its index}, per input dtype
        self._function, self._fetches, self._received = None, (), {}
        self._built = (None, None)         # (total_loss, its (norms, rows, η) tensors)

    def top(self, k):
        """[k]: the indices of the k largest self-influences, largest first."""
        return np.argsort(-self.self_influence, kind="stable")[:k]

    def _row_index(self, dtypes):
        """{digest: i} over x's rows cast to the model inputs' dtypes, built once."""
        if self._index is None:
            cast = [a.astype(d.as_numpy_dtype, copy=False) for a, d in zip(self._x, dtypes)]
            digests = _digest(cast)
            self._index = dict(zip(digests, range(len(digests))))
            if len(self._index) < len(digests):
                seen = {}
                first, second = next((seen[d], i) for i, d in enumerate(digests)
                                     if seen.setdefault(d, i) != i)
                raise _context.error(
                    ValueError, f"`x` has equal rows ({first} and {second}), so the "
                    "examples' scores could not be told apart: drop the repeats.")
        return self._index

    def _tensors(self):
        """(norms [B], the input rows, η) of the model's current training loss."""
        model = self.model
        if self._built[0] is not model.total_loss:
            if len(model.inputs) != len(self._x):
                raise _context.error(
                    ValueError, f"the model has {len(model.inputs)} inputs but `x` "
                    f"{len(self._x)} arrays: pass one array per model input.")
            with model.total_loss.graph.as_default(), tf.name_scope("example_scores"):
                # [B]: Keras' default or NONE reduction (weight regularizers left out)
                loss = keras_loss.split_loss(model.total_loss, "model.total_loss").per_example
                norms = norms_api.per_example_norms(loss, model.trainable_weights)
                rate = (tf.constant(self._fixed_rate, tf.float64)
                        if self._fixed_rate is not None else
                        _learning_rate(model.optimizer))
                rows = [tf.identity(x) for x in model.inputs]
            self._built = (model.total_loss, (norms, rows, rate))
        return self._built[1]

    def on_train_begin(self, logs=None):
        self._function = _tf.keras_train_function(self.model)   # the optimizer's too
        with _context.public_call("ExampleScores"):
            norms, rows, rate = self._tensors()
            self._row_index([x.dtype for x in self.model.inputs])
        self._fetches = (norms, *rows, rate)
        self._received = {}
        for tensor in self._fetches:
            self._function.fetches.append(tensor)
            self._function.fetch_callbacks[tensor] = functools.partial(
                self._received.__setitem__, id(tensor))

    def on_train_batch_end(self, batch, logs=None):
        if len(self._received) < len(self._fetches):
            return              # the step ran without the fetches (not a training step)
        norms, *rows, rate = (self._received.pop(id(t)) for t in self._fetches)
        index = self._row_index(None)
        try:
            indices = np.array([index[d] for d in _digest(rows)], np.int64)     # [b]
        except KeyError:
            self.on_train_end()
            with _context.public_call("ExampleScores"):
                raise _context.error(
                    ValueError, "a trained example's input is not a row of `x`: pass "
                    "ExampleScores the inputs `fit` trains on.") from None
        norms = np.asarray(norms, np.float64)                                   # [b]
        rate = float(rate)
        # an index appears once per batch (rows are distinct, batches do not repeat)
        self.self_influence[indices] += rate * norms ** 2
        self.times_seen[indices] += 1
        self.last_norms[indices] = norms
        self.last_step = (indices, norms, rate)

    def on_train_end(self, logs=None):
        if self._function is None:
            return
        ours = set(map(id, self._fetches))
        self._function.fetches[:] = [t for t in self._function.fetches if id(t) not in ours]
        for tensor in self._fetches:
            self._function.fetch_callbacks.pop(tensor, None)
        self._function, self._fetches = None, ()

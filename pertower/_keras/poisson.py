"""Poisson batches for tf_keras' `model.fit`: the sampling `pertower.compute_epsilon`
assumes.

Notation:
    N   training examples      q   sampling_probability
    T   steps of one epoch     B_t the size of step t's batch, Binomial(N, q)

`PoissonSequence` is a `tf_keras.utils.Sequence` whose every batch is a fresh Poisson
sample (`_dp.sampling.poisson_indices`, the sampler of `pertower.poisson_batches`):
each example joins each step independently with probability q, so B_t varies and may
be 0. `model.fit(PoissonSequence(x, y, q), epochs=E)` with a DP optimizer of
`expected_batch_size=q * N` takes E * T steps, T = round(1 / q) (E * N / (q N) steps,
E epochs in expectation), each the subsampled Gaussian mechanism whose privacy
`pertower.compute_epsilon(E * T, noise_multiplier, q, delta)` accounts (Abadi et al.
2016, arXiv 1607.00133). An empty batch is a noise-only step: the noised sum (the noise
alone) divided by q * N. Compile with the loss's default reduction: Keras averages its
scalar over the steps (an empty batch's is 0), whereas with reduction NONE tf_keras'
own averaging of the per-example values fails on batches of different sizes
(`training_utils_v1.MetricsAggregator`, plain tf_keras too).

The batch index `idx` Keras asks for does not choose the batch: every call draws a new
one, so Keras' `shuffle` and its prefetching threads change nothing. With a `seed` the
draws are one stream (repeatable when one thread draws: `workers` <= 1, the default);
worker processes (`use_multiprocessing=True`) would each copy it, so they are refused
with a seed and draw from fresh entropy without one.
"""

import os
import threading

import numpy as np
import tf_keras

from pertower import _checks
from pertower import _context
from pertower._dp import sampling

__all__ = ["PoissonSequence"]


def _arrays(value, argument, allow_none=False):
    """`value` (an array, a list or tuple of arrays, or None) as a list of arrays."""
    if value is None and allow_none:
        return []
    arrays = [value] if isinstance(value, np.ndarray) else value
    if not (isinstance(arrays, (list, tuple)) and arrays
            and all(isinstance(a, np.ndarray) and a.ndim >= 1 for a in arrays)):
        raise _context.error(
            TypeError, f"`{argument}` must be a NumPy array [N, ...] or a list or tuple "
            f"of them (one per model input or output), but received {type(value).__name__}.")
    return list(arrays)


class PoissonSequence(tf_keras.utils.Sequence):
    """A `tf_keras.utils.Sequence` of Poisson batches for `model.fit` (module docstring).

    Args:
      x: the inputs, a NumPy array [N, ...] or a list or tuple of them (one per input).
      y: the targets, the same, or None.
      sampling_probability: q in (0, 1]; the expected batch size is q * N.
      steps_per_epoch: T, None for round(1 / q) (one pass over N in expectation).
      seed: an int making the batches repeatable (one drawing thread), or None.

    Attributes:
      expected_batch_size: q * N, the DP optimizer's `expected_batch_size`.
      num_examples: N.

    Raises:
      TypeError, ValueError: `x` or `y` is not arrays sharing N, q is outside (0, 1],
        `steps_per_epoch` is not a positive int.

    Example:
      q = 64 / len(x_train)
      train = pertower.keras.PoissonSequence(x_train, y_train, q, seed=0)
      optimizer = pertower.keras.DPKerasSGDOptimizer(
          l2_norm_clip=1.0, noise_multiplier=1.1, learning_rate=0.1,
          expected_batch_size=train.expected_batch_size)
      model.compile(optimizer=optimizer, loss=...)
      model.fit(train, epochs=5)
      eps = pertower.compute_epsilon(5 * len(train), 1.1, q, 1e-5)
    """

    @_context.public("PoissonSequence")
    def __init__(self, x, y=None, sampling_probability=None, steps_per_epoch=None,
                 seed=None):
        super().__init__()
        self._x, self._y = _arrays(x, "x"), _arrays(y, "y", allow_none=True)
        self._single_x, self._single_y = isinstance(x, np.ndarray), isinstance(y, np.ndarray)
        sizes = [a.shape[0] for a in self._x + self._y]
        if len(set(sizes)) != 1:
            raise _context.error(ValueError, "`x` and `y` must share their first "
                                 f"dimension N (the examples), but have {sizes}.")
        self.num_examples = sizes[0]
        if sampling_probability is None:
            raise _context.error(TypeError, "`sampling_probability` (q, each example's "
                                 "chance to join a step) is required.")
        self._q = _checks.real_number(sampling_probability, "sampling_probability", 0.0,
                                      1.0, low_open=True)
        self._steps = _checks.positive_int(
            int(round(1.0 / self._q)) if steps_per_epoch is None else steps_per_epoch,
            "steps_per_epoch")
        self._seed = _checks.optional_seed(seed)
        self._rng = np.random.default_rng(self._seed)
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self.expected_batch_size = self._q * self.num_examples

    @property
    def sampling_probability(self):
        """q."""
        return self._q

    def __len__(self):
        return self._steps

    def _indices(self):
        """[B_t]: a fresh Poisson batch from the one stream (per process)."""
        with self._lock:
            if os.getpid() != self._pid:   # a worker process: its own stream
                if self._seed is not None:
                    with _context.public_call("PoissonSequence"):
                        raise _context.error(
                            RuntimeError, "with a `seed`, every worker process would "
                            "repeat the same batches. Pass use_multiprocessing=False to fit "
                            "(the default), or leave `seed` None.")
                self._rng, self._pid = np.random.default_rng(), os.getpid()
            return sampling.poisson_indices(self.num_examples, self._q, self._rng)

    def __getitem__(self, idx):
        """(x, y) of a new Poisson batch, [B_t, ...] each (x alone without y); `idx` is
        not used (every step is an independent sample)."""
        index = self._indices()                                            # [B_t]
        x = [a[index] for a in self._x]
        x = x[0] if self._single_x else x
        if not self._y:
            return x
        y = [a[index] for a in self._y]
        return x, (y[0] if self._single_y else y)

    def __getstate__(self):   # the lock stays behind (worker processes, pickling)
        state = dict(self.__dict__)
        del state["_lock"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

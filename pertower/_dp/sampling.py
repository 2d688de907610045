"""Poisson sampling: the batches DP-SGD's accounting assumes.

Notation:
    N   training examples      q   sampling_probability
    T   steps                  B_t the size of batch t, Binomial(N, q)

The subsampled-Gaussian analyses that `compute_epsilon` runs (Abadi et al. 2016, arXiv
1607.00133; Mironov, Talwar and Zhang 2019, arXiv 1908.10530) assume each example joins
each batch independently with probability q: the batch size varies, and may be 0.
`DPOptimizer(max_batch_size=N)` makes N a capacity (towers are built for N examples,
each fed batch padded); `poisson_capacity` gives the N exceeded with at most a stated
probability:

    P(B_t > N) = sum_{k > N} C(N_examples, k) q^k (1 - q)^(N_examples - k).
"""

import math

import numpy as np
import tensorflow as tf

from pertower import _checks
from pertower import _context
from pertower._towers import slicing

__all__ = ["poisson_batches", "poisson_capacity", "poisson_indices", "checked_capacity",
           "within_capacity"]


@_context.public("poisson_batches")
def poisson_batches(arrays, sampling_probability, steps=None, seed=None, splits=1):
    """Batches in which every example takes part independently with probability q.

    Each step keeps the examples whose uniform draw is below q (in their order), the
    sampling `pertower.compute_epsilon` assumes; feed the batches to a
    `pertower.DPOptimizer`, best with `expected_batch_size=q * N`.

    Args:
      arrays: one NumPy array [N, ...], or a tuple or list of arrays sharing N (images,
        labels, ...).
      sampling_probability: q in (0, 1].
      steps: the number of batches T; None for round(1 / q), one epoch in expectation.
      seed: an int making the batches repeatable, or None.
      splits: 1 (default) yields each batch; k > 1 yields each batch cut into k
        consecutive pieces (some possibly empty), a list, for a `DPOptimizer` with
        `gradient_accumulation_steps=k`: one Poisson batch per noised step, fed over k
        `sess.run` calls.

    Yields:
      Per step, the batch: a tuple of arrays [B_t, ...] (one array when `arrays` is
      one), or with splits=k a list of k such batches.

    Example:
      for images, labels in pertower.poisson_batches((x_train, y_train), 256 / 60000,
                                                     seed=0):
          sess.run(train_op, {x: images, y: labels})   # B_t examples, 0 included
    """
    single = isinstance(arrays, np.ndarray)
    arrays = [arrays] if single else list(arrays) if isinstance(arrays, (tuple, list)) \
        else None
    if not arrays or not all(isinstance(a, np.ndarray) and a.ndim >= 1 for a in arrays):
        raise _context.error(TypeError, "`arrays` must be a NumPy array [N, ...] or a "
                             "tuple or list of them, sharing N.")
    N = arrays[0].shape[0]
    if any(a.shape[0] != N for a in arrays):
        raise _context.error(ValueError, "`arrays` must share their first dimension N, "
                             f"but have {[a.shape[0] for a in arrays]}.")
    q = _checks.real_number(sampling_probability, "sampling_probability", 0.0, 1.0,
                            low_open=True)
    steps = int(round(1.0 / q)) if steps is None else steps
    steps = _checks.positive_int(steps, "steps", low=0)
    splits = _checks.positive_int(splits, "splits")
    seed = _checks.optional_seed(seed)
    return _batches(arrays, single, q, int(steps), seed, splits)


def poisson_indices(num_examples, sampling_probability, rng):
    """[B_t]: one Poisson batch, the indices (ascending) of the examples whose uniform
    draw from the `np.random.Generator` `rng` is below q; B_t ~ Binomial(N, q), 0
    included. The one sampler of `poisson_batches` and `pertower.keras.PoissonSequence`.
    """
    return np.flatnonzero(rng.random(num_examples) < sampling_probability)


def _batches(arrays, single, q, steps, seed, splits):
    rng = np.random.default_rng(seed)
    N = arrays[0].shape[0]
    for _ in range(steps):
        index = poisson_indices(N, q, rng)                                 # [B_t]
        pieces = [tuple(a[part] for a in arrays) for part in np.array_split(index, splits)]
        pieces = [p[0] if single else p for p in pieces]
        yield pieces[0] if splits == 1 else pieces


@_context.public("poisson_capacity")
def poisson_capacity(num_examples, sampling_probability, overflow=1e-6):
    """The smallest batch capacity N with P(Binomial(num_examples, q) > N) <= overflow.

    For `DPOptimizer.minimize(..., max_batch_size=N)`: a batch of `poisson_batches`
    exceeds N, and its step fails at run time, with probability at most `overflow`.

    Args:
      num_examples: the training examples, an int >= 0.
      sampling_probability: q in (0, 1].
      overflow: the largest probability of a batch above N, in (0, 1).

    Returns:
      N, an int in [0, num_examples] (at least 1).

    Example:
      N = pertower.poisson_capacity(60000, 256 / 60000)   # 256 expected: N = 335
    """
    num_examples = _checks.positive_int(num_examples, "num_examples", low=0)
    q = _checks.real_number(sampling_probability, "sampling_probability", 0.0, 1.0,
                            low_open=True)
    overflow = _checks.real_number(overflow, "overflow", 0.0, 1.0, low_open=True,
                                   high_open=True)
    n = int(num_examples)
    if q == 1.0 or n == 0:
        return max(n, 1)
    k = np.arange(n + 1)                                                   # [n + 1]
    log_factorial = np.array([math.lgamma(v + 1) for v in range(n + 1)])  # [n + 1]
    log_pmf = (log_factorial[n] - log_factorial - log_factorial[::-1]
               + k * math.log(q) + (n - k) * math.log1p(-q))               # [n + 1]
    # tail[j] = P(B > j): the sum of the pmf above j, summed from the top
    pmf = np.exp(log_pmf)                                                  # [n + 1]
    tail = np.concatenate([np.cumsum(pmf[::-1])[::-1][1:], [0.0]])        # [n + 1]
    return max(int(np.argmax(tail <= overflow)), 1)


def checked_capacity(max_batch_size, batch_size, num_microbatches):
    """DPOptimizer's `max_batch_size`, checked: None, or a positive int (not with
    `batch_size` or `num_microbatches`)."""
    if max_batch_size is None:
        return None
    capacity = _checks.positive_int(max_batch_size, "max_batch_size")
    if batch_size is not None or num_microbatches is not None:
        raise _context.error(
            ValueError, "`max_batch_size` is for batches of varying size (Poisson "
            f"batches), one microbatch per example; but batch_size={batch_size!r} and "
            f"num_microbatches={num_microbatches!r} were given. Pass either "
            "max_batch_size or batch_size, and leave num_microbatches None.")
    return capacity


def within_capacity(gradients, loss, capacity):
    """`gradients` after a run-time check that `loss`, [b], has b <= `capacity` (the
    towers' message); as they are when `capacity` is None."""
    if capacity is None:
        return gradients
    check = slicing.capacity_check(loss, 0, capacity, "the DP step was")
    with tf.control_dependencies([check]):
        return [tf.identity(g) for g in gradients]

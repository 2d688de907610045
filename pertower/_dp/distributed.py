"""DP-SGD across TensorFlow workers: between-graph replication with parameter servers.

Notation:
    W    workers (total_num_replicas)        R   replicas_to_aggregate, pushes per step
    s_w  worker w's clipped sum, sum_i clip(g_i) over its batch (as `DPOptimizer`)
    b_w  the number of examples in worker w's batch
    C    l2_norm_clip                        σ   noise_multiplier
    N    the pushes a step's accumulators averaged (N >= R; N = R when R = W)

One synchronous step is DP-SGD's step (`_dp.optimizer`) on the union of the W batches,

    gradient = (sum_w s_w + N(0, σ²C² I)) / B,     B = sum_w b_w  (or a fixed expected B)

with the noise added once. Each worker pushes s_w and b_w (b_w as the "gradient" of a
scalar counter variable) into the `ConditionalAccumulator`s of a
`tf.compat.v1.train.SyncReplicasOptimizer`. A take returns (1/N) sum of the N pushes,
so the chief multiplies by R, adds the noise (chief mode) and divides by R times the
averaged count, i.e. by sum_w b_w. Were N > R (only when R < W and pushes race the
take), the sum the noise covers is scaled by R/N <= 1: the noise is never short.
Split mode: each push adds N(0, σ²C²/R I) itself (its keys fold in the task index:
`_dp.noise.GaussianNoise`'s stream, the variables being shared) and the chief adds
nothing; refused for R < W, where fewer shares than workers would be aggregated.
Another mechanism (`mechanism=`, `_dp.mechanism`, e.g. `BandedMFNoise`; DP-FTRL's tree
with a `DPFTRLOptimizer` as the optimizer): the chief adds its release in place of
N(0, σ²C² I), once per global step.
"""

import math
import numbers

import tensorflow as tf

from pertower import _checks
from pertower import _context
from pertower import _tf
from pertower._dp import ftrl
from pertower._dp import mechanism as mechanism_lib
from pertower._dp import noise as noise_lib
from pertower._dp import optimizer as dp_optimizer
from pertower._dp import wrapper

__all__ = ["DPSyncReplicasOptimizer"]

_NOISE_MODES = ("chief", "split")


class _ClippedSum(dp_optimizer.DPOptimizer):
    """`DPOptimizer` handing on the clipped sum, noised by its own noise_multiplier (0 in
    chief mode), and recording the count, [] int32."""

    count = None

    def _release(self, clipped_sum, count, stddevs):
        self.count = count
        return self._noise.add(clipped_sum, stddevs)


class _Release(wrapper.WrappedOptimizer):
    """What SyncReplicasOptimizer applies the averaged pushes with: the DP gradient."""

    def __init__(self, owner):
        self._owner = owner

    optimizer = property(lambda self: self._owner.optimizer)

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        owner = self._owner
        pairs = list(grads_and_vars)
        counter = owner._counter  # pylint: disable=protected-access
        (mean_count,) = [g for g, v in pairs if v is counter]    # [], the averaged b_w
        pairs = [(g, v) for g, v in pairs if v is not counter]
        R = owner.replicas_to_aggregate
        with tf.name_scope("dp_release"):
            sums = [g * tf.cast(R, g.dtype) for g, _ in pairs]      # sum_w s_w, [*x.shape]
            if owner.noise == "chief":
                stddev = owner.noise_multiplier * owner.l2_norm_clip    # σC, once
                sums = owner._chief_noise.add(  # pylint: disable=protected-access
                    sums, [stddev] * len(sums))
            if owner.expected_global_batch is None:
                batch = tf.cast(R, mean_count.dtype) * mean_count   # sum_w b_w
            else:
                batch = tf.constant(owner.expected_global_batch, mean_count.dtype)
            gradients = [s / tf.cast(batch, s.dtype) for s in sums]
        return owner.optimizer.apply_gradients(
            list(zip(gradients, [v for _, v in pairs])), global_step=global_step, name=name)


class DPSyncReplicasOptimizer(wrapper.WrappedOptimizer):
    """Synchronous DP-SGD over the workers of a TensorFlow cluster, the noise added once.

    For between-graph replication (`tf.compat.v1.train.ClusterSpec`,
    `replica_device_setter` with parameter servers): each worker builds the same graph
    with this optimizer and pushes its clipped sum and count; the chief noises, divides
    and applies (the module docstring). One step equals `DPOptimizer`'s step on the
    union of the workers' batches: `pertower.compute_epsilon` with the global batch's q
    and the number of global steps (each worker sampling its shard with the same q).
    With noise="chief" the chief and the parameter servers see the un-noised sums; with
    noise="split" no task does, but each push carries only 1/sqrt(R) of the noise.

    Args:
      optimizer, l2_norm_clip, method: as in `pertower.DPOptimizer` (flat clipping).
        A `pertower.DPFTRLOptimizer` (same l2_norm_clip and noise_multiplier; chief
        mode, its own seed) makes the step DP-FTRL's: the chief adds its tree's noise.
      noise_multiplier: σ >= 0; the noise on the sum has stddev σ * C per entry.
      replicas_to_aggregate: R, the pushes aggregated per step (as SyncReplicasOptimizer).
      total_num_replicas: W, the number of workers (default R).
      noise: "chief" (default): the chief draws N(0, σ²C²) once per step. "split": each
        push adds N(0, σ²C²/R); refused when R < W.
      seed: an int making the noise repeatable (chief mode: as `DPOptimizer`'s seed, on
        the chief; split mode: each worker's keys also fold in its task_index), or None.
      task_index: this worker's index in [0, W); needed with noise="split".
      expected_global_batch: None (default) divides by the sum of the pushed counts; a
        number (q * dataset size with Poisson sampling) divides by it instead.
      name: the SyncReplicasOptimizer's name.
      mechanism: None (Gaussian noise), or a noise mechanism as in
        `pertower.DPOptimizer` (e.g. `pertower.BandedMFNoise`), which the chief adds
        once per global step in place of N(0, σ²C² I); chief mode, seed None.

    Example (on every worker; is_chief = task_index == 0):
      with tf.compat.v1.device(tf.compat.v1.train.replica_device_setter(
              worker_device=f"/job:worker/task:{task_index}", cluster=cluster)):
          loss = ...                                                    # [B]
          global_step = tf.compat.v1.train.get_or_create_global_step()
          dp = pertower.DPSyncReplicasOptimizer(
              tf.compat.v1.train.GradientDescentOptimizer(0.5), l2_norm_clip=1.0,
              noise_multiplier=1.1, replicas_to_aggregate=2, total_num_replicas=2)
          train_op = dp.minimize(loss, global_step=global_step)
      hook = dp.make_session_run_hook(is_chief)
      with tf.compat.v1.train.MonitoredTrainingSession(
              master=server.target, is_chief=is_chief, hooks=[hook]) as sess:
          sess.run(train_op, feed)
    """

    @_context.public("DPSyncReplicasOptimizer")
    def __init__(self, optimizer, l2_norm_clip, noise_multiplier, replicas_to_aggregate,
                 total_num_replicas=None, noise="chief", seed=None, task_index=None,
                 expected_global_batch=None, method="auto", name="dp_sync_replicas",
                 mechanism=None):
        R = _checks.positive_int(replicas_to_aggregate, "replicas_to_aggregate")
        W = R if total_num_replicas is None else _checks.positive_int(
            total_num_replicas, "total_num_replicas")
        if noise not in _NOISE_MODES:
            raise _context.error(ValueError, f"`noise` must be \"chief\" or \"split\", but "
                                 f"received {noise!r}.")
        if noise == "split" and R < W:
            raise _context.error(
                ValueError, f"noise=\"split\" needs every worker's push in every step, but "
                f"`replicas_to_aggregate` ({R}) < `total_num_replicas` ({W}): a step of R "
                "pushes would carry only R/W of the noise. Set replicas_to_aggregate = "
                "total_num_replicas, or use noise=\"chief\".")
        if noise == "split" and (task_index is None or isinstance(task_index, bool)
                                 or not isinstance(task_index, numbers.Integral)
                                 or not 0 <= task_index < W):
            raise _context.error(
                ValueError, f"noise=\"split\" needs `task_index`, this worker's index "
                f"in [0, {W}) (it seeds the worker's own noise), but received "
                f"{task_index!r}.")
        seed = _checks.optional_seed(seed)
        if isinstance(optimizer, ftrl.DPFTRLOptimizer):
            if (noise, seed, mechanism, optimizer.l2_norm_clip, optimizer.noise_multiplier,
                    optimizer.num_microbatches) != (
                    "chief", None, None, l2_norm_clip, noise_multiplier, None):
                raise _context.error(
                    ValueError, "with a DPFTRLOptimizer as `optimizer`, pass its "
                    f"l2_norm_clip ({optimizer.l2_norm_clip}) and noise_multiplier "
                    f"({optimizer.noise_multiplier}), noise=\"chief\", seed=None and "
                    "mechanism=None (the tree is the DPFTRLOptimizer's); received "
                    f"{l2_norm_clip!r}, {noise_multiplier!r}, {noise!r}, {seed!r} and "
                    f"{mechanism!r:.60} (and its num_microbatches must be None: "
                    f"{optimizer.num_microbatches!r}).")
            mechanism, optimizer = optimizer.tree, optimizer.optimizer
        if mechanism is not None and noise == "split":
            raise _context.error(
                ValueError, "noise=\"split\" adds independent Gaussian shares on the "
                f"workers, but `mechanism` ({type(mechanism).__name__}) was given: a "
                "correlated mechanism is added once, by the chief. Use noise=\"chief\", or "
                "mechanism=None.")
        if expected_global_batch is not None:
            expected_global_batch = _checks.real_number(
                expected_global_batch, "expected_global_batch", 0.0, math.inf,
                low_open=True, high_open=True, wanted="a positive number")
        sigma = _checks.real_number(noise_multiplier, "noise_multiplier", 0.0, math.inf,
                                    high_open=True, wanted="a non-negative number")
        # the worker's clipping (and its share of the noise in split mode)
        self._clipper = _ClippedSum(
            optimizer, l2_norm_clip, sigma / math.sqrt(R) if noise == "split" else 0.0,
            method=method, mechanism=(noise_lib.GaussianNoise(seed, stream=task_index + 1)
                                      if noise == "split" else None))
        # the chief's one draw (or its mechanism's release) per step
        self._chief_noise = (noise_lib.GaussianNoise(seed) if mechanism is None else
                             mechanism_lib.check_mechanism(mechanism, seed,
                                                           self._clipper.clipping_options))
        self._noise_multiplier = sigma
        self._replicas_to_aggregate, self._total_num_replicas = R, W
        self._noise, self._seed, self._task_index = noise, seed, task_index
        self._expected_global_batch = expected_global_batch
        self._sync = tf.compat.v1.train.SyncReplicasOptimizer(
            _Release(self), replicas_to_aggregate=R, total_num_replicas=W, name=name)
        self._counter = None   # the scalar variable whose "gradient" carries b_w
        self._count = None     # [] this worker's b_w, from compute_gradients

    optimizer = property(lambda self: self._clipper.optimizer,
                         doc="The wrapped `tf.compat.v1.train.Optimizer`.")
    l2_norm_clip = property(lambda self: self._clipper.l2_norm_clip)
    noise_multiplier = property(lambda self: self._noise_multiplier)
    replicas_to_aggregate = property(lambda self: self._replicas_to_aggregate)
    total_num_replicas = property(lambda self: self._total_num_replicas)
    noise = property(lambda self: self._noise)
    seed = property(lambda self: self._seed)
    task_index = property(lambda self: self._task_index)
    expected_global_batch = property(lambda self: self._expected_global_batch)
    sync_optimizer = property(lambda self: self._sync,
                              doc="The `SyncReplicasOptimizer` holding the accumulators.")

    @_context.public("DPSyncReplicasOptimizer.compute_gradients")
    def compute_gradients(self, loss, var_list=None, batch=None, batch_size=None,
                          gate_gradients=wrapper.GATE_OP, aggregation_method=None,
                          colocate_gradients_with_ops=False, grad_loss=None,
                          batch_axis=None, max_batch_size=None):
        """This worker's pushes: (sum_i clip(g_i) [+ N(0, σ²C²/R) in split mode],
        variable) pairs, [*x.shape] each; arguments as `pertower.DPOptimizer`'s
        (`max_batch_size` is this worker's capacity). Its example count goes with them
        (`apply_gradients`; read it as `count`)."""
        # DPOptimizer's body without its public-name wrapper: errors name this method
        pairs = dp_optimizer.DPOptimizer.compute_gradients.__wrapped__(
            self._clipper, loss, var_list=var_list, batch=batch, batch_size=batch_size,
            gate_gradients=gate_gradients, aggregation_method=aggregation_method,
            colocate_gradients_with_ops=colocate_gradients_with_ops, grad_loss=grad_loss,
            batch_axis=batch_axis, max_batch_size=max_batch_size)
        dtype = next(g.dtype for g, _ in pairs if g is not None)
        if self._counter is None:
            # a variable (on a parameter server under replica_device_setter) that only
            # keys the accumulator of the counts; same name on every worker
            self._counter = tf.compat.v1.Variable(
                tf.zeros([], dtype), trainable=False, name="dp_sync_example_count")
        self._count = tf.cast(self._clipper.count, dtype)
        return pairs

    @property
    def count(self):
        """[] this worker's example count from the last compute_gradients (None before)."""
        return self._count

    @_context.public("DPSyncReplicasOptimizer.apply_gradients")
    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        """Pushes the sums and the count; the worker's train op, as
        `SyncReplicasOptimizer.apply_gradients` (`global_step` required)."""
        if self._count is None:
            raise _context.error(
                RuntimeError, "call compute_gradients first (or minimize): the pushed "
                "sums must be the clipped ones, and their example count goes with them.")
        if global_step is None:
            raise _context.error(ValueError, "`global_step` is required (the accumulators "
                                 "drop stale pushes by it), e.g. "
                                 "tf.compat.v1.train.get_or_create_global_step().")
        pairs = [(g, v) for g, v in grads_and_vars if g is not None]
        train_op = self._sync.apply_gradients(pairs + [(self._count, self._counter)],
                                              global_step=global_step, name=name)
        # The chief's queue runner waits in the accumulators' take; closing the session
        # cancels it, which TF's runner reports as an error in its thread: end quietly.
        runner = self._sync.get_chief_queue_runner()
        quiet = tf.compat.v1.train.QueueRunner(runner.queue, runner.enqueue_ops,
                                               queue_closed_exception_types=(
                                                   tf.errors.OutOfRangeError,
                                                   tf.errors.CancelledError))
        _tf.set_chief_queue_runner(self._sync, quiet)
        return train_op

    def make_session_run_hook(self, is_chief, num_tokens=None):
        """The `SyncReplicasOptimizer` hook (chief: initial tokens and the queue runner
        that takes, noises and applies). `num_tokens` None (default) queues max(0, R - W)
        tokens, so that with R = W the first step too aggregates one push per worker
        (SyncReplicasOptimizer's default, R, lets a fast worker push twice into it)."""
        if num_tokens is None:
            num_tokens = max(0, self._replicas_to_aggregate - self._total_num_replicas)
        return self._sync.make_session_run_hook(is_chief, num_tokens=num_tokens)

    def get_chief_queue_runner(self):
        return self._sync.get_chief_queue_runner()

    def get_init_tokens_op(self, num_tokens=-1):
        return self._sync.get_init_tokens_op(num_tokens)

    def __repr__(self):
        return (f"DPSyncReplicasOptimizer({type(self.optimizer).__name__}, l2_norm_clip="
                f"{self.l2_norm_clip}, noise_multiplier={self._noise_multiplier}, "
                f"replicas_to_aggregate={self._replicas_to_aggregate}, total_num_replicas="
                f"{self._total_num_replicas}, noise={self._noise!r}, seed={self._seed})")

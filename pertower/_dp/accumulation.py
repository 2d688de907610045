"""Large logical batches: clipped sums accumulated over k `sess.run` calls, one noised step.

Notation:
    k   gradient_accumulation_steps     x   one weight
    S_x the clipped sum of weight x over the physical batches run so far in the step
    n   the number of examples (or microbatches) so far; u the unclipped ones

Each run adds its physical batch's clipped sums (and counts) to non-trainable
variables; the k-th run noises the accumulated sum ONCE, divides it, applies it and
zeroes the variables (TensorFlow Privacy's `gradient_accumulation_steps`; Opacus'
BatchMemoryManager). `compute_epsilon` takes q = the logical batch over N and T = the
noised steps.
"""

import dataclasses

import tensorflow as tf

__all__ = ["Accumulator", "PendingStep"]


@dataclasses.dataclass
class PendingStep:
    """What compute_gradients built for apply_gradients to finish."""
    gradients: tuple               # the noised gradients it returned
    accumulator: object = None     # an `Accumulator` (gradient accumulation)
    totals: tuple = None           # this run's (sums, count, unclipped)
    is_last: object = None         # [] bool: the k-th run of a step
    clip_update: object = None     # () -> the scalar new clip norm (adaptive clipping)


class Accumulator:
    """The variables of one accumulated DP step: `sums` S_x ([*x.shape] each), `count`
    n, `unclipped` u, `runs` (int64, the runs since the last noised step)."""

    def __init__(self, var_list, steps, dtype, name="dp_accumulator"):
        self.steps = steps
        with tf.compat.v1.variable_scope(None, default_name=name):
            self.sums = [tf.compat.v1.get_variable(
                f"sum_{k}", shape=x.shape, dtype=x.dtype.base_dtype, trainable=False,
                initializer=tf.compat.v1.zeros_initializer(), use_resource=True)
                for k, x in enumerate(var_list)]
            self.count, self.unclipped = [tf.compat.v1.get_variable(
                n, shape=[], dtype=dtype, trainable=False, use_resource=True,
                initializer=tf.compat.v1.zeros_initializer()) for n in ("count", "unclipped")]
            self.runs = tf.compat.v1.get_variable(
                "runs", shape=[], dtype=tf.int64, trainable=False, use_resource=True,
                initializer=tf.compat.v1.zeros_initializer())
        self.variables = self.sums + [self.count, self.unclipped, self.runs]

    def totals(self, sums, count, unclipped):
        """This run's totals: (S_x + sums, n + count, u + unclipped, is_last), with
        is_last true on the k-th run of a step."""
        sums = [v.read_value() + tf.cast(g, v.dtype) for v, g in zip(self.sums, sums)]
        count = self.count.read_value() + tf.cast(count, self.count.dtype)
        unclipped = self.unclipped.read_value() + tf.cast(unclipped, self.unclipped.dtype)
        is_last = tf.equal((self.runs.read_value() + 1) % self.steps, 0)
        return sums, count, unclipped, is_last

    def finish(self, is_last, totals, apply):
        """The training op: on the k-th run `apply()` then zero the variables, else
        store `totals`; count the run."""

        def on_last():
            with tf.control_dependencies([apply()]):
                zeroed = [v.assign(tf.zeros_like(v)) for v in self.variables[:-1]]
            with tf.control_dependencies(zeroed):
                return tf.constant(True)

        def on_others():
            sums, count, unclipped = totals
            stored = [v.assign(t) for v, t in zip(self.sums + [self.count, self.unclipped],
                                                  list(sums) + [count, unclipped])]
            with tf.control_dependencies(stored):
                return tf.constant(False)

        done = tf.cond(is_last, on_last, on_others)
        with tf.control_dependencies([done]):
            counted = self.runs.assign(tf.math.floormod(self.runs + 1, self.steps))
        return tf.group(done, counted, name="dp_accumulated_step")

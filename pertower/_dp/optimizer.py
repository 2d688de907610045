"""Differentially private SGD: clip every example's gradient, add Gaussian noise.

Notation:
    B   examples in the batch        M   microbatches (B/M examples each; M = B by default)
    C   l2_norm_clip                 σ   noise_multiplier
    x   one weight                   g_m the gradient of microbatch m's loss over all x
    n_m ||g_m||_2, the global norm of g_m across all weights

The arithmetic of TensorFlow Privacy's Gaussian optimizers (`dp_optimizer.py` with
`GaussianSumQuery`), the DP-SGD of Abadi et al. 2016, "Deep Learning with Differential
Privacy" (arXiv 1607.00133):

    loss_m   = mean of the losses of the B/M examples of microbatch m
    clip(g)  = g * C / max(||g||_2, C)                    (tf.clip_by_global_norm)
    gradient = (sum_m clip(g_m) + N(0, (σ C)^2 I)) / M

One step: the clipped sum (`_dp.clipping`), accumulated over k runs (`_Accumulator`),
noised (`_dp.noise.GaussianNoise`), divided (`_release`) and applied.

Per-example clipping (M = B) takes one forward and one backward pass: with the factors
f_i = C / max(n_i, C) held constant, sum_i clip(g_i) = d/dx sum_i f_i * loss_i. For a
weight a rule covers, n_i and this sum come from the same dZ at the op: A^T (f ⊙ dZ)
for a dense layer (the "book-keeping" of Bu et al. 2023, arXiv 2210.00038), or f
contracted with the formed per-example gradients (`_dispatch.Built.clipped_sum`).
Weights without a rule are formed by towers, [B, *x.shape], and contracted with the
same f (towers replay the model, so a random op such as dropout draws its own numbers
there; each clipped gradient still has norm <= C). Microbatches (M < B) are formed as
by `microbatch_gradients`, [M, *x.shape].
"""

import collections
import math
import warnings

import tensorflow as tf

from pertower import _checks
from pertower import _context
from pertower import _dispatch
from pertower import _request
from pertower._dp import clipping as clipping_lib
from pertower._dp import mechanism as mechanism_lib
from pertower._dp import noise as noise_lib
from pertower._dp import wrapper
from pertower._dp.wrapper import GATE_GRAPH, GATE_OP
from pertower._towers import slicing

__all__ = ["DPOptimizer"]


class DPOptimizer(wrapper.WrappedOptimizer):
    """DP-SGD around any `tf.compat.v1.train.Optimizer`: per-example clipping and noise
    (the module docstring). Privacy spent: `pertower.compute_epsilon`, which assumes
    Poisson-sampled batches (`pertower.poisson_batches`).

    Args:
      optimizer: the `tf.compat.v1.train.Optimizer` that applies the noisy gradients.
      l2_norm_clip: C > 0, the largest L2 norm one example's gradient may have (the
        initial one with adaptive clipping). With clipping="per_layer", a number C split
        equally over the K variables (C / sqrt(K) each), or a list of K positive
        numbers C_k, one per floating-point variable of var_list in its order.
      noise_multiplier: σ >= 0; the noise's stddev is σ * C before the division. With
        adaptive clipping σ is the total, split with the count's noise.
      num_microbatches: M, or None for one microbatch per example (M = B). M must
        divide B; a microbatch's loss is the mean of its examples' losses.
      seed: an int making the noise repeatable (`_dp.noise.GaussianNoise`; each
        `sess.run` draws new noise), or None.
      method: "auto" (default), "rules" or "towers", as in
        `pertower.per_example_gradients`.
      clipping: "flat" (default: one norm over all weights) or "per_layer" (McMahan et
        al. 2018, arXiv 1710.06963; `_dp.clipping`).
      expected_batch_size: None (default: divide by the number of examples fed, at
        least 1) or q * N, the expected (logical) batch size, to divide by instead
        (Opacus' expected_batch_size). Needed by adaptive clipping; not with
        num_microbatches.
      adaptive_clipping: None, or a `pertower.AdaptiveClipping`: the clip norm lives in
        `l2_norm_clip_variable` and moves at each noised step. Flat clipping only.
      gradient_accumulation_steps: k >= 1; with k > 1 every k-th run of the training op
        applies one noised step for the last k batches (`_Accumulator`).
      mechanism: None (default: DP-SGD's independent Gaussian noise, `seed` as above), or
        a noise object (`_dp.mechanism`: `add`, `key`, `seed`), such as
        `pertower.BandedMFNoise` (noise correlated across steps; its own `seed`) or
        DP-FTRL's `_dp.tree.TreeNoise` (flat clipping, no adaptive clipping).

    Example:
      loss = keras.losses.sparse_categorical_crossentropy(labels, logits,
                                                          from_logits=True)   # [B]
      dp = pertower.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                l2_norm_clip=1.0, noise_multiplier=1.1,
                                expected_batch_size=64)
      train_op = dp.minimize(loss, var_list=model.trainable_weights)
      for xb, yb in pertower.poisson_batches((X, Y), 64 / len(X)):
          sess.run(train_op, {images: xb, labels: yb})
    """

    @_context.public("DPOptimizer")
    def __init__(self, optimizer, l2_norm_clip, noise_multiplier, num_microbatches=None,
                 seed=None, method="auto", clipping="flat", expected_batch_size=None,
                 adaptive_clipping=None, gradient_accumulation_steps=1, mechanism=None):
        if not isinstance(optimizer, tf.compat.v1.train.Optimizer):
            raise _context.error(
                TypeError, "`optimizer` must be a tf.compat.v1.train.Optimizer "
                f"instance (e.g. tf.compat.v1.train.GradientDescentOptimizer(0.1)), but "
                f"received {type(optimizer).__name__}. Keras optimizers are not supported.")
        self._optimizer = optimizer
        self._noise_multiplier = _checks.real_number(
            noise_multiplier, "noise_multiplier", 0.0, math.inf, high_open=True,
            wanted="a non-negative number")
        self._num_microbatches = (None if num_microbatches is None else _checks.positive_int(
            num_microbatches, "num_microbatches"))
        self._seed = _checks.optional_seed(seed)
        self._method = _request.check_method(method)
        self._clip = clipping_lib.clipping_options(
            clipping, l2_norm_clip, self._noise_multiplier, self._num_microbatches,
            expected_batch_size, adaptive_clipping)
        self._mechanism = (None if mechanism is None else mechanism_lib.check_mechanism(
            mechanism, self._seed, self._clip))
        self._noise = noise_lib.GaussianNoise(self._seed) if mechanism is None else mechanism
        self._seed = getattr(self._noise, "seed", None)
        self._accumulation_steps = _checks.positive_int(gradient_accumulation_steps,
                                                        "gradient_accumulation_steps")
        self._clip_variable = None
        self._step = None      # the last compute_gradients' `_Step`
        self._accumulators = {}   # in tf.functions: (var ids, dtype) -> (vars, _Accumulator)

    optimizer = property(lambda self: self._optimizer,
                         doc="The wrapped `tf.compat.v1.train.Optimizer`.")
    l2_norm_clip = property(lambda self: self._clip.l2_norm_clip, doc=(
        "C as given (the initial one with adaptive clipping; a list per layer)."))
    l2_norm_clip_variable = property(lambda self: self._clip_variable, doc=(
        "With adaptive clipping, the variable holding the current clip norm; else None."))
    noise_multiplier = property(lambda self: self._noise_multiplier)
    gradient_noise_multiplier = property(lambda self: self._clip.gradient_noise_multiplier,
                                         doc="σ_Δ, the gradient's own (`_dp.clipping`).")
    clipping_options = property(lambda self: self._clip, doc="`_dp.clipping.ClippingOptions`")
    num_microbatches = property(lambda self: self._num_microbatches)
    seed = property(lambda self: self._seed)
    mechanism = property(lambda self: self._mechanism, doc=(
        "The `mechanism` given, or None (DP-SGD's Gaussian noise, `_dp.noise`)."))
    gradient_accumulation_steps = property(lambda self: self._accumulation_steps)

    @_context.public("DPOptimizer.compute_gradients")
    def compute_gradients(self, loss, var_list=None, batch=None, batch_size=None,
                          gate_gradients=GATE_OP, aggregation_method=None,
                          colocate_gradients_with_ops=False, grad_loss=None,
                          batch_axis=None, max_batch_size=None):
        """The clipped, noised, averaged gradient, as (gradient, variable) pairs.

        Args:
          loss: the per-example loss, [B] (or [B, ...]: an example's entries are
            averaged, as TensorFlow Privacy does). A scalar is refused.
          var_list: the variables to train; default the graph's trainable variables.
          batch, batch_size, batch_axis: as in `pertower.per_example_gradients`; `loss`
            keeps the batch on axis 0.
          gate_gradients: as in `tf.compat.v1.train.Optimizer.compute_gradients`.
          aggregation_method, colocate_gradients_with_ops: accepted, not used.
          grad_loss: must be None (every example's loss has weight 1 in DP-SGD).
          max_batch_size: None, or N, a capacity for Poisson batches: a fed batch of
            b <= N examples (0 included) is taken, a larger one fails at run time;
            towers are built for N (`_dp.sampling`). Not with `batch_size` or
            `num_microbatches`.

        Returns:
          (gradient, variable) pairs, every gradient dense and noised. A variable the
          loss does not reach gets pure noise / M, as in TensorFlow Privacy (a
          UserWarning names it); a non-float one gets None; a Keras 3 variable is
          replaced by its tf.Variable. With k > 1 accumulation steps, the logical
          batch's gradients on every k-th run (zeros on the others).
        """
        wrapper.check_compute_arguments(loss, grad_loss, gate_gradients)
        defaulted = var_list is None
        all_variables, var_list = wrapper.variables(var_list)
        _checks.warn_unconnected(
            loss, var_list, _checks.UNCONNECTED_DEFAULT, argument="var_list",
            ys_argument="loss",
            outcome="each gets pure noise (a zero gradient plus the Gaussian noise) and the "
                    "optimizer moves it by that noise at every step",
            remedy=("Pass `var_list` with only the variables the loss depends on (it "
                    "defaulted to every trainable variable of the graph)." if defaulted
                    else "Leave them out of `var_list`."))
        M = self._num_microbatches
        capacity = None if max_batch_size is None else _checks.positive_int(
            max_batch_size, "max_batch_size")
        if capacity is not None and (batch_size is not None or M is not None):
            raise _context.error(
                ValueError, "`max_batch_size` is for batches of varying size (Poisson "
                f"batches), one microbatch per example; but batch_size={batch_size!r} and "
                f"num_microbatches={M!r} were given. Pass either "
                "max_batch_size or batch_size, and leave num_microbatches None.")
        per_layer = self._clip.kind == "per_layer"
        clips = (clipping_lib.per_layer_clips(self._clip.l2_norm_clip, len(var_list))
                 if per_layer else None)

        with loss.graph.as_default(), tf.name_scope("dp_compute_gradients"):
            dtype = loss.dtype.base_dtype
            # [B, ...] -> [B]: an example's loss is the mean of its entries
            per_example_loss = loss if loss.shape.rank <= 1 else tf.reduce_mean(
                loss, axis=list(range(1, loss.shape.rank)))
            # the one request of this call: the dtype, rank, B and M | B checked there
            with warnings.catch_warnings():   # warned about unreached ones above
                warnings.simplefilter("ignore", _checks.UnconnectedWeightsWarning)
                # a capacity: the towers pad the fed batch (`_towers.slicing`)
                request = _request.make_request(
                    per_example_loss, var_list, _request.Examples(batch, batch_size, M,
                                                                  batch_axis),
                    _dispatch.options(self._method, batch_capacity=capacity),
                    ys_argument="loss", scalar_advice=wrapper.ONE_LOSS_PER_EXAMPLE)
            clip = self._clip_read(dtype)              # C: a float, or the variable's read
            factors_of = clipping_lib.clip_factors(clips if per_layer else clip)
            # B when known now (the towers check it against the fed batch at run time)
            B = request.batch_size if request.batch_size is not None else request.ys_rows
            if M is None or (B is not None and M == B):
                clipped_sum, count, norms = clipping_lib.clipped_sum_per_example(
                    request, factors_of, per_layer, gate_gradients == GATE_GRAPH)
            else:
                clipped_sum, count, norms = clipping_lib.clipped_sum_microbatches(
                    request, factors_of, per_layer)
            if capacity is not None:   # a fed batch of more than N examples fails
                check = slicing.capacity_check(per_example_loss, 0, capacity,
                                               "the DP step was")
                with tf.control_dependencies([check]):
                    clipped_sum = [tf.identity(g) for g in clipped_sum]
            # adaptive clipping's count of unclipped examples (norms <= C)
            unclipped = (tf.reduce_sum(tf.cast(norms <= clip, dtype))
                         if self._clip.adaptive is not None else tf.zeros([], dtype))
            accumulator = None
            if self._accumulation_steps > 1:
                accumulator = self._accumulator_for(var_list, dtype)
                clipped_sum, count, unclipped = accumulator.add(clipped_sum, count, unclipped)
            stddevs = ([self._noise_multiplier * math.sqrt(len(clips)) * c for c in clips]
                       if per_layer else [self._clip.gradient_noise_multiplier * clip]
                       * len(var_list))

            adaptive = self._clip.adaptive is not None

            def release():   # (and the key of adaptive clipping's count, drawn after it)
                noised = self._release(clipped_sum, count, stddevs)
                if not adaptive:
                    return noised
                with tf.control_dependencies(noised):
                    return noised + [self._noise.key()]

            if accumulator is None:
                averaged = release()
            else:   # the noise is drawn on the k-th run only
                averaged = tf.cond(accumulator.is_last, release, lambda: [
                    tf.zeros_like(g) for g in clipped_sum] + (
                        [tf.zeros([2], tf.int64)] if adaptive else []))
                for g, x in zip(averaged, var_list):
                    g.set_shape(x.shape)
            count_key = averaged.pop() if adaptive else None              # [2] int64
            clip_update = None if not adaptive else (
                lambda: clipping_lib.adaptive_clip_update(
                    clip, unclipped, self._clip.expected_batch_size, self._clip.adaptive,
                    self._clip.count_stddev, count_key))
        self._step = _Step(tuple(averaged), accumulator, clip_update)
        noisy_gradients = dict(zip(map(id, var_list), averaged))
        return [(noisy_gradients.get(id(v)), v) for v in all_variables]

    def _accumulator_for(self, var_list, dtype):
        """A new `_Accumulator`; in a `tf.function` (TF2), the one of the first trace,
        so that a retrace reuses its variables (made once, outside the function)."""
        if not tf.compat.v1.executing_eagerly_outside_functions():
            return _Accumulator(var_list, self._accumulation_steps, dtype)
        made = self._accumulators
        key = (tuple(map(id, var_list)), dtype)
        if key not in made:   # (the variables kept too, so that their ids stay theirs)
            made[key] = (list(var_list), _Accumulator(var_list, self._accumulation_steps,
                                                      dtype))
        return made[key][1]

    def _clip_read(self, dtype):
        """C: the float, or one read of the adaptive clip variable (made on first use)."""
        if self._clip.adaptive is None:
            return None if self._clip.kind == "per_layer" else self._clip.l2_norm_clip
        if self._clip_variable is None:
            self._clip_variable = clipping_lib.clip_variable(self._clip.l2_norm_clip, dtype)
        return tf.identity(self._clip_variable.read_value(), name="l2_norm_clip")

    def _release(self, clipped_sum, count, stddevs):
        """(sum_m clip(g_m) + noise) / the expected batch size, or / the count M (of
        examples when M = B), at least 1. The distributed optimizer overrides it."""
        noised = self._noise.add(clipped_sum, stddevs)
        dtype = noised[0].dtype
        divisor = (tf.constant(self._clip.expected_batch_size, dtype)
                   if self._clip.expected_batch_size is not None else
                   tf.maximum(tf.cast(count, dtype), 1))
        return [g / tf.cast(divisor, g.dtype) for g in noised]

    @_context.public("DPOptimizer.apply_gradients")
    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        """The wrapped optimizer's `apply_gradients` (refused before `compute_gradients`),
        which also moves an adaptive clip norm and applies an accumulation's k-th run."""
        if self._step is None:
            raise _context.error(
                RuntimeError, "call compute_gradients first (or "
                "minimize); applying gradients that were not clipped and noised would not "
                "be differentially private.")
        grads_and_vars = list(grads_and_vars)
        step = self._step
        ours = ({id(g) for g, _ in grads_and_vars if g is not None}
                <= {id(g) for g in step.gradients})
        if (step.accumulator is not None or step.clip_update is not None) and not ours:
            raise _context.error(
                ValueError, "with gradient accumulation or adaptive clipping, pass the "
                "pairs the last compute_gradients returned (the op of apply_gradients "
                "also updates the accumulator and the clip norm).")

        def apply():
            applied = self._optimizer.apply_gradients(grads_and_vars,
                                                      global_step=global_step, name=name)
            if step.clip_update is None:
                return applied
            with tf.control_dependencies([applied]):
                return tf.group(applied, self._clip_variable.assign(step.clip_update()))

        if step.accumulator is None:
            return apply()
        return step.accumulator.finish(apply)

    def get_name(self):
        return self._optimizer.get_name()

    def __repr__(self):
        return (f"DPOptimizer({type(self._optimizer).__name__}, l2_norm_clip="
                f"{self._clip.l2_norm_clip}, noise_multiplier={self._noise_multiplier}, "
                f"num_microbatches={self._num_microbatches}, seed={self._seed})")


# What compute_gradients built for apply_gradients: the noised gradients it returned, an
# `_Accumulator` (or None), and () -> the new clip norm (adaptive clipping; or None).
_Step = collections.namedtuple("_Step", ["gradients", "accumulator", "clip_update"])


class _Accumulator:
    """Large logical batches: the clipped sums S_x ([*x.shape] each), the count n and the
    unclipped count u accumulated over k `sess.run` calls in non-trainable variables
    (`sums`, `count`, `unclipped`; `runs` the runs since the last noised step); the k-th
    run noises the sum ONCE, applies it and zeroes them (TensorFlow Privacy's
    `gradient_accumulation_steps`; Opacus' BatchMemoryManager). `compute_epsilon` takes
    q = the logical batch over N and T = the noised steps."""

    def __init__(self, var_list, steps, dtype, name="dp_accumulator"):
        self.steps = steps
        with tf.init_scope(), tf.compat.v1.variable_scope(None, default_name=name):
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
        self.totals = self.is_last = None

    def add(self, sums, count, unclipped):
        """This run's totals (S_x + sums, n + count, u + unclipped); `is_last` [] bool
        tells the k-th run of a step."""
        self.totals = ([v.read_value() + tf.cast(g, v.dtype) for v, g in zip(self.sums, sums)],
                       self.count.read_value() + tf.cast(count, self.count.dtype),
                       self.unclipped.read_value() + tf.cast(unclipped, self.unclipped.dtype))
        self.is_last = tf.equal((self.runs.read_value() + 1) % self.steps, 0)
        return self.totals

    def finish(self, apply):
        """The training op: on the k-th run `apply()` then zero the variables, else
        store the totals; count the run."""
        stored = self.sums + [self.count, self.unclipped]

        def on_last():
            with tf.control_dependencies([apply()]):
                zeroed = [v.assign(tf.zeros_like(v)) for v in stored]
            with tf.control_dependencies(zeroed):
                return tf.constant(True)

        def on_others():
            sums, count, unclipped = self.totals
            kept = [v.assign(t) for v, t in zip(stored, list(sums) + [count, unclipped])]
            with tf.control_dependencies(kept):
                return tf.constant(False)

        done = tf.cond(self.is_last, on_last, on_others)
        with tf.control_dependencies([done]):
            counted = self.runs.assign(tf.math.floormod(self.runs + 1, self.steps))
        return tf.group(done, counted, name="dp_accumulated_step")

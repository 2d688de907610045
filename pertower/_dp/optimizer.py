"""Differentially private SGD: clip every example's gradient, add Gaussian noise.

Notation:
    B   examples in the batch        M   microbatches (B/M examples each; M = B by default)
    C   l2_norm_clip                 σ   noise_multiplier
    x   one weight                   g_m the gradient of microbatch m's loss over all x
    n_m ||g_m||_2, the global norm of g_m across all weights

The arithmetic of TensorFlow Privacy's Gaussian optimizers (`DPGradientDescentGaussian
Optimizer` and its Adam/Adagrad siblings, `tensorflow_privacy/privacy/optimizers/
dp_optimizer.py` with `GaussianSumQuery`), the DP-SGD of Abadi et al. 2016, "Deep
Learning with Differential Privacy" (arXiv 1607.00133):

    loss_m   = mean of the losses of the B/M examples of microbatch m
    clip(g)  = g * C / max(||g||_2, C)                    (tf.clip_by_global_norm)
    gradient = (sum_m clip(g_m) + N(0, (σ C)^2 I)) / M

The noisy average gradient is handed to the wrapped optimizer's `apply_gradients`.

Per-example clipping (M = B) takes one forward pass and one backward pass. With the
factors f_i = C / max(n_i, C) held constant, gradients being linear in the loss,

    sum_i clip(g_i) = sum_i f_i g_i = d/dx sum_i f_i * loss_i,

and for a weight covered by a rule both n_i and this sum come from the same dZ at the
weight-consuming op (one tf.gradients of sum_i loss_i): the norms from the rule's
squared norms, the sum from the rule's batch gradient with example i's rows of dZ
scaled by f_i (e.g. A^T (f ⊙ dZ) for a dense layer; the "book-keeping" of Bu et al.
2023, "Differentially private optimization on large model at small cost", arXiv
2210.00038), or, where the norms needed the per-example gradients formed, f
contracted with them (`_dispatch.Built.clipped_sum`). A loss with dropout in training
mode keeps this path: the norms and the sum differentiate the draws of the same run.
Weights without a rule are formed by towers, [B, *x.shape], and contracted with the
same f (the towers replay the model, so a random op draws its own numbers there; each
example's clipped gradient, as computed, still has norm <= C). Microbatches (M < B)
are built by the same dispatch as `microbatch_gradients`, [M, *x.shape].
"""

import dataclasses
import math
import numbers
import warnings

import tensorflow as tf

from pertower import _checks
from pertower import _context
from pertower import _dispatch
from pertower import _graph_walk as graph_walk
from pertower import _plan
from pertower import _reductions as reductions
from pertower import _request
from pertower._dp import noise as noise_lib

__all__ = ["DPOptimizer"]

_GATE_OP = tf.compat.v1.train.Optimizer.GATE_OP
_GATE_GRAPH = tf.compat.v1.train.Optimizer.GATE_GRAPH


# What a reduced loss is told.
_ONE_LOSS_PER_EXAMPLE = (
    "DP needs one loss per example: pass the unreduced loss, [B] (e.g. "
    "tf.nn.sparse_softmax_cross_entropy_with_logits, or a Keras loss with "
    "reduction='none'), not its mean.")


def _real_number(value, argument, positive):
    """`value` as a float when it is a finite real number (> 0 or >= 0); raises otherwise."""
    return _checks.real_number(value, argument, low=0.0, high=math.inf,
                               low_open=positive, high_open=True,
                               wanted="a positive number" if positive
                               else "a non-negative number")


class DPOptimizer:
    """DP-SGD around any `tf.compat.v1.train.Optimizer`: per-example clipping and noise.

    Same arithmetic as TensorFlow Privacy's Gaussian optimizers: each example's (or
    microbatch's) gradient is clipped, across all weights together, to L2 norm
    `l2_norm_clip`; the clipped gradients are summed; Gaussian noise of standard
    deviation `noise_multiplier * l2_norm_clip` is added to every entry; the sum is
    divided by the number of examples (or microbatches) and handed to the wrapped
    optimizer. Privacy spent: `pertower.compute_epsilon`.

    Args:
      optimizer: the `tf.compat.v1.train.Optimizer` instance that applies the noisy
        gradients (GradientDescentOptimizer, AdamOptimizer, ...).
      l2_norm_clip: C > 0, the largest L2 norm one example's gradient may have.
      noise_multiplier: σ >= 0; the noise's standard deviation is σ * C before the
        division by the number of examples (σ = 0 gives clipping without privacy).
      num_microbatches: M, or None for one microbatch per example (M = B). M must
        divide B; a microbatch's loss is the mean of its examples' losses.
      seed: an int making the noise repeatable: the k-th `compute_gradients` call
        (from 0) builds its noise op with op seed `seed + k` (with a graph-level seed
        from `tf.compat.v1.set_random_seed` both are used). Each `sess.run` of the
        op draws new noise; the same graph built again gives the same sequence.
        None draws unrepeatable noise (unless a graph-level seed is set).
      method: how the per-example norms and gradients are computed: "auto" (default),
        "rules" or "towers", as in `pertower.per_example_gradients`. With a None
        batch axis no `batch_size` is needed when every weight has a rule.

    Example:
      loss = keras.losses.sparse_categorical_crossentropy(labels, logits,
                                                          from_logits=True)   # [B]
      dp = pertower.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                l2_norm_clip=1.0, noise_multiplier=1.1)
      train_op = dp.minimize(loss, var_list=model.trainable_weights)
      sess.run(train_op, {images: X[:64], labels: Y[:64]})
    """

    @_context.public("DPOptimizer")
    def __init__(self, optimizer, l2_norm_clip, noise_multiplier, num_microbatches=None,
                 seed=None, method="auto"):
        if not isinstance(optimizer, tf.compat.v1.train.Optimizer):
            raise _context.error(
                TypeError, "`optimizer` must be a tf.compat.v1.train.Optimizer "
                f"instance (e.g. tf.compat.v1.train.GradientDescentOptimizer(0.1)), but "
                f"received {type(optimizer).__name__}. Keras optimizers are not supported.")
        self._optimizer = optimizer
        self._l2_norm_clip = _real_number(l2_norm_clip, "l2_norm_clip", positive=True)
        self._noise_multiplier = _real_number(noise_multiplier, "noise_multiplier",
                                              positive=False)
        self._num_microbatches = (None if num_microbatches is None else _checks.positive_int(
            num_microbatches, "num_microbatches"))
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)):
            raise _context.error(TypeError, "`seed` must be an int or None, but received "
                                 f"{type(seed).__name__} ({seed!r:.80}).")
        self._seed = None if seed is None else int(seed)
        self._method = _request.check_method(method)
        self._computed = False
        self._noise_draws = 0  # noise ops built so far: each gets its own op seed

    @property
    def optimizer(self):
        """The wrapped `tf.compat.v1.train.Optimizer`."""
        return self._optimizer

    @property
    def l2_norm_clip(self):
        return self._l2_norm_clip

    @property
    def noise_multiplier(self):
        return self._noise_multiplier

    @property
    def num_microbatches(self):
        return self._num_microbatches

    @property
    def seed(self):
        return self._seed

    @_context.public("DPOptimizer.compute_gradients")
    def compute_gradients(self, loss, var_list=None, batch=None, batch_size=None,
                          gate_gradients=_GATE_OP, aggregation_method=None,
                          colocate_gradients_with_ops=False, grad_loss=None,
                          batch_axis=None):
        """The clipped, noised, averaged gradient, as (gradient, variable) pairs.

        Args:
          loss: the per-example loss, [B] (or [B, ...]: an example's entries are
            averaged, as TensorFlow Privacy does). A scalar is refused: DP needs one
            loss per example.
          var_list: the variables to train; default the graph's trainable variables,
            as `tf.compat.v1.train.Optimizer.compute_gradients`.
          batch, batch_size: as in `pertower.per_example_gradients` (with a None
            batch axis, batch_size is needed only when some weights fall back to
            towers, or for microbatches whose gradients a tower computes).
          gate_gradients: as in `tf.compat.v1.train.Optimizer.compute_gradients`
            (GATE_GRAPH groups the gradients with tf.tuple).
          aggregation_method, colocate_gradients_with_ops: accepted for the signature
            of `tf.compat.v1.train.Optimizer.compute_gradients`; the batched backward
            pass pertower builds does not use them.
          grad_loss: must be None (every example's loss has weight 1 in DP-SGD).
          batch_axis: the axis of each batch tensor that carries the batch (None: 0),
            as in `pertower.per_example_gradients`; `loss` keeps it on axis 0.

        Returns:
          A list of (gradient, variable) pairs, one per variable, every gradient dense
          and noised (a variable the loss does not reach gets pure noise / M, as in
          TensorFlow Privacy). Such variables are named in a UserWarning, whether
          `var_list` was given or defaulted: unlike the gradients of
          `tf.compat.v1.train.Optimizer`, where they are None and the variable is left
          alone, noise moves them at every step (pass `var_list` to choose). A Keras 3
          variable is replaced by the tf.Variable holding its value.
        """
        _checks.require_graph_mode()
        if callable(loss) and not isinstance(loss, tf.Tensor):
            raise _context.error(TypeError, "`loss` must be a graph tensor, not a callable "
                                 "(that is the eager API, which pertower does not serve).")
        _checks.require_graph_tensor(loss, "loss")
        if grad_loss is not None:
            raise _context.error(
                ValueError, "`grad_loss` must be None: DP-SGD weighs every example's loss "
                "equally; scale the loss instead.")
        if gate_gradients not in (tf.compat.v1.train.Optimizer.GATE_NONE, _GATE_OP,
                                  _GATE_GRAPH):
            raise _context.error(ValueError, "`gate_gradients` must be GATE_NONE, GATE_OP or "
                                 f"GATE_GRAPH, but received {gate_gradients!r}.")
        if loss.shape.rank is None:   # (a scalar is refused by the request, below)
            raise _context.error(ValueError, f"`loss` ({loss.name}) has shape {loss.shape}, "
                                 f"but {_ONE_LOSS_PER_EXAMPLE}")
        defaulted = var_list is None
        all_variables = self._variables(var_list)
        var_list = _without_gradient_free(all_variables)
        _checks.warn_unconnected(
            loss, var_list, _checks.UNCONNECTED_DEFAULT, argument="var_list",
            ys_argument="loss",
            outcome="each gets pure noise (a zero gradient plus the Gaussian noise) and the "
                    "optimizer moves it by that noise at every step",
            remedy=("Pass `var_list` with only the variables the loss depends on (it "
                    "defaulted to every trainable variable of the graph)." if defaulted
                    else "Leave them out of `var_list`."))
        M = self._num_microbatches

        with tf.name_scope("dp_compute_gradients"):
            # [B, ...] -> [B]: an example's loss is the mean of its entries
            per_example_loss = loss if loss.shape.rank <= 1 else tf.reduce_mean(
                loss, axis=list(range(1, loss.shape.rank)))
            # the one request of this call: the dtype, rank, B and M | B checked there
            with warnings.catch_warnings():   # warned about unreached ones above
                warnings.simplefilter("ignore", _checks.UnconnectedWeightsWarning)
                request = _request.make_request(
                    per_example_loss, var_list, batch, batch_size, M, method=self._method,
                    batch_axis=batch_axis, ys_argument="loss",
                    scalar_advice=_ONE_LOSS_PER_EXAMPLE)
            # B when known now (the towers check it against the fed batch at run time)
            B = request.batch_size if request.batch_size is not None else request.ys_rows
            if M is None or (B is not None and M == B):
                clipped_sum, count = self._clipped_sum_per_example(request, gate_gradients)
            else:
                clipped_sum, count = self._clipped_sum_microbatches(request)
            averaged = self._release(clipped_sum, count)
        self._computed = True
        noisy_gradients = dict(zip(map(id, var_list), averaged))
        return [(noisy_gradients.get(id(v)), v) for v in all_variables]

    def _variables(self, var_list):  # (every entry, non-float ones included)
        if var_list is None:
            var_list = tf.compat.v1.trainable_variables() + tf.compat.v1.get_collection(
                tf.compat.v1.GraphKeys.TRAINABLE_RESOURCE_VARIABLES)
            var_list = list({id(v): v for v in var_list}.values())
            if not var_list:
                raise _context.error(ValueError, "the graph has no trainable variables; "
                                     "pass `var_list`.")
        else:
            var_list = _checks.weight_list(
                _checks.Partitions(_checks.as_list(var_list)).flat, "var_list")
            if not var_list:
                raise _context.error(ValueError, "`var_list` is empty.")
        return var_list

    def _clip_factors(self, norms):
        """f = C / max(n, C) = min(1, C / n): the clip_by_global_norm factors, [M]."""
        clip = tf.constant(self._l2_norm_clip, norms.dtype)
        return clip / tf.maximum(norms, clip)

    def _clipped_sum_per_example(self, request, gate_gradients):
        """sum_i clip(g_i) from one forward and one backward pass; and B."""
        request = request.per_example()
        with warnings.catch_warnings():   # compute_gradients warned about unreached ones
            warnings.simplefilter("ignore", _checks.UnconnectedWeightsWarning)
            plan = _dispatch.make_plan(dataclasses.replace(
                request, options=dataclasses.replace(request.options,
                                                     forms_gradients=False)))
        # towers replay the model with their own draws; row passes (past a TF1 loop)
        # differentiate the model itself, with the draws of the loss
        noisy = graph_walk.random_ops(request.ys_upstream)
        if noisy and plan.fallback and plan.loop_op is None:
            names = ", ".join(_plan.weight_name(request.xs[k]) for k in plan.fallback)
            warnings.warn(_context.prefixed(
                f"the loss depends on the random op {noisy[0].name!r} ({noisy[0].type}), "
                f"e.g. dropout in training mode, and no rule covers {names}: their "
                "per-example gradients come from towers that replay the model and draw "
                "their own random numbers. Each example's clipped gradient still has norm "
                "<= l2_norm_clip."), stacklevel=3)
        built = _dispatch.build(plan)
        _, _, grads = built.clipped_sum(self._clip_factors, name="clipped_sum")
        if gate_gradients == _GATE_GRAPH:
            grads = list(tf.tuple(grads))
        return grads, tf.shape(request.ys)[0]

    def _clipped_sum_microbatches(self, request):
        """sum_m clip(g_m) with g_m the gradient of microbatch m's mean loss; and M."""
        M, per_example_loss = request.num_groups, request.ys
        with tf.name_scope("microbatch_gradients"):
            built = _dispatch.build(_dispatch.make_plan(request))
            # [M, *x.shape] each
            sums = built.validated(built.gradients(unconnected_gradients="zero",
                                                   name="gradients"))
        # gradient of the microbatch mean = gradient of its sum / (B/M); B/M counted
        # on the outer loss (not replayed by the towers)
        per_microbatch = tf.shape(per_example_loss)[0] // M
        means = [g / tf.cast(per_microbatch, g.dtype) for g in sums]
        factors = self._clip_factors(reductions.global_norms(means))    # [M]
        # [M] x [M, *x.shape] -> [*x.shape]
        clipped_sum = [tf.tensordot(factors, g, axes=1) for g in means]
        return clipped_sum, M

    def _release(self, clipped_sum, count):
        """What compute_gradients hands on, from sum_m clip(g_m) and M: the noisy average
        (sum + noise) / M. A subclass releasing elsewhere overrides it (the distributed
        optimizer, `_dp/distributed.py`, pushes the sums and counts to the chief)."""
        noised = self._add_noise(clipped_sum)
        # sum / M: the noisy average over microbatches (examples when M = B)
        return [g / tf.cast(count, g.dtype) for g in noised]

    def _add_noise(self, gradients):
        """g + N(0, (σ C)^2) per entry, from one draw over all weights (so that one
        seed gives every weight its own noise)."""
        if self._noise_multiplier == 0:
            return gradients
        dtype = gradients[0].dtype
        # call k gets op seed seed + k: a second compute_gradients draws other noise
        seed = None if self._seed is None else self._seed + self._noise_draws
        self._noise_draws += 1
        # static sizes where known, so that the draw need not wait for the gradients
        sizes = [g.shape.num_elements() if g.shape.is_fully_defined() else tf.size(g)
                 for g in gradients]
        # a fresh key pair per sess.run from a 2-entry stateful draw (repeatable with the
        # op and graph seeds), then P stateless Box-Muller draws (`_dp.noise`)
        key = tf.random.uniform([2], maxval=2 ** 62, dtype=tf.int64, seed=seed,
                                name="noise_key")                              # [2]
        with tf.name_scope("noise"):
            total = sum(sizes) if all(isinstance(s, int) for s in sizes) else tf.add_n(
                [tf.convert_to_tensor(s, tf.int32) for s in sizes])
            noise = (self._noise_multiplier * self._l2_norm_clip) * noise_lib.standard_normal(
                total, key, dtype)                                              # [P]
        pieces = tf.split(noise, tf.stack(sizes), num=len(gradients))  # [P] -> [P_x] each
        # [P_x] -> [*x.shape]
        return [g + tf.cast(tf.reshape(p, g.shape if g.shape.is_fully_defined()
                                       else tf.shape(g)), g.dtype)
                for g, p in zip(gradients, pieces)]

    @_context.public("DPOptimizer.apply_gradients")
    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        """The wrapped optimizer's `apply_gradients`; refused before `compute_gradients`
        (the gradients it applies must be the private ones)."""
        if not self._computed:
            raise _context.error(
                RuntimeError, "call compute_gradients first (or "
                "minimize); applying gradients that were not clipped and noised would not "
                "be differentially private.")
        return self._optimizer.apply_gradients(grads_and_vars, global_step=global_step,
                                               name=name)

    def minimize(self, loss, global_step=None, var_list=None, gate_gradients=_GATE_OP,
                 aggregation_method=None, colocate_gradients_with_ops=False, name=None,
                 grad_loss=None, batch=None, batch_size=None, batch_axis=None):
        """`compute_gradients` then `apply_gradients`, as
        `tf.compat.v1.train.Optimizer.minimize`; returns the training op."""
        grads_and_vars = self.compute_gradients(
            loss, var_list=var_list, batch=batch, batch_size=batch_size,
            gate_gradients=gate_gradients, aggregation_method=aggregation_method,
            colocate_gradients_with_ops=colocate_gradients_with_ops, grad_loss=grad_loss,
            batch_axis=batch_axis)
        return self.apply_gradients(grads_and_vars, global_step=global_step, name=name)

    def get_slot(self, var, name):
        """The wrapped optimizer's slot (e.g. Adam's "m")."""
        return self._optimizer.get_slot(var, name)

    def get_slot_names(self):
        return self._optimizer.get_slot_names()

    def variables(self):
        """The wrapped optimizer's variables (slots, Adam's beta powers)."""
        return self._optimizer.variables()

    def get_name(self):
        return self._optimizer.get_name()

    def __repr__(self):
        return (f"DPOptimizer({type(self._optimizer).__name__}, l2_norm_clip="
                f"{self._l2_norm_clip}, noise_multiplier={self._noise_multiplier}, "
                f"num_microbatches={self._num_microbatches}, seed={self._seed})")


def _without_gradient_free(var_list):
    """The floating-point entries of `var_list`. The others (an int64 `global_step`, a
    tf.string variable) have no gradient: as TensorFlow's optimizers and TF Privacy do,
    they get the gradient None, and a warning names them."""
    kept = [v for v in var_list if v.dtype.base_dtype.is_floating]
    skipped = [v for v in var_list if not v.dtype.base_dtype.is_floating]
    if skipped:
        names = ", ".join(f"{_plan.weight_name(v)} ({v.dtype.base_dtype.name})"
                          for v in skipped)
        warnings.warn(_context.prefixed(
            f"{len(skipped)} of the variables in `var_list` are not floating-point "
            f"({names}): they have no gradient, so they get the gradient None and "
            "apply_gradients leaves them as they are. Leave them out of `var_list`."),
            stacklevel=4)
    if not kept:
        raise _context.error(ValueError, (
            "`var_list` has no floating-point variable to compute gradients for "
            f"(received {len(var_list)} of other dtypes); pass the model's weights."))
    return kept

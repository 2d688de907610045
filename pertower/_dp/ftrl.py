"""DP-FTRL: differentially private training without sampling or shuffling.

Notation:
    B   examples in the step's batch (M microbatches)     η  learning_rate    μ  momentum
    g_t the step's clipped sum, sum_m clip(g_m) (`_dp.optimizer`, the same clipping)
    S_t = g_1 + ... + g_t      N_t the tree's noise of S_t (`_dp.tree`), stddev σ C per node

Kairouz et al. 2021, "Practical and Private (Deep) Learning without Sampling or
Shuffling" (arXiv 2103.00039), Algorithm 1: follow-the-regularized-leader on the
linearized losses, θ_t = argmin <S_t + N_t, θ> / B + ||θ - θ_0||² / (2η), i.e.

    θ_t = θ_0 - η (S_t + N_t) / B,

and with momentum (their DP-FTRLM) m_t = μ m_(t-1) + (S_t + N_t), θ_t = θ_0 - η m_t / B.
Both are applied as steps on the residuals r_t = g_t + N_t - N_(t-1):
θ_t = θ_(t-1) - η u_t / B, u_t = μ u_(t-1) + r_t (u_t = m_t - m_(t-1)): gradient descent
(momentum) on r_t / B, TensorFlow Privacy's `DPFTRLTreeAggregationOptimizer` (its
`TreeResidualSumQuery` with Keras' SGD). A restart (`restart_period`, `_dp.tree`) starts
a new tree: θ_0 becomes the weights at the restart, the momentum carries on.

With σ = 0 every step is gradient descent (with momentum) on the clipped mean. The
state is in variables: the tree's release counter and seed (and the efficient tree's
buffer), the momentum slot; a checkpoint resumes the same noise stream. The privacy
holds for any fixed order of the data; its accounting (one participation per example
per tree, e.g. a restart per epoch) is Kairouz et al.'s, as in TensorFlow Privacy's
`analysis.tree_aggregation_accountant`.
"""

import math

import tensorflow as tf

from pertower import _checks
from pertower import _context
from pertower._dp import optimizer as dp_optimizer
from pertower._dp import tree as tree_lib
from pertower._dp.wrapper import GATE_OP

__all__ = ["DPFTRLOptimizer"]


class DPFTRLOptimizer(dp_optimizer.DPOptimizer):
    """DP-FTRL with tree aggregation for `tf.compat.v1.train` sessions (module docstring).

    Each step clips per example as `pertower.DPOptimizer` does, adds the clipped sum to
    the tree's stream and moves the weights to θ_0 - η (S_t + N_t) / B (with momentum:
    θ_0 - η m_t / B). Feed the data in any fixed order (no Poisson sampling needed).

    Args:
      l2_norm_clip: C > 0, the largest L2 norm of one example's (microbatch's) gradient.
      noise_multiplier: σ >= 0; each tree node's noise has stddev σ C per entry.
      learning_rate: η > 0 (a float, or a scalar tensor as in
        `tf.compat.v1.train.GradientDescentOptimizer`).
      momentum: μ in [0, 1): Kairouz et al.'s DP-FTRLM (0: plain DP-FTRL).
      restart_period: None (one tree), or p >= 1: a new tree after every p releases
        (TensorFlow Privacy's `PeriodicRoundRestartIndicator`), e.g. the steps of an epoch.
      restart_warmup: None, or w in [1, p - 1]: the first restart after release w, then
        every p; needs restart_period.
      num_microbatches: M, or None for one microbatch per example, as `DPOptimizer`'s.
      efficient_tree: False (default): N_t sums popcount(t) independent nodes, Var =
        σ²C² popcount(t). True: Honaker's estimator (TensorFlow Privacy's default), a
        smaller variance, σ²C² sum_l 1/(2 - 2^-l), for a buffer of bit_length(p)
        copies of the weights with restart_period p (up to log2(t) + 1 without).
      seed: an int making the tree's noise repeatable, or None (a seed drawn when the
        variables are initialized, kept in the checkpoint).
      method: "auto", "rules" or "towers", as in `pertower.per_example_gradients`.
      name: the name of the gradient descent (momentum) optimizer that applies the step.

    Raises:
      ValueError / TypeError: an argument out of its range, naming it.

    Example:
      ftrl = pertower.DPFTRLOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0,
                                      learning_rate=0.5, momentum=0.9,
                                      restart_period=steps_per_epoch)
      train_op = ftrl.minimize(loss, var_list=model.trainable_weights)   # loss [B]
      for epoch in range(epochs):
          for xb, yb in batches_in_a_fixed_order:
              sess.run(train_op, {images: xb, labels: yb})
    """

    @_context.public("DPFTRLOptimizer")
    def __init__(self, l2_norm_clip, noise_multiplier, learning_rate, momentum=0.0,
                 restart_period=None, restart_warmup=None, num_microbatches=None,
                 efficient_tree=False, seed=None, method="auto", name="DPFTRL"):
        if not tf.is_tensor(learning_rate):
            _checks.real_number(learning_rate, "learning_rate", 0.0, math.inf, low_open=True,
                                high_open=True, wanted="a positive number")
        momentum = _checks.real_number(momentum, "momentum", 0.0, 1.0, high_open=True,
                                       wanted="a number in [0, 1)")
        if not isinstance(efficient_tree, bool):
            raise _context.error(TypeError, "`efficient_tree` must be True or False, but "
                                 f"received {efficient_tree!r:.80}.")
        applier = (tf.compat.v1.train.MomentumOptimizer(learning_rate, momentum, name=name)
                   if momentum > 0 else
                   tf.compat.v1.train.GradientDescentOptimizer(learning_rate, name=name))
        tree = tree_lib.TreeNoise(seed, restart_period, restart_warmup, efficient_tree)
        dp_optimizer.DPOptimizer.__init__.__wrapped__(
            self, applier, l2_norm_clip, noise_multiplier,
            num_microbatches=num_microbatches, method=method, mechanism=tree)
        self._learning_rate, self._momentum = learning_rate, momentum

    learning_rate = property(lambda self: self._learning_rate)
    momentum = property(lambda self: self._momentum)
    restart_period = property(lambda self: self.mechanism.period)
    restart_warmup = property(lambda self: self.mechanism.warmup or None)
    efficient_tree = property(lambda self: self.mechanism.efficient)
    tree = property(lambda self: self.mechanism, doc=(
        "The `_dp.tree.TreeNoise`: its `releases` variable counts the steps released."))

    @_context.public("DPFTRLOptimizer.compute_gradients")
    def compute_gradients(self, loss, var_list=None, batch=None, batch_size=None,
                          gate_gradients=GATE_OP, aggregation_method=None,
                          colocate_gradients_with_ops=False, grad_loss=None,
                          batch_axis=None, max_batch_size=None):
        """(r_t / B, variable) pairs: the clipped sum plus N_t - N_(t-1), divided by the
        number of examples (microbatches); arguments as `pertower.DPOptimizer`'s.
        Running them counts a release: make them once per step (`minimize`)."""
        return dp_optimizer.DPOptimizer.compute_gradients.__wrapped__(
            self, loss, var_list=var_list, batch=batch, batch_size=batch_size,
            gate_gradients=gate_gradients, aggregation_method=aggregation_method,
            colocate_gradients_with_ops=colocate_gradients_with_ops, grad_loss=grad_loss,
            batch_axis=batch_axis, max_batch_size=max_batch_size)

    @_context.public("DPFTRLOptimizer.apply_gradients")
    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        """The gradient descent (momentum) step on r_t / B; refused before
        `compute_gradients`."""
        return dp_optimizer.DPOptimizer.apply_gradients.__wrapped__(
            self, grads_and_vars, global_step=global_step, name=name)

    def __repr__(self):
        return (f"DPFTRLOptimizer(l2_norm_clip={self.l2_norm_clip}, noise_multiplier="
                f"{self.noise_multiplier}, learning_rate={self._learning_rate}, momentum="
                f"{self._momentum}, restart_period={self.restart_period}, restart_warmup="
                f"{self.restart_warmup}, efficient_tree={self.efficient_tree}, "
                f"seed={self.seed})")

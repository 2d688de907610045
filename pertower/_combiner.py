"""The combiner: the rules' results for the covered weights, one fallback's for the rest.

Notation: B examples, G groups (B, or M microbatches), x one weight, f the [G] clipping
factors of DP-SGD. `Built` runs what a `pertower._plan.Plan` decided: the rules' batched
backward pass (`pertower._engine`) and ONE fallback (`pertower._towers.fallback`: the
towers, or past a TF1 while loop row passes); results come back in the order of `xs`.
"""

import tensorflow as tf

from pertower._guards import independence
from pertower._towers import build as towers_lib
from pertower._towers import fallback as fallback_lib
from pertower import _engine

__all__ = ["Built"]


class Built:
    """Attributes:
      plan; xs, ys, batch_size: the request's.
      groups: G (a tensor when B is known only at run time).
      covered: indices into xs of the weights the rules compute ([] when no rule is
        used: the towers, exactly `build_towers`, compute every weight).
      fallback: the `Towers` or `RowPasses` of the other weights, or None;
        fallback_indices: their indices into xs, in its order.
    """

    def __init__(self, plan, devices=None):
        request = plan.request
        self.plan = plan
        self.xs = tuple(request.xs)
        self.ys = request.ys
        self.batch_size = request.batch_size
        self.groups = _engine.group_count(request, request.num_groups)
        self.covered = list(plan.covered)
        self.fallback, self.fallback_indices = None, list(plan.fallback)
        if plan.fallback and plan.loop_op is not None:
            self.fallback = fallback_lib.RowPasses(
                request.ys, [self.xs[k] for k in plan.fallback], request.batch_size,
                request.num_groups or request.batch_size)
        elif plan.fallback and not plan.uses_rules:
            # no rule used: the towers compute every weight (exactly `build_towers`)
            self.covered, self.fallback_indices = [], list(range(len(self.xs)))
            self.fallback = towers_lib.towers_of(request, "towers", devices)
        elif plan.fallback:
            self.fallback = towers_lib.towers_of(request.restricted(plan.fallback),
                                                 "towers", devices)
        # the fallback serves every weight and checks the fed batch itself (towers)
        self._alone = (not self.covered and self.fallback is not None
                       and self.fallback.checks_batch)

    @property
    def _fallback_scope(self):
        return self.fallback.scope if self.fallback is not None else None

    def rule_checks(self):
        """The run-time checks of the fed batch the rules and row passes wait for."""
        if self.plan.uses_rules or (self.fallback is not None
                                    and not self.fallback.checks_batch):
            return _engine.run_time_checks(self.plan)
        return []

    def _fallback_formed(self, name):
        """({k: [G, *xs[k].shape]}, {k: [G]}): the fallback's gradients and squared norms."""
        if self.fallback is None:
            return {}, {}
        formed = self.fallback.formed(name=name)
        squares = self.fallback.squared_norms(formed)
        at = self.fallback_indices
        return ({at[i]: g for i, g in formed.items()},
                {at[i]: s for i, s in squares.items()})

    def gradients(self, grad_ys=None, unconnected_gradients="zero", name=None, sparse=False):
        """One [G, *x.shape] entry per x (None for an unreached x with "none")."""
        if self._alone:
            return [independence.gated(g) for g in self.fallback.gradients(
                grad_ys=grad_ys, unconnected_gradients=unconnected_gradients,
                name=name or "gradients", sparse=sparse)]
        with tf.name_scope(name or "gradients"):
            checks = self.rule_checks()
            with tf.control_dependencies(checks):
                results = [None] * len(self.xs)
                covered = _engine.gradients(self.plan, self.covered, self.groups,
                                            grad_ys, unconnected_gradients)
                for k, g in covered.items():
                    results[k] = g
                if self.fallback is not None:
                    for k, g in zip(self.fallback_indices, self.fallback.gradients(
                            grad_ys=grad_ys, unconnected_gradients=unconnected_gradients,
                            name=self._fallback_scope, sparse=sparse)):
                        results[k] = g
                if not checks:   # (an Identity per result would wait for nothing)
                    return results
                return [independence.gated(g) for g in results]

    def squared_norms(self, name=None, per_weight=False):
        """[G] squared norms of each group's gradient over all xs; with per_weight
        [G, len(xs)], column k over xs[k] alone (0 for a weight `ys` does not reach)."""
        with tf.name_scope(name or "gradients"):
            ys = self.plan.request.ys
            with tf.control_dependencies(self.rule_checks()):
                _, squares, _ = _engine.norm_parts(self.plan, self.covered,
                                                   self.groups)               # {k: [G]}
                _, fallback_squares = self._fallback_formed(
                    "tower_gradients" if self._alone else self._fallback_scope)
            squares.update(fallback_squares)                                  # {k: [G]}
            return self._total(squares, ys.dtype, per_weight)

    def _total(self, squares, dtype, per_weight):
        """{k: [G]} -> their sum [G]; with per_weight [G, K] (zeros for the missing k)."""
        if per_weight or not squares:
            zeros = tf.zeros(tf.reshape(self.groups, [1]), dtype=dtype)        # [G]
        if per_weight:
            return tf.stack([tf.cast(squares[k], dtype) if k in squares else zeros
                             for k in range(len(self.xs))], axis=1)            # [G, K]
        return tf.add_n([tf.cast(s, dtype) for s in squares.values()] or [zeros])

    def clipped_sum(self, factors_of, name=None, per_weight=False):
        """DP-SGD's clipped sum from one forward pass and one backward pass.

        The rules' norms and their reweighted sum share the dZ of ONE tf.gradients of
        sum(ys) (`_engine.norm_parts`, `_engine.clipped_sums`), so a random op (dropout)
        is differentiated with the draws of `ys` in the same run; the fallback's weights
        are formed, [G, *x.shape], and contracted with the factors.

        `factors_of` maps the [G] norms to the [G] factors f (with per_weight, [G, K]
        to [G, K]: column k for xs[k]). Returns (norms, factors, sums): sums[k] =
        sum_g f_g grad_g(xs[k]), [*xs[k].shape] (zeros for a weight `ys` does not
        reach), f held constant.
        """
        with tf.name_scope(name or "clipped_sum"):
            plan, ys, G = self.plan, self.plan.request.ys, self.groups
            with tf.control_dependencies(self.rule_checks()):
                d_outputs, squares, formed = _engine.norm_parts(plan, self.covered, G)
                fallback_formed, fallback_squares = self._fallback_formed(
                    self._fallback_scope)
            norms = tf.sqrt(self._total({**squares, **fallback_squares}, ys.dtype,
                                        per_weight))                    # [G] or [G, K]
            norms = self.validated([norms])[0]
            factors = tf.stop_gradient(factors_of(norms))             # [G] or [G, K]
            if per_weight:   # each weight's sum with its own column of factors
                sums = {}
                for k in self.covered:
                    sums.update(_engine.clipped_sums(plan, [k], d_outputs, formed,
                                                     factors[:, k]))
                for k, g in fallback_formed.items():
                    sums.update(self.fallback.clipped_sum({k: g}, factors[:, k]))
            else:
                sums = _engine.clipped_sums(plan, self.covered, d_outputs, formed, factors)
                if self.fallback is not None:
                    sums.update(self.fallback.clipped_sum(fallback_formed, factors))
            results = []
            for k, x in enumerate(self.xs):
                if k not in sums:
                    sums[k] = tf.zeros(x.shape, x.dtype.base_dtype) if \
                        x.shape.is_fully_defined() else tf.zeros_like(x)
                results.append(independence.gated(sums[k]))
            return norms, factors, results

    def validated(self, results):
        """`results` gated on the run-time independence check when the plan asks for it."""
        if not self.plan.validate:
            return results
        stacked = self.fallback.stacked if self.fallback is not None else None
        if stacked is None:
            # `ys` recomputed slice by slice: a forward-only replay, no weight copied
            stacked = towers_lib.towers_of(self.plan.request.restricted([]),
                                           "validate_towers").stacked
        return independence.validated(results, self.ys, stacked)

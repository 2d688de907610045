"""The rule registry: which op types have a per-example gradient rule, and the rule API.

Notation:
    B   examples in the batch          G   groups of contiguous examples (G = B for
    A   the op's batch-side input          per-example gradients, M for microbatches)
    dZ  the gradient of sum(ys) (or of sum(grad_ys * ys)) at the op's output
    w   the weight at the op's input `slot` (after any reshape of the variable's value)

A rule turns the batched A and dZ of one op into one gradient per group of examples,
[G, *w.shape], where `pertower._batch_axis` proves that A's and dZ's rows are
example-major and row i of `ys` depends on example i alone; `Rule.match` checks the rest.
"""

import dataclasses

import tensorflow as tf

from pertower import _context
from pertower._layout import _rows

__all__ = ["Rule", "ForwardingRule", "RuleRegistry", "Use", "FormedNorms",
           "batch_gradient_clipped_sum", "register_each"]


@dataclasses.dataclass(frozen=True)
class Use:
    """One covered read of a weight: input `slot` of `op`, covered by `rule`, with the
    batch-side input A (`activation`, [B*k, ...]), the output Z whose gradient dZ the
    rule uses (`output`, [B*k, ...]), the weight's shape as the op sees it (static unless
    the rule has `dynamic_weight_shape` and the weight is read through a function), the
    `Rows` of A (k rows per example), and the weight-only ops it is read `through`
    (`rules._weight_functions`; empty for a direct read)."""

    op: tf.Operation
    slot: int
    rule: object
    activation: tf.Tensor
    output: tf.Tensor
    weight_shape: tf.TensorShape
    rows: object
    through: tuple = ()

    @property
    def label(self):
        """How `pertower.explain` names the read: the op, and the ops it goes through."""
        return f"{self.op.name} ({self.op.type})" + "".join(
            f"{' through ' if j == 0 else ', '}{o.name} ({o.type})"
            for j, o in enumerate(self.through))


@dataclasses.dataclass(frozen=True)
class FormedNorms:
    """[G] squared norms (`squares`) of per-group gradients formed in a rule's own
    layout (`per_example`, [G, ...]; `Rule.formed_norms`), kept for the clipped sum;
    `to_weight` maps a sum over the groups, [...], to [*w.shape]."""

    squares: tf.Tensor
    per_example: tf.Tensor
    to_weight: object

    def clipped_sum(self, factors):
        """[*w.shape]: sum_g factors_g grad_g(w), `factors` [G]."""
        total = tf.tensordot(tf.cast(factors, self.per_example.dtype), self.per_example,
                             axes=1)                                   # [...]
        return self.to_weight(total)


class Rule:
    """Base class of per-op rules: one method per quantity (per-example gradient,
    squared norm, sum of squares, clipped sum, K-FAC rows, row layouts). A subclass
    defines `match` and `per_group`; the others default to "no cheaper form" (None: the
    caller forms the quantity from `per_group`)."""

    # whether `per_group` takes the weight's sizes from the graph, so that a function of
    # a weight with dynamic sizes (a position table's first T rows) may reach it
    dynamic_weight_shape = False

    def match(self, op, slot, analysis):
        """A `Use` when this rule covers the weight at input `slot` of `op`, else a
        string saying why not (shown when the weight falls back to towers)."""
        raise NotImplementedError

    def per_group(self, use, dZ, G):
        """[G, *use.weight_shape]: the gradient of each group's part of sum(ys) through
        this use; the groups are G (int or scalar tensor) contiguous blocks of rows."""
        raise NotImplementedError

    def squared_norms(self, use, dZ, B):
        """[B] squared norms of the per-example gradients, without forming them."""
        return None

    def formed_norms(self, use, dZ, G):
        """A `FormedNorms`, asked where `squared_norms` has no cheap form."""
        return None

    def sum_squared(self, use, dZ_columns, B, per_example=False):
        """sum_c grad_{i,c}(w) ⊙ grad_{i,c}(w), grad_{i,c} example i's gradient for the
        output gradient dZ_columns[c] ([C, B*k, ...]: 1 column for
        `pertower.sum_grad_squared`, the loss Hessian's for `pertower.diag_ggn`):
        [B, *w.shape] with per_example, else summed over the examples, [*w.shape]."""
        return None

    def sum_squared_size(self, use, C, per_example=False):
        """The numbers per example `sum_squared` holds for C columns (memory guard);
        None: counted as C per-example gradients."""
        return None

    def clipped_sum(self, use, dZ, factors):
        """[*w.shape]: sum_i factors_i grad_i(w), `factors` [B] (DP-SGD's clipped sum).
        This default forms `per_group`; `batch_gradient_clipped_sum` does not."""
        per_example = self.per_group(use, dZ, _rows.dim(factors, 0))     # [B, *w.shape]
        return tf.tensordot(tf.cast(factors, per_example.dtype), per_example, axes=1)

    def kfac_rows(self, use):
        """[R, d_in]: the input rows whose outer products sum to the Kronecker factor A
        of the kernel's GGN block (`pertower.kfac_factors`; dZ's rows give G), or a
        string saying why the kernel has no Kronecker form."""
        return None

    def output_layouts(self, op, inputs):
        """For an op type `pertower._batch_axis` does not know: the outputs' layouts
        from the inputs' (`Rows`, `INDEPENDENT`, `SIZE`, or None for unknown)."""
        return None

    def example_use(self, op, slot, analysis):
        """The `Use` with A = input 0 and Z = output 0 of `op` when `analysis` proves
        their rows' examples; else why not."""
        rows = _rows.example_rows(analysis, op.inputs[0], op.outputs[0])
        if isinstance(rows, str):
            return rows
        return Use(op, slot, self, op.inputs[0], op.outputs[0], op.inputs[slot].shape, rows)


# the methods of `Rule` a registered object may define (the others take the defaults)
_METHODS = ("match", "per_group", "squared_norms", "formed_norms", "sum_squared",
            "sum_squared_size", "clipped_sum", "kfac_rows", "output_layouts")


class _Adapted(Rule):
    """A registered object that defines `match` and `per_group` without deriving from
    `Rule`: its own methods, and `Rule`'s defaults for the others."""

    def __init__(self, rule):
        self.wrapped = rule
        for name in _METHODS:
            own = getattr(rule, name, None)
            if callable(own):
                setattr(self, name, own)

    def __repr__(self):
        return f"<Rule adapted from {self.wrapped!r}>"


class ForwardingRule(Rule):
    """A rule that computes through another rule's `Use` (a function call's body op, a
    function of the weights): every quantity is the inner rule's, mapped to this use's
    weight by `outward` (a linear map that keeps the norms and squares of a re-layout)."""

    def inner(self, use, dZ):
        """(the inner rule's `Use`, dZ in its output's layout)."""
        raise NotImplementedError

    def inner_columns(self, use, dZ_columns):
        """(the inner `Use`, [C, ...] columns of dZ in its output's layout)."""
        return self.inner(use, None)[0], dZ_columns

    def outward(self, result, use, leading):
        """The inner rule's result [*leading, *inner weight] as [*leading, *w.shape]."""
        del use, leading
        return result

    def per_group(self, use, dZ, G):
        inner, dZ = self.inner(use, dZ)
        return self.outward(inner.rule.per_group(inner, dZ, G), use, [G])

    def squared_norms(self, use, dZ, B):
        inner, dZ = self.inner(use, dZ)
        return inner.rule.squared_norms(inner, dZ, B)

    def formed_norms(self, use, dZ, G):
        inner, dZ = self.inner(use, dZ)
        formed = inner.rule.formed_norms(inner, dZ, G)
        if formed is None:
            return None
        to_weight = formed.to_weight
        return dataclasses.replace(
            formed, to_weight=lambda total: self.outward(to_weight(total), use, []))

    def sum_squared(self, use, dZ_columns, B, per_example=False):
        inner, dZ_columns = self.inner_columns(use, dZ_columns)
        out = inner.rule.sum_squared(inner, dZ_columns, B, per_example)
        return None if out is None else self.outward(out, use, [B] if per_example else [])

    def sum_squared_size(self, use, C, per_example=False):
        inner = self.inner(use, None)[0]
        return inner.rule.sum_squared_size(inner, C, per_example)

    def clipped_sum(self, use, dZ, factors):
        inner, dZ = self.inner(use, dZ)
        return self.outward(inner.rule.clipped_sum(inner, dZ, factors), use, [])


def batch_gradient_clipped_sum(rule, use, dZ, factors):
    """sum_i factors_i grad_i(w) as the one-group `per_group` of dZ with example i's
    rows scaled by factors_i (gradients are linear in dZ; the book-keeping of Bu et al.
    2023, arXiv 2210.00038): cheap where one group is the ordinary batch gradient."""
    return rule.per_group(use, _rows.scale_rows(dZ, factors), 1)[0]


class RuleRegistry:
    """Maps op types to rules (`pertower.rules.default_registry()`, then `register`)."""

    def __init__(self):
        self._rules = {}

    @_context.public("RuleRegistry.register")
    def register(self, op_type, rule):
        """Registers `rule` (a `Rule`) for `op_type`, replacing any before. An object
        that only defines `match` and `per_group` gets `Rule`'s other methods."""
        if not isinstance(op_type, str) or not op_type:
            raise _context.error(TypeError, f"`op_type` must be an op type name such as "
                                            f"'MatMul', but received {op_type!r}.")
        if isinstance(rule, type):
            raise _context.error(TypeError, f"`rule` must be a rule object, but received the "
                                            f"class {rule.__name__}; pass an instance, "
                                            f"{rule.__name__}().")
        if not isinstance(rule, Rule):
            missing = [name for name in _METHODS[:2] if not callable(getattr(rule, name, None))]
            if missing:
                raise _context.error(
                    TypeError, "`rule` must define `match` and `per_group` (derive it from "
                    f"pertower.rules.Rule), but received {rule!r}, which has no "
                    f"{' or '.join(f'`{name}`' for name in missing)}.")
            rule = _Adapted(rule)
        self._rules[op_type] = rule

    def lookup(self, op_type):
        """The rule for `op_type`, or None."""
        return self._rules.get(op_type)

    def op_types(self):
        """The op types that have a rule, sorted."""
        return sorted(self._rules)

    def copy(self):
        """A new registry with the same rules."""
        other = RuleRegistry()
        other._rules = dict(self._rules)  # pylint: disable=protected-access
        return other


def register_each(registry, op_types, rule):
    """Registers `rule` for every op type of `op_types`, in sorted order."""
    for op_type in sorted(op_types):
        registry.register(op_type, rule)

"""Run-time checks that `ys` has independent examples: `validate=True`, `check_independence`.

Notation:
    B   examples in the batch       T   towers; each takes B/T examples on its own
    ys  per-example values, [B, ...]
    stacked  the tower outputs concatenated, [B, ...]: `ys` recomputed slice by slice

What the static scan (`pertower._batch_axis`) cannot see (a py_function, a custom
kernel) shows at run time: with independent examples, computing them slice by slice
gives `ys` again. Both checks compare the two on real data:

    max |stacked - ys|  <=  tolerance * (1 + max |ys|)

with tolerance 1e-4 for float32 (1e-9 float64, 1e-2 float16/bfloat16): above the
rounding of kernels run on other batch sizes, far below what a coupling changes.
"""

import dataclasses

import tensorflow as tf

from pertower import _checks
from pertower import _docs
from pertower._towers import sparse
from pertower._towers import build as towers_lib
from pertower import _context

__all__ = ["IndependenceCheck", "check_independence", "validated", "gated"]

_TOLERANCES = {tf.float64: 1e-9, tf.float32: 1e-4, tf.float16: 1e-2, tf.bfloat16: 1e-2}


def _tolerance(dtype):
    return _TOLERANCES.get(tf.as_dtype(dtype).base_dtype, 1e-4)


def _differences(stacked, ys):
    """([B] max |stacked - ys| per example (0 where both are NaN), the scalar bound)."""
    both_nan = tf.logical_and(tf.math.is_nan(stacked), tf.math.is_nan(ys))
    difference = tf.where(both_nan, tf.zeros_like(ys), tf.abs(stacked - ys))  # [B, ...]
    if difference.shape.rank is not None and difference.shape.rank > 1:
        difference = tf.reduce_max(difference, axis=list(range(1, difference.shape.rank)))
    scale = tf.reduce_max(tf.where(tf.math.is_nan(ys), tf.zeros_like(ys), tf.abs(ys)))
    bound = _tolerance(ys.dtype) * (1 + scale)
    return difference, bound  # [B], scalar


@dataclasses.dataclass(frozen=True)
class IndependenceCheck:
    """What `check_independence` built; every field but `tolerance` is a graph tensor.

    Attributes:
      independent: scalar bool, max_difference <= bound.
      max_difference: scalar, max |stacked - ys| over the batch.
      per_example_difference: [B], the same over each example's entries (the rows
        that change are the examples that depend on others).
      bound: scalar, tolerance * (1 + max |ys|).
      tolerance: the relative tolerance (a Python float).
      towers: the `Towers` whose stacked outputs are compared with `ys`.
    """

    independent: tf.Tensor
    max_difference: tf.Tensor
    per_example_difference: tf.Tensor
    bound: tf.Tensor
    tolerance: float
    towers: towers_lib.Towers


@_context.public("check_independence")
@_docs.documented
def check_independence(ys, batch=None, batch_size=None, num_microbatches=None, name=None,
                       num_towers=None, batch_axis=None):
    """Builds a run-time check that the examples of `ys` do not depend on each other.

    `ys` is recomputed slice by slice (towers of B/T examples, one example each by
    default) and compared with `ys` itself. Run `independent` once on real data: True
    means per-example gradients of `ys` are well defined on that data (as far as
    values show it), False that some op couples examples.

    Args:
      ys: per-example values, [B, ...].
      {options: batch, name, batch_axis}
      batch_size: B, needed when the batch axis is not static.
      num_microbatches: T, the number of slices (None: one per example). Microbatch
        gradients with M microbatches need independence between microbatches only:
        check with num_microbatches=M.
      num_towers: deprecated name of `num_microbatches` (a DeprecationWarning; giving
        both is a TypeError).

    Returns:
      An `IndependenceCheck`; fetch `.independent` (and `.max_difference`).

    Raises:
      ValueError: an op between the batch and `ys` is known to couple examples (for
        example batch normalization in training mode), or the arguments are invalid.

    Example:
      check = pertower.check_independence(cost, batch_size=32)
      ok, worst = sess.run([check.independent, check.max_difference], feed)
    """
    scope = name or _context.name()   # "check_independence"
    T, towers_argument = _checks.renamed_argument(
        num_microbatches, num_towers, "num_microbatches", "num_towers")
    towers = towers_lib.replay_forward(ys, batch, T, batch_size, scope, towers_argument,
                                       batch_axis=batch_axis)
    with ys.graph.as_default(), tf.name_scope(scope):
        difference, bound = _differences(towers.stacked, ys)
        max_difference = tf.reduce_max(difference, name="max_difference")
        independent = tf.less_equal(max_difference, bound, name="independent")
    return IndependenceCheck(independent=independent, max_difference=max_difference,
                             per_example_difference=difference, bound=bound,
                             tolerance=_tolerance(ys.dtype), towers=towers)


def gated(result):
    """`result` (a tensor, IndexedSlices, SparseTensor or None) read after the
    current control dependencies."""
    if result is None:
        return None
    if isinstance(result, sparse.PerExampleIndexedSlices):
        return result._replace(values=tf.identity(result.values))
    if isinstance(result, tf.IndexedSlices):
        return tf.IndexedSlices(tf.identity(result.values), result.indices,
                                result.dense_shape)
    if isinstance(result, tf.SparseTensor):
        return tf.SparseTensor(result.indices, tf.identity(result.values),
                               result.dense_shape)
    return tf.identity(result)


def validated(results, ys, stacked):
    """`results` (entries may be None) gated on a run-time assertion that `stacked`,
    [B, ...], equals `ys` within the bound (else InvalidArgumentError on fetching)."""
    with tf.name_scope("validate"):
        difference, bound = _differences(stacked, ys)
        worst = tf.reduce_max(difference)
        check = tf.debugging.Assert(
            tf.less_equal(worst, bound),
            [f"{_context.prefix()}(validate=True): `ys` ({ys.name}) recomputed one "
             "slice of the batch at a time differs from `ys` by up to", worst,
             "(allowed:", bound, "). So an example's value depends on other examples "
             "through an op pertower's static scan does not know (a py_function, a "
             "custom op, a reduction it could not follow), or a random op (dropout in "
             "training mode) draws other numbers in every slice. The per-example "
             "gradients of this graph are not those of `ys`: keep each example's "
             "computation to its own rows (BatchNormalization with training=False, "
             "reductions over non-batch axes), and see pertower.check_independence "
             "for the differences per example."],
            summarize=1, name="check_ys")
        with tf.control_dependencies([check]):
            return [gated(r) for r in results]

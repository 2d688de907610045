"""The batch's one draw of sampled classes, shared by the towers.

Notation: B examples, T towers, S sampled classes, num_true true classes per example.

A candidate sampler of a fixed distribution (`op_types.FIXED_CANDIDATE_SAMPLER_OP_TYPES`,
the sampler of `tf.nn.sampled_softmax_loss` and `tf.nn.nce_loss`) draws S classes once
per run for the whole batch; every example's loss is computed against that one draw.
Per-example gradients are defined given the draw: example i's gradient is that of its
loss with the batch's sampled classes, so that the B gradients sum to the batch
gradient TensorFlow computes in the same run (the one-example loop matches them when it
is fed the same draw). A tower that copied the sampler would draw other classes (and,
with `unique=True`, other expected counts: they depend on the draw's number of tries).
So the sampler is not replayed: each tower reads the batch's sampled classes and their
expected counts [S], and its own rows of the true classes' expected counts
[B, num_true] -> [B/T, num_true] (sliced as the batch is).
"""

import tensorflow as tf

from pertower import _op_types as op_types
from pertower import _tf
from pertower._batch_axis.lattice import Rows

__all__ = ["shared_samplers"]


def shared_samplers(replayed, analysis):
    """The fixed-distribution candidate samplers among `replayed` whose true classes
    hold one row per example on axis 0 (the analysis' Rows(0, 1, .)); the towers share
    their draws. Others stay replayed (each tower draws its own; the run-time check of
    `ys` then refuses the result)."""
    shared = []
    for op in sorted(replayed, key=_tf.op_order_key()):
        if op.type not in op_types.FIXED_CANDIDATE_SAMPLER_OP_TYPES:
            continue
        value = analysis.value(op.inputs[0]) if analysis is not None else None
        if isinstance(value, Rows) and value.lead == 0 and value.k == 1:
            shared.append(op)
    return shared


def per_example_outputs(samplers):
    """The per-example output of each shared sampler: true_expected_count [B, num_true]."""
    return [op.outputs[1] for op in samplers]


def static_rows(tensors):
    """Static axis-0 sizes of `tensors` (None where unknown), as `slicing` takes them."""
    return [tf.compat.dimension_value(t.shape[0]) if t.shape.rank else None
            for t in tensors]

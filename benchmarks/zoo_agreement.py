"""Agreement of the zoo bench's per-example gradients with the one-example loop
(`benchmarks.zoo_bench`): the relative difference, the line on a row that
disagrees, and the check of such a row at the batch's own forward.

Notation:
    B   examples in the batch

What a disagreement means: pertower reads the forward pass of the whole batch [B, ...];
the loop runs the network on one example at a time [1, ...], and TensorFlow's kernels (a
convolution's blocking depends on the batch size) may round the two forwards differently
in the last bits. Where a ReLU's (ReLU6's) input is within that rounding of its kink (0
or 6), the two forwards take different sides and the gradient of that unit is on in one
and off in the other: the two differ by the unit's whole term, however correct each is
for the forward it read. MobileNetV2 at zoo seed 8, B = 32: example 8's out_relu input,
channel 1078, is +5.9e-18 in the batch forward, -6.5e-19 alone and -7.9e-18 in float64,
where the two float32 forwards of that layer differ by up to 3.5e-17; Conv_1_bn/beta's
gradient differs by 1.7e-2 of the scale. VGG16 at seed 9, B = 16: fc1 unit 2124 of
example 14, +8.7e-11, -7.1e-11, float64 -1.7e-10; 2.4e-2. Such a unit's side is not
decided by float32 arithmetic, and TensorFlow's own batch gradient takes the batch
forward's side, as pertower does. So a row over the tolerance is checked once more, for
each example over it, against that example's gradient at the batch's own forward
(`tf.gradients` of mask · loss, mask [B] the one-hot of the example, fed the whole
batch: TensorFlow's own backward of the forward pertower reads). `forward_diff` is
pertower's difference from it, `loop_forward_diff` the loop's; a row whose
`forward_diff` is within the tolerance agrees (the difference from the loop lies in the
forward pass, in TensorFlow's rounding at a kink, not in pertower) and the table says
"fwd" beside the number; any other row over the tolerance is WRONG.
"""

import numpy as np
import tensorflow as tf

from benchmarks import report as report_lib

__all__ = ["RELATIVE_TOLERANCE", "DIFF_NOTE", "BatchForwardGradients", "max_relative_diff",
           "examples_over", "check_at_batch_forward", "disagreement", "diff_cell"]

# agreement with the loop: max |got - loop| <= RELATIVE_TOLERANCE * max |loop|
RELATIVE_TOLERANCE = 1e-3
DIFF_NOTE = ("max rel diff ... fwd x: over the tolerance against the loop, and x against "
             "TensorFlow's backward of the batch's own forward for the examples over it "
             "(within the tolerance: the batch and one-example forwards round to "
             "different sides of a ReLU's kink; see benchmarks.zoo_agreement).")


def max_relative_diff(got, want, scale=None):
    """max |got - want| / scale over the weights (scale: max |want| unless given)."""
    if scale is None:
        scale = max(float(np.max(np.abs(w))) for w in want)
    worst = max(float(np.max(np.abs(g - w))) for g, w in zip(got, want))
    return worst / scale if scale > 0 else worst


def examples_over(got, want, B):
    """The examples b whose max |got[b] - want[b]| over the weights is over the tolerance
    relative to max |want|."""
    scale = max(max(float(np.max(np.abs(w))) for w in want), 1e-30)
    per_example = np.max([np.abs(g - w).reshape(B, -1).max(axis=1)
                          for g, w in zip(got, want)], axis=0) / scale            # [B]
    return np.flatnonzero(per_example > RELATIVE_TOLERANCE).tolist()


class BatchForwardGradients:
    """Example b's gradient at the forward pass of its whole batch: `tf.gradients` of
    sum(mask · loss), mask [B] the one-hot of b, run on the batch's feed; the backward
    TensorFlow itself gives for the forward per-example gradients read (the loop instead
    runs the network on [1, ...])."""

    def __init__(self, loss, weights):
        self.mask = tf.compat.v1.placeholder(loss.dtype, [None], name="example_mask")  # [B]
        gradients = tf.gradients(tf.reduce_sum(self.mask * loss), weights)
        self.gradients = [tf.zeros_like(w) if g is None else tf.convert_to_tensor(g)
                          for g, w in zip(gradients, weights)]

    def run(self, sess, feed, B, examples):
        """[len(examples), *w] per weight: one sess.run per example."""
        rows = []
        for b in examples:
            mask = np.zeros([B], self.mask.dtype.as_numpy_dtype)
            mask[b] = 1
            rows.append(sess.run(self.gradients, {**feed, self.mask: mask}))
        return [np.stack([row[k] for row in rows]) for k in range(len(self.gradients))]


def check_at_batch_forward(row, sess, forward, feed, first):
    """Sets row.forward_diff / row.loop_forward_diff for a row over the tolerance:
    pertower's and the loop's difference from `forward`'s gradients of the examples over
    the tolerance, relative to max |loop's|. Returns a line that says so."""
    got, want = first
    scale = max(float(np.max(np.abs(w))) for w in want)
    examples = examples_over(got, want, row.batch_size)
    at_batch = forward.run(sess, feed, row.batch_size, examples)
    row.forward_diff = max_relative_diff([g[examples] for g in got], at_batch, scale)
    row.loop_forward_diff = max_relative_diff([w[examples] for w in want], at_batch, scale)
    verdict = ("the forwards at B and at 1 differ, not pertower"
               if row.forward_diff <= RELATIVE_TOLERANCE else "WRONG")
    return (f"  at the batch's own forward (examples {examples}): pertower differs by "
            f"{row.forward_diff:.1e}, the loop by {row.loop_forward_diff:.1e}: {verdict}")


def disagreement(sess, gradients, loop, feed, B, first, weights):
    """One line on a row that disagrees with the loop: the worst weight, the examples
    over the tolerance, and whether a second run of each side gives the same numbers
    (a side that does not is nondeterministic; one that does is wrong or ill-conditioned).
    `first` is (pertower's [B, *w] per weight, the loop's), already run once."""
    got, want = first
    scale = max(float(np.max(np.abs(w))) for w in want)
    worst = max(range(len(want)), key=lambda k: float(np.max(np.abs(got[k] - want[k]))))
    per_example = (np.abs(got[worst] - want[worst]).reshape(B, -1).max(axis=1)
                   / max(scale, 1e-30))                                        # [B]
    again = sess.run(gradients, feed), loop.run(sess, feed, B)
    reruns = [max_relative_diff(a, b) for a, b in zip(again, first)]
    return (f"  DISAGREES: worst weight {weights[worst].name}, examples "
            f"{np.flatnonzero(per_example > RELATIVE_TOLERANCE).tolist()} over "
            f"{RELATIVE_TOLERANCE:.0e}; a second run differs from the first by "
            f"{reruns[0]:.1e} (pertower), {reruns[1]:.1e} (loop); second runs against "
            f"each other {max_relative_diff(*again):.1e}")


def diff_cell(row):
    """"1.2e-07", "1.7e-02 fwd 4.1e-08" (agrees at the batch's forward) or "... WRONG"."""
    text = report_lib.cell(row.max_relative_diff, ".1e")
    if row.forward_diff is not None:
        text += f" fwd {row.forward_diff:.1e}"
    return text + ("" if row.agrees in (None, True) else " WRONG")


"""Functions of the weights alone inside a loop body by the criterion outside loops
(`rules._weight_functions.follow`, read by `pertower._loops.uses`): a gather of a
position table's rows every example reads, `tf.gather(table, ids)` with ids from
`tf.range(T)` or from the size of a non-batch axis (`SameAlone`), is pulled back
through the gather in a raw tf.while_loop, and the op after it is the per-step rule.

The checks run in graph mode here (a `While`, the table read through its handle by a
ResourceGather) and under `disable_v2_behavior()` in tests/legacy/test_loop_weight_side.py
(a TF1 frame, a GatherV2 of the reference variable's value), against the one-example loop,
without batch_size.
"""

import numpy as np
import pytest
import tensorflow as tf

import pertower
from pertower import oracle
from tests import common
from tests import test_rules_weight_functions as weight_functions

B, T, D = 4, 4, 3


def _positions(table, x, ids):
    """[n, D] rows of `table`: range(T) of x [B, T, D] ("range"), or range(4) clipped to
    T - 1 with T dynamic ("clipped": ids from the size of a non-batch axis)."""
    length = tf.shape(x)[1]
    if ids == "range":
        return tf.gather(table, tf.range(length))                         # [T, D]
    return tf.gather(table, tf.minimum(tf.range(4), length - 1))          # [4, D]


def check_gather_in_a_loop_body(ids):
    """Three steps of s <- tanh((s + rows) W) on s [B, T, D] ("range", T static), or
    h <- tanh(h W + sum of the rows) on h [B, D] ("clipped", T dynamic): the table on
    the rules through its gather, the Add's broadcast rule per step."""
    with tf.Graph().as_default() as graph:
        common.seed_weights(90)
        x = tf.compat.v1.placeholder(tf.float32, [None, T if ids == "range" else None, D],
                                     name="x")
        w = tf.compat.v1.get_variable("w", [D, D])
        table = tf.compat.v1.get_variable("table", [10, D])

        def body(i, s):
            rows = _positions(table, x, ids)
            if ids == "range":                                             # s [B, T, D]
                return i + 1, tf.tanh(tf.einsum("btd,de->bte", s + rows, w))
            return i + 1, tf.tanh(s @ w + tf.reduce_sum(rows, axis=0))    # s [B, D]

        start = x if ids == "range" else tf.reduce_mean(x, axis=1)
        s = tf.while_loop(lambda i, s: i < 3, body, [0, start])[1]
        ys = tf.reduce_sum(tf.reshape(s, [tf.shape(s)[0], -1]), axis=1)   # [B]
        _, through = weight_functions._plan_through(ys, [w, table])
        assert "(AddV2) in" in through[table.name], through
        # (built before the session first runs the loop)
        grads = pertower.per_example_gradients(ys, [w, table], method="rules")
        norms = pertower.per_example_norms(ys, [w, table], method="rules")
        sess = weight_functions._session(graph)
        feed = {x: np.random.RandomState(91).randn(B, T, D)}
        got, got_norms = sess.run([grads, norms], feed)
        want = oracle.loop_per_example_gradients(sess, ys, [w, table], feed)
        what = f"gather ({ids}) in a loop body"
        common.assert_all_close(got, want, what=what, kind="deep")
        want_norms = np.sqrt(sum(np.sum(g.reshape(B, -1) ** 2, axis=1) for g in want))
        common.assert_all_close([got_norms], [want_norms], what=f"{what}: norms", kind="deep")


@pytest.mark.parametrize("ids", ["range", "clipped"])
def test_a_gather_of_rows_every_example_reads_in_a_loop_body_matches_the_loop(ids):
    check_gather_in_a_loop_body(ids)

"""A weight as the LEFT operand of a MatMul (issue 32, item 3): Z = W x^T, [n, B], whose
columns are examples, is the right-operand product seen transposed (Z^T = x W^T;
`rules.matmul`), in a tf.while_loop body (the loop carries A_t and dZ_t with the batch
on their axis 1, `pertower._loops`) and outside a loop. Per-example gradients, norms and
a noiseless DP step against the one-example loop (`test_rules_recurrent_weight_functions.
_check` for the loops: two fed batch sizes, a None and a static batch dimension); every
transposition of W and x.
"""

import numpy as np
import pytest
import tensorflow as tf

import pertower
from pertower import oracle
from tests import common
from tests.test_rules_recurrent_weight_functions import _check

D = 3
# (transpose_a, transpose_b); the middle two run with -m heavy
TRANSPOSES = [(False, True), pytest.param(True, True, marks=pytest.mark.heavy),
              pytest.param(False, False, marks=pytest.mark.heavy), (True, False)]
IDS = ["W x^T", "W^T x^T", "W x (x [d, B])", "W^T x (x [d, B])"]


def _left_product(w, h, transpose_a, transpose_b):
    """h [B, D] -> tanh(op_a(w) op_b(h'))^T, [B, D], with h' = h^T when not transpose_b."""
    right = h if transpose_b else tf.transpose(h)                       # [B, D] or [D, B]
    z = tf.matmul(w, right, transpose_a=transpose_a, transpose_b=transpose_b)   # [D, B]
    return tf.transpose(tf.tanh(z))                                     # [B, D]


@pytest.mark.parametrize("transpose_a, transpose_b", TRANSPOSES, ids=IDS)
def test_a_left_operand_in_a_raw_while_loop(transpose_a, transpose_b):
    """tf.while_loop: h <- tanh(W h^T)^T (with b) three times, W [3, 3] on the left."""
    def build(batch_size):
        x = tf.compat.v1.placeholder(tf.float32, [batch_size, D], name="x")
        w = tf.compat.v1.get_variable("w", [D, D])
        b = tf.compat.v1.get_variable("b", [D])

        def body(i, h):
            return i + 1, _left_product(w, h, transpose_a, transpose_b) + b

        _, h = tf.while_loop(lambda i, h: i < 3, body, [tf.constant(0), x])
        return tf.reduce_sum(h ** 2, axis=1), [w, b], [x], [D]

    _check(build, tol=dict(rtol=1e-4, atol=1e-5), static=True)


def test_a_left_operand_outside_a_loop():
    """y = tanh(W2 tanh(W1 x^T))^T: both weights on the left, on the rules (no towers),
    per-example gradients and norms against the one-example loop."""
    with tf.Graph().as_default() as graph:
        common.seed_weights(5)
        x = tf.compat.v1.placeholder(tf.float32, [None, D], name="x")
        w1 = tf.compat.v1.get_variable("w1", [4, D])
        w2 = tf.compat.v1.get_variable("w2", [D, 4])
        h = tf.tanh(tf.matmul(w1, x, transpose_b=True))                 # [4, B]
        h = tf.transpose(tf.tanh(tf.matmul(w2, h)))                     # [B, D]
        ys, xs = tf.reduce_sum(h ** 2, axis=1), [w1, w2]
        plan = pertower.explain(ys, xs, batch=[x])
        assert all(row.method == "rules" for row in plan.weights), str(plan)
        found = [pertower.per_example_gradients(ys, xs, batch=[x]),
                 pertower.per_example_norms(ys, xs, batch=[x])]
        loop = oracle.SliceLoop(ys, xs)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            feed = {x: np.random.RandomState(0).randn(4, D).astype(np.float32)}
            want = loop.run(sess, feed, 4)
            got, norms = sess.run(found, feed)
    common.assert_all_close(got, want, kind="deep", what="gradients")
    want_norms = np.sqrt(sum(np.sum(g.reshape(4, -1) ** 2, axis=1) for g in want))
    common.assert_all_close([norms], [want_norms], kind="deep", what="norms")


def test_a_left_operand_of_a_batch_matmul_in_a_body_stays_on_the_towers():
    """W [1, 3, 3] on the left of a BatchMatMulV2 in a body is not covered: the plan
    keeps it on the fallback (towers; row passes in a TF1 frame) and names the op."""
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, D], name="x")
        w = tf.compat.v1.get_variable("w", [1, D, D])

        def body(i, h):
            z = tf.linalg.matmul(w, h[:, :, None])                      # [B, 3, 1]
            return i + 1, tf.tanh(z[:, :, 0])

        _, h = tf.while_loop(lambda i, h: i < 3, body, [tf.constant(0), x])
        plan = pertower.explain(tf.reduce_sum(h ** 2, axis=1), [w], batch=[x])
    (row,) = plan.weights
    assert row.method in ("towers", "passes"), str(plan)
    assert "left operand of BatchMatMulV2" in row.reason, str(plan)

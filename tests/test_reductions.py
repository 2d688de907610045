"""Reductions of gradients against NumPy on the oracle's per-example gradients, and the
hand-checkable two-batch case of scenario 2 (the gradients of two batches)."""

import math

import numpy as np
import pytest
import tensorflow as tf

import pertower
from pertower import oracle
from tests import cases
from tests import common


@pytest.fixture(scope="module")
def grads():
    """(case, pertower per-example gradients as tensors, oracle values as arrays)."""
    case = cases.build_mlp(B=5)
    with case.graph.as_default():
        per_example = pertower.per_example_gradients(case.ys, case.xs, batch_size=5)
        want = oracle.loop_per_example_gradients(case.sess, case.ys, case.xs, case.feed)
    yield case, per_example, want
    case.sess.close()


def _rows(arrays):
    """[B, P] numpy: one flattened per-example gradient per row."""
    return np.concatenate([a.reshape(a.shape[0], -1) for a in arrays], axis=1)


def _run(case, tensors):
    return case.sess.run(tensors, case.feed)


def _tol(case):
    """The tolerances for the case's dtype (float32 here)."""
    return common.tolerance(case.ys.dtype)


def test_flatten_and_flatten_per_example(grads):
    case, per_example, want = grads
    with case.graph.as_default():
        matrix = pertower.flatten_per_example(per_example)
        first = pertower.flatten([g[0] for g in per_example])
    got_matrix, got_first = _run(case, [matrix, first])
    np.testing.assert_allclose(got_matrix, _rows(want), **_tol(case))
    np.testing.assert_allclose(got_first, _rows(want)[0], **_tol(case))
    assert got_matrix.shape == (5, sum(int(np.prod(x.shape)) for x in case.xs))


def test_dot_and_cosine_of_two_examples(grads):
    case, per_example, want = grads
    rows = _rows(want)
    with case.graph.as_default():
        a = [g[1] for g in per_example]
        b = [g[3] for g in per_example]
        tensors = [pertower.dot(a, b), pertower.cosine_similarity(a, b),
                   pertower.cosine_similarity(a, a)]
    dot, cosine, self_cosine = _run(case, tensors)
    np.testing.assert_allclose(dot, rows[1] @ rows[3], **_tol(case))
    np.testing.assert_allclose(
        cosine, rows[1] @ rows[3] / np.linalg.norm(rows[1]) / np.linalg.norm(rows[3]),
        **_tol(case))
    np.testing.assert_allclose(self_cosine, 1.0, **_tol(case))


def test_global_norms(grads):
    case, per_example, want = grads
    with case.graph.as_default():
        norms = pertower.global_norms(per_example)
        first_by_tf = tf.linalg.global_norm([g[0] for g in per_example])
    got, first = _run(case, [norms, first_by_tf])
    np.testing.assert_allclose(got, np.linalg.norm(_rows(want), axis=1), **_tol(case))
    np.testing.assert_allclose(got[0], first, **_tol(case))


def test_pairwise_dot_and_cosine(grads):
    case, per_example, want = grads
    rows = _rows(want)
    with case.graph.as_default():
        head = [g[:2] for g in per_example]
        tensors = [pertower.pairwise_dot(per_example), pertower.pairwise_dot(head, per_example),
                   pertower.pairwise_cosine(per_example), pertower.pairwise_cosine(head, per_example)]
    gram, cross, cos, cross_cos = _run(case, tensors)
    unit = rows / np.linalg.norm(rows, axis=1, keepdims=True)
    np.testing.assert_allclose(gram, rows @ rows.T, **_tol(case))
    np.testing.assert_allclose(cross, rows[:2] @ rows.T, **_tol(case))
    np.testing.assert_allclose(cos, unit @ unit.T, **_tol(case))
    np.testing.assert_allclose(cross_cos, unit[:2] @ unit.T, **_tol(case))
    assert cross.shape == (2, 5)


def test_cosine_of_a_zero_gradient_is_zero():
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        zero, other = tf.zeros([3]), tf.constant([1.0, 2.0, 2.0])
        pairs = pertower.pairwise_cosine([tf.zeros([2, 3])], [tf.ones([1, 3])])
        assert sess.run(pertower.cosine_similarity(zero, other)) == 0.0
        np.testing.assert_array_equal(sess.run(pairs), [[0.0], [0.0]])
        assert sess.run(pertower.dot([other], [other])) == 9.0


def test_reductions_refuse_bad_input():
    with tf.Graph().as_default():
        a, b = tf.ones([2, 3]), tf.ones([2, 4])
        with pytest.raises(ValueError, match=r"`a\[0\]` has shape \(2, 3\) but `b\[0\]` has "
                                             r"shape \(2, 4\)"):
            pertower.dot([a], [b])
        with pytest.raises(ValueError, match=r"`a` has 2 tensors but `b` has 1"):
            pertower.cosine_similarity([a, a], [a])
        with pytest.raises(ValueError, match=r"`gradient\[1\]` is None.*unconnected_gradients"):
            pertower.flatten([a, None])
        with pytest.raises(ValueError, match=r"`gradient\[0\]` is a scalar.*\[B, \.\.\.\]"):
            pertower.global_norms([tf.constant(1.0)])
        with pytest.raises(TypeError, match=r"different dtypes \(float32, float64\)"):
            pertower.flatten([a, tf.ones([2], tf.float64)])


def test_scenario_2_hand_checkable_case():
    """dense(s, 1, tanh) with a zero kernel; two batches: g1 = [3, 6, 9], g2 = [3, 6, 10],
    cos = 135 / sqrt(126 * 145)."""
    g_value, cos_value = cases.run_scenario_2_hand_checkable_case()
    np.testing.assert_array_equal(g_value, [[3, 6, 9], [3, 6, 10]])
    assert abs(cos_value - 135 / math.sqrt(126 * 145)) < 1e-6
    assert abs(cos_value - 0.9987677) < 1e-6

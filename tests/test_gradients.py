"""Every public gradient function against the one-example oracle, on every test model."""

import numpy as np
import pytest
import tensorflow as tf

import pertower
from pertower._api import gradients as gradients_lib
from pertower import oracle
from pertower._towers import backward
from tests import cases
from tests import common


# Models whose ops the default run checks on the others, so they run with the heavy
# tests (`-m heavy`): the Keras subclassed model (slow towers) and the float32 `mlp` are
# the arithmetic of `mlp_float64` and `static_mlp`; the tf.compat.v1.layers model reads
# its weights through the same MatMul and BiasAdd as they do.
_SLOW_CASES = ("subclassed", "mlp", "compat_v1_layers")
# Fewer towers than the builders' defaults: an even B (microbatches of two examples) and
# an odd one (shared_layer: "two" falls back to one microbatch per example) stay.
_SIZES = {"mlp": {"B": 4}, "mlp_float64": {"B": 4}, "shared_layer": {"B": 3}}


@pytest.fixture(scope="module", params=[
    pytest.param(name, marks=pytest.mark.heavy) if name in _SLOW_CASES else name
    for name in sorted(cases.BUILDERS)])
def case(request):
    built = cases.BUILDERS[request.param](**_SIZES.get(request.param, {}))
    yield built
    built.sess.close()


def _run(case, tensors):
    return case.sess.run(tensors, case.feed)


def _microbatches(case, microbatches):
    return 2 if microbatches == "two" and case.B % 2 == 0 else case.B


class _Built:
    """Every public function's tensors on `case`, each built (and run) the first time a
    test asks for its key, so that the heavy tests' keys cost nothing in the default run:
    key -> values.

    Keys: ("per_example", method), ("sum", method) -> (summed, batch gradient),
    ("microbatches", microbatches, method), ("jacobians", method)."""

    def __init__(self, case):
        self.case = case
        self.values = {}

    def __getitem__(self, key):
        if key not in self.values:
            with self.case.graph.as_default():
                tensors = getattr(self, f"_{key[0]}")(*key[1:])
            self.values[key] = _run(self.case, tensors)
        return self.values[key]

    def _per_example(self, method):
        case = self.case
        got = pertower.per_example_gradients(case.ys, case.xs, batch_size=case.B,
                                             method=method)
        for g, x in zip(got, case.xs):
            assert g.dtype == x.dtype.base_dtype
            assert g.shape.as_list() == [case.B] + x.shape.as_list()
        return got

    def _sum(self, method):
        case = self.case
        batch_gradient = [tf.convert_to_tensor(g) for g in
                          tf.gradients(tf.reduce_sum(case.ys), case.xs)]
        per_example = pertower.per_example_gradients(case.ys, case.xs, batch=case.batch,
                                                     batch_size=case.B, method=method)
        return [tf.reduce_sum(g, axis=0) for g in per_example], batch_gradient

    def _microbatches(self, microbatches, method):
        case = self.case
        M = _microbatches(case, microbatches)
        got = pertower.microbatch_gradients(case.ys, case.xs, num_microbatches=M,
                                            batch_size=case.B, method=method)
        for g, x in zip(got, case.xs):
            assert g.shape.as_list() == [M] + x.shape.as_list()
        return got

    def _jacobians(self, method):
        case = self.case
        out = case.outputs.shape[1:].as_list()
        got = pertower.per_example_jacobians(case.outputs, case.xs, batch_size=case.B,
                                             method=method)
        for g, x in zip(got, case.xs):
            assert g.shape.as_list() == [case.B] + out + x.shape.as_list()
        return got


@pytest.fixture(scope="module")
def built(case):
    """`_Built(case)`: the tests below share its tensors and values (one key each)."""
    return _Built(case)


def _cases(fast):
    """`case` parameters of a test that checks one mechanism on every model: the names
    in `fast` in the default run, the others heavy (and the slow cases heavy anyway)."""
    return [name if name in fast and name not in _SLOW_CASES
            else pytest.param(name, marks=pytest.mark.heavy)
            for name in sorted(cases.BUILDERS)]


@pytest.mark.parametrize("method", gradients_lib.METHODS)
def test_per_example_gradients_match_oracle(case, built, method):
    with case.graph.as_default():
        ys, _, feed = case.oracle()
        want = case.oracles.run(oracle.loop_per_example_gradients, case.sess, ys, case.xs,
                                feed)
    common.assert_all_close(built["per_example", method], want, case.rtol, case.atol,
                            f"{case.name} per-example gradients by {method}")


@pytest.mark.parametrize("method", ["auto", pytest.param("towers", marks=pytest.mark.heavy)])
def test_per_example_gradients_sum_to_batch_gradient(case, built, method):
    """(The towers' sum with -m heavy: the towers match the oracle above.)"""
    got, want = built["sum", method]
    common.assert_all_close(got, want, case.rtol * 10, case.atol * 10,
                            f"{case.name} sum over examples")


@pytest.mark.parametrize("method", ["auto", "towers"])
@pytest.mark.parametrize("microbatches", [
    "two", pytest.param("one_per_example", marks=pytest.mark.heavy)])
def test_microbatch_gradients_match_oracle(case, built, microbatches, method):
    """(One microbatch per example with -m heavy: two microbatches here, one per example
    are the per-example gradients above.)"""
    M = _microbatches(case, microbatches)
    with case.graph.as_default():
        ys, _, feed = case.oracle()
        want = case.oracles.run(oracle.loop_microbatch_gradients, case.sess, ys, case.xs,
                                feed, M)
    common.assert_all_close(built["microbatches", microbatches, method], want, case.rtol,
                            case.atol, f"{case.name} {M} microbatches by {method}")


@pytest.mark.parametrize("method", ["auto", "towers"])
def test_per_example_jacobians_match_oracle(case, built, method):
    with case.graph.as_default():
        _, outputs, feed = case.oracle()
        want = case.oracles.run(oracle.loop_per_example_jacobians, case.sess, outputs,
                                case.xs, feed)
    common.assert_all_close(built["jacobians", method], want, case.rtol, case.atol,
                            f"{case.name} per-example Jacobians by {method}")


@pytest.mark.parametrize("case", _cases({"static_mlp", "shared_layer"}), indirect=True)
def test_towers_stack_to_ys_and_leave_the_graph_alone(case):
    with case.graph.as_default():
        variables_before = list(tf.compat.v1.global_variables())
        ys_before = _run(case, case.ys)
        towers = pertower.build_towers(case.ys, case.xs, batch_size=case.B)
        assert list(tf.compat.v1.global_variables()) == variables_before
        assert towers.num_towers == case.B and towers.batch_size == case.B
        assert len(towers.outputs) == case.B and len(towers.slices) == case.B
        stacked, ys_after = _run(case, [towers.stacked, case.ys])
    np.testing.assert_allclose(stacked, ys_before, rtol=case.rtol, atol=case.atol)
    np.testing.assert_array_equal(ys_after, ys_before)


@pytest.mark.parametrize("case", _cases({"static_mlp", "cnn"}), indirect=True)
def test_towers_gradients_with_grad_ys_weight_outputs(case):
    """gradients(grad_ys=w) gives, per tower, the gradient of sum_k w[i, k] ys[i, k]:
    the per-example Jacobian contracted with w."""
    B, out = case.B, case.ys.shape[1:].as_list()
    K = int(np.prod(out)) if out else 1
    weights = np.linspace(-1.0, 2.0, B * K).reshape([B] + out)
    with case.graph.as_default():
        towers = pertower.build_towers(case.ys, case.xs, batch_size=B)
        got = towers.gradients(grad_ys=tf.constant(weights, dtype=case.ys.dtype))
        ys, _, feed = case.oracle()
        jacobians = case.oracles.run(oracle.loop_per_example_jacobians, case.sess, ys,
                                      case.xs, feed)
    want = [(j.reshape(B, K, -1) * weights.reshape(B, K, 1)).sum(axis=1).reshape(j.shape[:1] + j.shape[1 + len(out):])
            for j in jacobians]
    common.assert_all_close(_run(case, got), want, case.rtol, case.atol * 10,
                            f"{case.name} weighted tower gradients")


# Cases whose towers run a graph function (Dropout's tf.cond is an `If` op): the
# backward pass cannot be copied, so Towers.gradients makes one joint call.
JOINT_GRADIENT_CASES = {"subclassed"}


# the batched matmul (static_mlp; mlp_float64 with -m heavy), a convolution, a gather
@pytest.mark.parametrize("case", _cases({"static_mlp", "cnn", "embedding"}), indirect=True)
def test_replicated_backward_pass_equals_one_joint_gradients_call(case):
    """Towers.gradients builds tower 0's backward pass once and copies it for the other
    towers; that copy must be taken (not the joint fallback) and agree with one
    tf.gradients call over all towers' copies, with and without grad_ys."""
    B = case.B
    weights = np.linspace(0.5, 1.5, B * int(np.prod(case.ys.shape[1:].as_list() or [1])))
    with case.graph.as_default():
        towers = pertower.build_towers(case.ys, case.xs, batch_size=B)
        connected = [k for k, c in enumerate(towers.copies) if c is not None]
        for grad_ys in [None, tf.constant(weights.reshape(case.ys.shape.as_list()[:0] + [B]
                                                           + case.ys.shape[1:].as_list()),
                                          dtype=case.ys.dtype)]:
            grad_outputs = [None] * B if grad_ys is None else tf.split(grad_ys, B)
            replicated = backward.replicated_gradients(towers, connected, grad_outputs,
                                                       tf.UnconnectedGradients.ZERO)
            if case.name in JOINT_GRADIENT_CASES:
                assert replicated is None, f"{case.name}: copied a backward pass with If ops"
                return
            assert replicated is not None, f"{case.name}: fell back to the joint call"
            joint = backward.joint_gradients(towers, connected, grad_outputs,
                                             tf.UnconnectedGradients.ZERO)
            # a dense kernel's gradient comes as one batched matmul over the towers
            got = [replicated[k].stacked() if isinstance(replicated[k], backward.BatchedMatMul)
                   else tf.stack(replicated[k]) for k in connected]
            if case.name in ("mlp", "mlp_float64", "static_mlp"):
                assert any(isinstance(replicated[k], backward.BatchedMatMul)
                           for k in connected), case.name
            want = [tf.stack(joint[k]) for k in connected]
            got, want = _run(case, [got, want])
            common.assert_all_close(got, want, 1e-6, 1e-6,
                                    f"{case.name} replicated vs joint, grad_ys={grad_ys}")


def test_tf_data_iterator_outputs_are_found_as_the_batch():
    """Batch found by walking back to an iterator's outputs; compared with the oracle run
    on a placeholder input to the same layers."""
    features = np.random.RandomState(7).randn(8, 3).astype(np.float32)
    with tf.Graph().as_default() as graph:
        dense = tf.compat.v1.layers.Dense(2, activation=tf.nn.tanh)
        dataset = tf.data.Dataset.from_tensor_slices(features).batch(4, drop_remainder=True)
        batch = tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()   # [4, 3]
        ys = tf.reduce_sum(dense(batch) ** 2, axis=1)                          # [4]
        grads = pertower.per_example_gradients(ys, dense.trainable_weights)
        x = tf.compat.v1.placeholder(tf.float32, [None, 3])
        oracle_ys = tf.reduce_sum(dense(x) ** 2, axis=1)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for step in range(2):
                got = sess.run(grads)   # one iterator step: batch `step`
                want = oracle.loop_per_example_gradients(
                    sess, oracle_ys, dense.trainable_weights,
                    {x: features[4 * step:4 * step + 4]})
                common.assert_all_close(got, want, kind="tight", what=f"iterator batch {step}")


def test_towers_record_and_building_twice_on_one_graph():
    case = cases.build_shared_layer(B=4)
    with case.graph.as_default():
        first = pertower.build_towers(case.ys, case.xs, batch_size=4, num_microbatches=2)
        second = pertower.build_towers(case.ys, case.xs, batch_size=4, num_microbatches=2)
        assert first.stacked.name != second.stacked.name
        assert first.stacked.name.startswith("towers/") and second.stacked.name.startswith("towers_1/")
        assert len(first.copies) == len(case.xs) and all(len(c) == 2 for c in first.copies)
        assert first.slices[1][0].shape.as_list() == [2, 4]
        assert first.outputs[0].shape.as_list() == [2]
        grads = [first.gradients(), second.gradients()]
        want = oracle.loop_microbatch_gradients(case.sess, case.ys, case.xs, case.feed, 2)
    for got in case.sess.run(grads, case.feed):
        common.assert_all_close(got, want, case.rtol, case.atol, "towers built twice")
    case.sess.close()


def test_a_weight_listed_twice_gets_its_gradient_twice():
    case = cases.build_mlp(B=4)
    with case.graph.as_default():
        xs = [case.xs[0], case.xs[1], case.xs[0]]
        got = pertower.per_example_gradients(case.ys, xs, batch_size=4)
        want = oracle.loop_per_example_gradients(case.sess, case.ys, xs, case.feed)
    common.assert_all_close(case.sess.run(got, case.feed), want, case.rtol, case.atol,
                            "repeated weight")
    case.sess.close()

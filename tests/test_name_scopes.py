"""Every op one pertower call adds lives under one name scope (TensorBoard's graph view
stays readable): listed by comparing the graph's ops before and after the call."""

import pytest
import tensorflow as tf
import tf_keras as keras

import pertower
from tests import cases


def _rnn():
    """A SimpleRNN (a While op reading its weights in the body) and a Dense head."""
    with tf.Graph().as_default() as graph:
        x = tf.compat.v1.placeholder(tf.float32, [None, 3, 2], name="x")
        out = keras.layers.Dense(2)(keras.layers.SimpleRNN(3)(x))   # [B, 2]
        ys = tf.reduce_sum(out, axis=1)                          # [B]
    return graph, ys, out, graph.get_collection(tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES)


def _embedding():
    """tests.common's embedding model: the table is read only by a gather."""
    case = cases.build_embedding()
    case.sess.close()
    return case.graph, case.ys, case.outputs, case.xs


def _new_op_names(graph, call):
    before = {op.name for op in graph.get_operations()}
    with graph.as_default():
        call()
    return sorted(op.name for op in graph.get_operations() if op.name not in before)


CALLS = {
    "per_example_gradients": lambda ys, out, xs, name: pertower.per_example_gradients(
        ys, xs, batch_size=2, name=name),
    "per_example_gradients_sparse": lambda ys, out, xs, name: pertower.per_example_gradients(
        ys, xs, batch_size=2, sparse=True, name=name),
    "microbatch_gradients": lambda ys, out, xs, name: pertower.microbatch_gradients(
        ys, xs, num_microbatches=2, batch_size=2, name=name),
    "per_example_jacobians": lambda ys, out, xs, name: pertower.per_example_jacobians(
        out, xs, batch_size=2, name=name),
    "per_example_norms": lambda ys, out, xs, name: pertower.per_example_norms(
        ys, xs, batch_size=2, name=name),
}
MODELS = {"rnn": _rnn, "embedding": _embedding}


@pytest.fixture(scope="module")
def models():
    """One graph per model, shared: every call gets scope names of its own."""
    return {name: build() for name, build in MODELS.items()}


@pytest.mark.parametrize("model,function", [
    ("rnn", "per_example_gradients"),
    pytest.param("rnn", "per_example_jacobians", marks=pytest.mark.heavy),
    pytest.param("rnn", "per_example_norms", marks=pytest.mark.heavy)]
    + [("embedding", f) for f in sorted(CALLS)])
def test_one_call_adds_ops_under_one_scope(models, model, function):
    graph, ys, out, xs = models[model]
    name = f"{function}_scope"
    names = _new_op_names(graph, lambda: CALLS[function](ys, out, xs, name))
    assert names, "the call added no ops"
    outside = [n for n in names if not n.startswith(f"{name}/")]
    assert not outside, f"{function} on {model}: ops outside '{name}/': {outside[:10]}"
    # a second call gets a scope of its own
    again = _new_op_names(graph, lambda: CALLS[function](ys, out, xs, name))
    assert again and all(n.startswith(f"{name}_1/") for n in again), again[:10]


def test_build_towers_and_its_gradients_each_use_one_scope():
    graph, ys, _, xs = _embedding()
    built = []
    names = _new_op_names(graph, lambda: built.append(
        pertower.build_towers(ys, xs, batch_size=4)))
    assert names and all(n.startswith("towers/") for n in names), names[:10]
    # the weight read a gather-only weight needs is in the call's scope too
    assert any(n.startswith("towers/copies_0/read") for n in names), names[:20]
    names = _new_op_names(graph, lambda: built[0].gradients(name="grads"))
    assert names and all(n.startswith("grads/") for n in names), names[:10]

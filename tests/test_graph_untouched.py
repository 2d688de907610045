"""pertower leaves no op in the user's graph that its result does not need.

For pertower calls on graphs with custom gradients (`tf.custom_gradient`,
`gradient_override_map`): every op a call adds is an ancestor (through data and control
inputs) of a tensor or op it returned, or a by-product of a computation the result
needs (what `tf.gradients` builds for an input no gradient is asked of, such as the
exponent's branch of a `Pow`'s gradient). No op added is an orphan: no dangling
placeholder or other source op but a constant (a probe's dy), and nothing computed from
one (a template of an overridden gradient). `explain` adds no op at all, and neither does a refused call.
The per-example gradients are also checked against the loop.
"""

import numpy as np
import pytest
import tensorflow as tf

import pertower
from pertower import oracle
from tests import common
from tests import python_gradient_cases as checks

B = checks.B


def _ancestors(returned):
    """The ops the tensors and ops of `returned` (nested) depend on, through data and
    control inputs."""
    leaves = _leaves(returned)
    graph = leaves[0].graph
    names = sorted({(leaf.op if isinstance(leaf, tf.Tensor) else leaf).name for leaf in leaves})
    kept = tf.compat.v1.graph_util.extract_sub_graph(graph.as_graph_def(), names)
    return {graph.get_operation_by_name(node.name) for node in kept.node}


def _leaves(value):
    if isinstance(value, (tf.Tensor, tf.Operation)):
        return [value]
    if isinstance(value, tf.IndexedSlices):
        return [value.values, value.indices]
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    if isinstance(value, (list, tuple)):
        return [leaf for v in value for leaf in _leaves(v)]
    found = []
    for name in ("values", "indices", "left", "right"):   # result records
        if isinstance(getattr(value, name, None), (tf.Tensor, list, tuple)):
            found += _leaves(getattr(value, name))
    return found


def _added(graph, call):
    """(result of call(), the ops it added to graph)."""
    before = set(graph.get_operations())
    with graph.as_default():
        result = call()
    return result, [op for op in graph.get_operations() if op not in before]


def _orphans(added, needed):
    """The ops of `added` that are not `needed` and are either sources (no input) other
    than constants, or computed from such a source."""
    stray = [op for op in added if op not in needed]
    orphan = set()
    for op in stray:   # `added` is in creation order: inputs come first
        inputs = [t.op for t in op.inputs] + list(op.control_inputs)
        if not inputs:
            if op.type != "Const":
                orphan.add(op)
        elif any(i in orphan for i in inputs):
            orphan.add(op)
    return orphan


def _assert_needed(graph, call, what):
    result, added = _added(graph, call)
    assert _leaves(result), f"{what}: returned no tensor"
    assert added, f"{what}: added no op"
    orphans = _orphans(added, _ancestors(result))
    names = sorted(f"{op.name} ({op.type})" for op in orphans)
    assert not orphans, f"{what}: {len(orphans)} of {len(added)} ops added are orphans: {names[:8]}"
    return result


def test_orphans_are_found():
    """The check itself: a dangling placeholder and what is computed from it are found."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 2])
        kept = tf.reduce_sum(x, 1)

    def call():
        dy = tf.compat.v1.placeholder(tf.float32, [None, 2], name="dy")
        tf.reduce_sum(tf.multiply(dy, x), name="probe")
        tf.add(x, 1.0, name="by_product")
        return kept * 3.0

    result, added = _added(graph, call)
    assert {op.name for op in _orphans(added, _ancestors(result))} == {"dy", "Mul", "probe"}


def _calls(model):
    ys, xs, x = model.ys, model.xs, model.x
    sgd = tf.compat.v1.train.GradientDescentOptimizer(0.1)
    return {
        "auto": lambda: pertower.per_example_gradients(ys, xs, batch=x, batch_size=B),
        "towers": lambda: pertower.per_example_gradients(ys, xs, batch=x, batch_size=B,
                                                         method="towers"),
        "norms": lambda: pertower.per_example_norms(ys, xs, batch=x, batch_size=B),
        "microbatches": lambda: pertower.microbatch_gradients(ys, xs, batch=x, batch_size=B,
                                                              num_microbatches=2),
        "curvature": lambda: pertower.sum_grad_squared(ys, xs, batch=x, batch_size=B),
        "dp": lambda: pertower.DPOptimizer(sgd, 1.0, 0.0).minimize(ys, var_list=xs,
                                                                   batch=x, batch_size=B),
    }


CALLS = ("auto", "towers", "norms", "microbatches", "curvature", "dp")
MODELS = ("keras_swish_mlp", "softplus_closure", "centring_override_map")


@pytest.fixture(scope="module", params=MODELS)
def model(request):
    body, shape = checks.PYTHON_GRADIENT_MODELS[request.param]
    return checks.build(body, shape)


def test_explain_adds_no_op(model):
    for method in ("auto", "rules", "towers"):
        plan, added = _added(model.graph, lambda m=method: pertower.explain(
            model.ys, model.xs, batch=model.x, batch_size=B, method=m))
        assert plan.weights, method
        assert not added, f"explain(method={method!r}) added {[op.name for op in added]}"


def test_refused_call_adds_no_op():
    body, shape = checks.PYTHON_GRADIENT_MODELS["centring_custom_gradient"]
    model = checks.build(body, shape)
    before = len(model.graph.get_operations())
    with pytest.raises(ValueError, match="overridden"):
        _added(model.graph, lambda: pertower.per_example_gradients(
            model.ys, model.xs, batch=model.x, batch_size=B, method="rules"))
    assert [op.name for op in model.graph.get_operations()[before:]] == []


@pytest.mark.parametrize("call", CALLS)
def test_every_added_op_is_needed(model, call):
    result = _assert_needed(model.graph, _calls(model)[call], call)
    if call in ("auto", "towers"):
        _assert_matches_loop(model, result)


def _assert_matches_loop(model, result):
    with model.graph.as_default():
        loop = oracle.SliceLoop(model.ys, model.xs)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            got = sess.run(result, model.feed)
            want = loop.run(sess, model.feed, B, batch=model.x)
    assert len(got) == len(want) == len(model.xs)
    for g, w in zip(got, want):
        common.assert_all_close(np.asarray(g), np.asarray(w))


def test_loop_weights_add_no_orphan():
    """A Keras recurrent layer (a TF2 While; the copy with ε is built only when the
    rules' results are) behind a swish activation: explain adds nothing, the per-example
    gradients no orphan and match the loop."""
    import tf_keras as keras   # pylint: disable=import-outside-toplevel
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(0)
        x = tf.compat.v1.placeholder(tf.float32, [None, 3, 2], name="x")
        hidden = keras.layers.SimpleRNN(4)(x)
        out = keras.layers.Dense(2, activation=tf.nn.silu)(hidden)
        ys = tf.reduce_sum(out ** 2, axis=1)
        xs = tf.compat.v1.trainable_variables()
    feed = {x: np.random.RandomState(1).randn(B, 3, 2).astype(np.float32)}
    model = checks.Model(graph, x, ys, xs, feed)
    plan, added = _added(graph, lambda: pertower.explain(ys, xs, batch=x))
    assert {row.method for row in plan.weights} == {"rules"}, plan
    assert not added, [op.name for op in added]
    result = _assert_needed(graph, lambda: pertower.per_example_gradients(ys, xs, batch=x),
                            "loop rules")
    _assert_matches_loop(model, result)

"""Graphs where a per-op shortcut would be silently wrong, each against the one-example
loop (`pertower.oracle`) in every method:

- an entry of `xs` computed from another entry (W and w_eff = 2 * tf.identity(W)): W's
  gradient is the total derivative, as tf.gradients(ys, [W, w_eff]) gives;
- a gradient the user replaced (`gradient_override_map`, `tf.custom_gradient`, inside a
  `tf.function` too) or written in Python (`tf.py_function`) between a weight and `ys`,
  here one that mixes the examples of the batch: the rules may not assume it, the weight
  goes to the towers with the reason shown by `pertower.explain`.
"""

import re

import numpy as np
import pytest
import tensorflow as tf

import pertower
from pertower import _dispatch
from pertower import oracle
from tests import common

B = 4


def _weight(shape, name):
    return tf.compat.v1.get_variable(name, shape,
                                     initializer=tf.compat.v1.random_normal_initializer())


def _derived_both_used(x):
    """ys reads W directly and through w_eff = 2 * identity(W) (a function of the
    weights alone: the rules pull the MatMul's rule back through the Mul)."""
    W = _weight([3, 2], "W")
    w_eff = tf.identity(W) * 2.0
    ys = tf.reduce_sum(tf.matmul(x, W) ** 2 + tf.tanh(tf.matmul(x, w_eff)), axis=1)
    return ys, [W, w_eff]


def _derived_only(x):
    """ys reads W only through w_eff; w_eff listed first."""
    W = _weight([3, 2], "W")
    w_eff = tf.identity(W) * 2.0
    return tf.reduce_sum(tf.sin(tf.matmul(x, w_eff)), axis=1), [w_eff, W]


def _derived_read(x):
    """An entry that is the variable's own read tensor, next to the variable."""
    W = _weight([3, 2], "W")
    v = W.value()
    ys = tf.reduce_sum(tf.tanh(tf.matmul(x, v)) * tf.square(tf.matmul(x, W)), axis=1)
    return ys, [W, v]


# A backward pass that mixes the batch: each example gets the batch's mean gradient.
@tf.RegisterGradient("PertowerTestBatchMean")
def _batch_mean_gradient(op, grad):  # pylint: disable=unused-argument
    return [tf.broadcast_to(tf.reduce_mean(grad, axis=0, keepdims=True), tf.shape(grad))]


def _override_map(x):
    W = _weight([3, 2], "W")
    h = tf.matmul(x, W)
    with tf.compat.v1.get_default_graph().gradient_override_map(
            {"Identity": "PertowerTestBatchMean"}):
        h = tf.identity(h)
    return tf.reduce_sum(tf.tanh(h) ** 2, axis=1), [W]


@tf.custom_gradient
def _mixing_identity(h):
    def grad(dh):
        return tf.broadcast_to(tf.reduce_mean(dh, axis=0, keepdims=True), tf.shape(dh))
    return tf.identity(h), grad


def _custom_gradient(x):
    W = _weight([3, 2], "W")
    return tf.reduce_sum(tf.tanh(_mixing_identity(tf.matmul(x, W))) ** 2, axis=1), [W]


def _override_in_function(x):
    W = _weight([3, 2], "W")

    @tf.function
    def activation(h):
        with tf.compat.v1.get_default_graph().gradient_override_map(
                {"Identity": "PertowerTestBatchMean"}):
            return tf.tanh(tf.identity(h))

    return tf.reduce_sum(activation(tf.matmul(x, W)) ** 2, axis=1), [W]


def _py_function(x):
    W = _weight([3, 2], "W")
    h = tf.matmul(x, W)
    h = tf.py_function(lambda t: t * 3.0, [h], tf.float32)
    h.set_shape([None, 2])
    return tf.reduce_sum(tf.tanh(h) ** 2, axis=1), [W]


CASES = {
    # name: (build, {weight op name: expected fallback reason pattern or None})
    "derived_both_used": (_derived_both_used, None),
    "derived_only": (_derived_only, None),
    "derived_read": (_derived_read, None),
    "override_map": (_override_map, r"'Identity' \(Identity\), whose gradient is overridden "
                                    r"\('PertowerTestBatchMean'"),
    "custom_gradient": (_custom_gradient, r"whose gradient is overridden \('CustomGradient"),
    "override_in_function": (_override_in_function, r"overridden \('PertowerTestBatchMean'.* "
                                                    r"inside the function"),
    "py_function": (_py_function, r"\(EagerPyFunc\)"),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    build, reason = CASES[request.param]
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(0)
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        ys, xs = build(x)
        # gradients of function calls must be built before the first run of the graph
        loop = oracle.SliceLoop(ys, xs)
        results = {m: pertower.per_example_gradients(ys, xs, batch_size=B, method=m)
                   for m in ("auto", "towers")}
        norms = pertower.per_example_norms(ys, xs, batch_size=B)
        microbatches = pertower.microbatch_gradients(ys, xs, num_microbatches=2,
                                                     batch_size=B, method="towers")
        whole = tf.gradients(tf.reduce_sum(ys), xs[0])[0]
        plan = _dispatch.make_plan(ys, xs, None, B, refuse=False,
                                   validate=False)
        sess = tf.compat.v1.Session(graph=graph)
        sess.run(tf.compat.v1.global_variables_initializer())
    feed = {x: np.random.RandomState(1).randn(B, 3).astype(np.float32)}
    yield dict(name=request.param, graph=graph, sess=sess, ys=ys, xs=xs, loop=loop,
               results=results, norms=norms, microbatches=microbatches, plan=plan,
               reason=reason, feed=feed, x=x, whole=whole)
    sess.close()


def test_every_method_matches_the_one_example_loop(case):
    sess, feed = case["sess"], case["feed"]
    want = common.run_oracle(case["loop"].run, sess, feed, B)
    for method, result in case["results"].items():
        common.assert_all_close(sess.run(result, feed), want, what=f"method={method!r}")
    squared = sum(np.sum(w.reshape(B, -1) ** 2, axis=1) for w in want)
    common.assert_all_close([sess.run(case["norms"], feed) ** 2], [squared], rtol=1e-4,
                            what="per_example_norms")
    halves = common.run_oracle(case["loop"].run, sess, feed, 2)
    common.assert_all_close(sess.run(case["microbatches"], feed), halves,
                            what="microbatch_gradients")


def test_each_tower_copy_of_a_python_function_has_its_own_token(case):
    """TensorFlow keys a py_function's recorded forward run by its op's token and its
    gradient pops that entry: tower copies sharing the original's token would race for
    it (a KeyError, or one tower's gradient from another's inputs). Every copy gets its
    own token, and repeated runs keep matching the loop."""
    if case["name"] != "py_function":
        pytest.skip("no Python function in this case")
    calls = [op for op in case["graph"].get_operations() if op.type == "EagerPyFunc"]
    tokens = [op.get_attr("token") for op in calls]
    assert len(calls) > B and len(set(tokens)) == len(tokens), tokens
    sess, feed = case["sess"], case["feed"]
    want = common.run_oracle(case["loop"].run, sess, feed, B)
    for _ in range(10):
        common.assert_all_close(sess.run(case["results"]["towers"], feed), want,
                                what="towers, repeated runs")


def test_the_replaced_gradient_mixes_the_batch(case):
    """Where the gradient is replaced by the batch mean, one backward pass over the
    whole batch is not the sum of the examples' own (so no split of it can be right):
    the case really tests what it claims."""
    if case["reason"] is None or case["name"] == "py_function":
        pytest.skip("no gradient that mixes the batch in this case")
    sess, feed = case["sess"], case["feed"]
    per_example = sess.run(case["results"]["auto"], feed)[0]        # [B, 3, 2]
    whole = sess.run(case["whole"], feed)                           # [3, 2]
    assert not np.allclose(per_example.sum(axis=0), whole, rtol=1e-3, atol=1e-5)


def test_explain_names_the_replaced_gradient(case):
    """A replaced gradient sends its weight to the towers, and explain says why; where
    nothing is replaced, no reason speaks of a replaced gradient."""
    plan = case["plan"]
    if case["reason"] is None:
        assert not any("overridden" in (reason or "") for reason in plan.reasons), \
            plan.reasons
        assert "overridden" not in str(plan), str(plan)
    else:
        assert plan.fallback == [0], plan.reasons
        assert plan.reasons[0] is not None
        assert re.search(case["reason"], plan.reasons[0]), plan.reasons[0]
        assert re.search(case["reason"], str(plan))
        with case["graph"].as_default(), pytest.raises(ValueError,
                                                       match="method='rules' is strict"):
            pertower.per_example_gradients(case["ys"], case["xs"], batch_size=B,
                                           method="rules")


def test_a_partitioned_variable_gets_one_gradient_of_its_full_shape():
    """A PartitionedVariable in xs: per-example gradients and Jacobians of its full
    shape (its partitions' joined along the partition axis), norms over all of it, and
    DPOptimizer pairs per partition; all against the one-example loop on the
    partitions."""
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(0)
        x = tf.compat.v1.placeholder(tf.float32, [None, 4], name="x")
        W = tf.compat.v1.get_variable(
            "W", [4, 2], partitioner=tf.compat.v1.fixed_size_partitioner(2))
        b = tf.compat.v1.get_variable("b", [2])
        outputs = tf.tanh(tf.matmul(x, W) + b)                          # [B, 2]
        ys = tf.reduce_sum(outputs ** 2, axis=1)                        # [B]
        parts = list(W)
        grads = pertower.per_example_gradients(ys, [W, b], batch_size=B)
        micro = pertower.microbatch_gradients(ys, [b, W], batch_size=B, num_microbatches=2)
        jacobians = pertower.per_example_jacobians(outputs, [W], batch_size=B)
        norms = pertower.per_example_norms(ys, [W, b], batch_size=B)
        dp = pertower.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                  l2_norm_clip=1e6, noise_multiplier=0.0)
        pairs = dp.compute_gradients(ys, var_list=[W, b], batch_size=B)
        assert [v for _, v in pairs] == parts + [b]
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            feed = {x: np.random.RandomState(2).randn(B, 4).astype(np.float32)}
            loop = oracle.loop_per_example_gradients(sess, ys, parts + [b], feed)
            want_W = np.concatenate(loop[:2], axis=1)                  # [B, 4, 2]
            got = sess.run(grads, feed)
            assert got[0].shape == (B, 4, 2)
            common.assert_all_close(got, [want_W, loop[2]], what="per example")
            pairs_of_two = [w.reshape(2, B // 2, *w.shape[1:]).sum(axis=1)
                            for w in (loop[2], want_W)]
            common.assert_all_close(sess.run(micro, feed), pairs_of_two, what="microbatches")
            want_jac = np.concatenate(oracle.loop_per_example_jacobians(
                sess, outputs, parts, feed), axis=2)                   # [B, 2, 4, 2]
            common.assert_all_close(sess.run(jacobians, feed), [want_jac], what="jacobians")
            want_norms = np.sqrt(sum(np.sum(w.reshape(B, -1) ** 2, axis=1) for w in loop))
            common.assert_all_close([sess.run(norms, feed)], [want_norms], what="norms")
            mean = [w.mean(axis=0) for w in loop]                       # no clipping
            common.assert_all_close(sess.run([g for g, _ in pairs], feed), mean, what="DP")

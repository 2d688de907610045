"""What building per-example gradients costs, by mechanism (no timing).

Each rule use adds a bounded number of ops, whatever the number of layers, and the
constants it needs are shared by the whole build (`_shapes.constant`); shapes that
are static are not rebuilt from tf.shape + Pack; a rule's result that already has the
weight's shape is not reshaped; the planning walks read each op's consumers once
(`_graph_walk.OpRegion`) and walk no weight's path for unassumed gradients when no op
has one. The graph: `LAYERS` blocks of FusedBatchNormV3 (inference, NHWC then NCHW) ->
BiasAdd -> tanh, then a dense layer (MatMul), on [B, 3, 4, 2] with B left to run time;
its per-example gradients are checked against the one-example loop.
"""

import collections
import sys

import numpy as np
import pytest
import tensorflow as tf

import pertower
from pertower import _dispatch
from pertower import _graph_walk
from pertower import _request
from pertower import oracle
from pertower._layout import _shapes
from pertower._engine import unassumed as _unassumed
from tests import common

B = 3
LAYERS = (1, 4)
# ops other than Const one use may add (rule and engine together), whatever the number
# of layers; B is left to run time, so each group is one row and every sum over a
# group's positions is one Sum, with no reshape to [G, rows, C] first:
# gamma: Sub, Mul, Sum, AddV2 (epsilon), Rsqrt, Mul; beta and BiasAdd: Sum;
# MatMul: Einsum; channels first (NCHW) adds, for gamma, the reshape of the mean to
# [C, 1, 1]. Every Const (sum axes, reshape targets, epsilon) is shared by the build.
PER_USE = {("FusedBatchNormV3", 1): 6, ("FusedBatchNormV3", 2): 1, ("BiasAdd", 1): 1,
           ("MatMul", 1): 1}
NCHW_EXTRA = {("FusedBatchNormV3", 1): 1, ("FusedBatchNormV3", 2): 0, ("BiasAdd", 1): 0}

def _network(layers):
    """(ys [B], xs, x placeholder, moving statistics) of `layers` blocks."""
    rng = np.random.RandomState(layers)
    x = tf.compat.v1.placeholder(tf.float32, [None, 3, 4, 2], name="x")
    h, xs, statistics = x, [], []
    for j in range(layers):
        nchw = j % 2 == 1
        if nchw:
            h = tf.transpose(h, [0, 3, 1, 2])                               # [B, 2, 3, 4]
        gamma = tf.Variable(rng.uniform(0.5, 1.5, 2).astype(np.float32), name=f"gamma{j}")
        beta = tf.Variable(rng.uniform(-0.5, 0.5, 2).astype(np.float32), name=f"beta{j}")
        mean = tf.Variable(rng.uniform(-0.5, 0.5, 2).astype(np.float32), trainable=False)
        variance = tf.Variable(rng.uniform(0.5, 2.0, 2).astype(np.float32), trainable=False)
        h = tf.raw_ops.FusedBatchNormV3(
            x=h, scale=gamma, offset=beta, mean=mean, variance=variance, epsilon=0.01,
            data_format="NCHW" if nchw else "NHWC", is_training=False)[0]
        bias = tf.Variable(rng.uniform(-0.5, 0.5, 2).astype(np.float32), name=f"bias{j}")
        h = tf.nn.bias_add(h, bias, data_format="NCHW" if nchw else "NHWC")
        h = tf.tanh(h)
        if nchw:
            h = tf.transpose(h, [0, 2, 3, 1])                               # [B, 3, 4, 2]
        xs += [gamma, beta, bias]
        statistics += [mean, variance]
    w = tf.Variable(rng.randn(24, 5).astype(np.float32), name="w")
    logits = tf.matmul(tf.reshape(h, [-1, 24]), w)                         # [B, 5]
    ys = tf.reduce_sum(tf.square(logits), axis=1)                          # [B]
    return ys, xs + [w], x


class _Built:
    """One graph of `layers` blocks: the ops tf.gradients adds, the ops each rule use
    adds, the ops the whole build adds, the per-example gradients."""

    def __init__(self, layers):
        self.graph = tf.Graph()
        with self.graph.as_default():
            self.ys, self.xs, self.x = _network(layers)
            graph = self.graph
            n = len(graph.get_operations())
            tf.gradients(tf.reduce_sum(self.ys), self.xs)
            self.tf_gradient_ops = len(graph.get_operations()) - n
            self.request = _request.make_request(self.ys, self.xs, options=_dispatch.options())
            plan = _dispatch.make_plan(self.request)
            self.plan = plan
            self.use_ops = collections.defaultdict(list)   # (op type, slot) -> [op types]
            self.use_constants = []   # the Const ops the rule uses created
            rules = {id(u.rule): u.rule for uses in plan.uses for u in uses or ()}
            for rule in rules.values():
                rule.per_group = self._counted(rule.per_group)
            n = len(graph.get_operations())
            with tf.name_scope("per_example"):
                self.grads = _dispatch.build(plan).gradients()
            self.build_ops = graph.get_operations()[n:]
            for rule in rules.values():
                del rule.per_group          # the class's own again

    def _counted(self, per_group):
        def counted(use, dZ, G):
            n = len(self.graph.get_operations())
            result = per_group(use, dZ, G)
            nchw = use.op.type != "MatMul" and use.op.get_attr("data_format") == b"NCHW"
            self.use_ops[(use.op.type, use.slot)].append(
                (nchw, [op.type for op in self.graph.get_operations()[n:]]))
            self.use_constants += [op for op in self.graph.get_operations()[n:]
                                   if op.type == "Const"]
            return result
        return counted


@pytest.fixture(scope="module")
def built():
    return {layers: _Built(layers) for layers in LAYERS}


def test_every_weight_on_the_rules(built):
    for b in built.values():
        assert not b.plan.fallback, str(b.plan)


def test_ops_per_use_bounded_and_no_shape_packs(built):
    for layers, b in built.items():
        assert set(b.use_ops) == set(PER_USE), sorted(b.use_ops)
        for key, each in b.use_ops.items():
            for nchw, types in each:
                bound = PER_USE[key] + (NCHW_EXTRA[key] if nchw else 0)
                assert len(types) - types.count("Const") <= bound, (layers, key, nchw, types)
                # B is known at run time only, but every other size is static: no
                # target is stacked out of tf.shape
                assert "Pack" not in types and "Shape" not in types, (layers, key, types)


def test_constants_shared_by_the_build(built):
    """Every Const the rule uses need (sum axes, reshape targets, epsilon) is made once
    per build: no two with the same value, and as many for 4 blocks as for the kinds of
    value they hold (not per use)."""
    for layers, b in built.items():
        seen = set()
        for op in b.use_constants:
            key = (op.get_attr("dtype"), tf.make_ndarray(op.get_attr("value")).tobytes(),
                   tuple(tf.make_ndarray(op.get_attr("value")).shape))
            assert key not in seen, (layers, op.name, op.get_attr("value"))
            seen.add(key)
        uses = sum(len(each) for each in b.use_ops.values())
        assert len(b.use_constants) < uses, (layers, len(b.use_constants), uses)


def test_shared_constant_per_graph_and_loop_context():
    with tf.Graph().as_default() as graph:
        cache = _shapes.ShapeCache(2)
        assert _shapes.constant([1, 2]) is not _shapes.constant([1, 2])   # no build: new
        with cache.active():
            first = _shapes.constant([1, 2])
            assert _shapes.constant([1, 2]) is first
            assert _shapes.constant([1, 2], tf.int64) is not first
            assert _shapes.constant(1e-3, tf.float32) is not _shapes.constant(1e-3, tf.float64)
            inside = []

            def body(i):   # a while loop's body (its own graph or frame): its own constant
                inside.append(_shapes.constant([1, 2]))
                return i + 1

            tf.compat.v1.while_loop(lambda i: i < 3, body, [tf.constant(0)])
            assert inside and all(c is not first for c in inside)
            with tf.Graph().as_default():
                assert _shapes.constant([1, 2]).graph is not graph
        assert _shapes.constant([1, 2]) is not first


def test_build_grows_by_a_constant_per_layer(built):
    """The build's ops per block: its own backward pass to the uses' outputs (as
    tf.gradients'), the rule uses (but their shared constants), one Identity per
    result; no op per block that grows
    with the number of blocks."""
    (few, b_few), (many, b_many) = sorted(built.items())
    # (the rules' shared constants are counted by test_constants_shared_by_the_build)
    ops = {b: len(b.build_ops) - len(b.use_constants) for b in (b_few, b_many)}
    per_block = (ops[b_many] - ops[b_few]) / (many - few)
    tf_per_block = (b_many.tf_gradient_ops - b_few.tf_gradient_ops) / (many - few)
    rules_per_block = sum(PER_USE[key] + NCHW_EXTRA[key] for key in NCHW_EXTRA)
    assert per_block <= tf_per_block + rules_per_block + 3, (per_block, tf_per_block)
    # and no Reshape of a result that already has its weight's shape: the Reshapes are
    # the rules' own (one per use) and the backward pass's
    reshapes = sum(t.count("Reshape") for each in b_many.use_ops.values() for _, t in each)
    backward = sum(op.type == "Reshape" for op in b_many.graph.get_operations()
                   if op.name.startswith("per_example/gradients/gradients/"))
    assert sum(op.type == "Reshape" for op in b_many.build_ops) == reshapes + backward


def test_matches_the_loop(built):
    b = built[max(LAYERS)]
    with b.graph.as_default():
        sess = tf.compat.v1.Session(graph=b.graph)
        sess.run(tf.compat.v1.global_variables_initializer())
        feed = {b.x: np.random.RandomState(5).randn(B, 3, 4, 2).astype(np.float32)}
        got = sess.run(b.grads, feed)
        want = common.run_oracle(oracle.loop_per_example_gradients, sess, b.ys, b.xs, feed)
        common.assert_all_close(got, want, what="per-example gradients", kind="deep")
        sess.close()


def test_static_targets():
    with tf.Graph().as_default():
        G = tf.compat.v1.placeholder(tf.int32, [])
        assert _shapes.group_target(4, [2, 3]) == [4, 2, 3]
        assert _shapes.group_target(G, [2, 3]) == [-1, 2, 3]
        assert _shapes.group_target(G, [2, 0]) is None          # -1 would be ambiguous
        assert _shapes.group_target(G, [-1, 3]) is None
        with _shapes.ShapeCache(G).active():
            assert _shapes.group_shape(G, [2, 3]) is _shapes.group_shape(G, [2, 3])
            assert tf.get_static_value(_shapes.group_shape(G, [2, 3])).tolist() == [-1, 2, 3]
            assert _shapes.group_shape(G, [-1, 3]).op.type == "Pack"
        cache = _shapes.ShapeCache(G)
        first = cache.group_shape([-1, 3])
        assert isinstance(first, tf.Tensor) and cache.group_shape([-1, 3]) is first
        x = tf.Variable(tf.zeros([2, 3]))
        part = tf.compat.v1.placeholder(tf.float32, [None, 2, 3])
        assert _shapes.as_per_x(part, x, G, cache) is part
        other = tf.compat.v1.placeholder(tf.float32, [None, 6])
        assert _shapes.as_per_x(other, x, G, cache).shape.as_list() == [None, 2, 3]
        rows = tf.compat.v1.placeholder(tf.float32, [None, 3, 4, 2])
        assert _shapes.groups_target(rows, G, 2, 1) == [-1, 24, 2]
        assert _shapes.groups_target(rows, 5, 2, 1) == [5, -1, 2]


def test_planning_reads_consumers_once(built, monkeypatch):
    b = built[max(LAYERS)]
    region = b.request.ys_upstream
    assert isinstance(region, _graph_walk.OpRegion)
    assert region.consumers_within() is region.consumers_within()
    for reads in b.request.reads:
        assert (_graph_walk.downstream_ops(reads.read_tensors, region)
                == _graph_walk.downstream_ops(reads.read_tensors, frozenset(region)))
    walks = []
    original = _unassumed.graph_walk.downstream_ops

    def counted(*args):   # the walks asked for by the check of unassumed gradients
        if sys._getframe(1).f_globals["__name__"] == _unassumed.__name__:
            walks.append(args)
        return original(*args)

    monkeypatch.setattr(_unassumed.graph_walk, "downstream_ops", counted)
    with b.graph.as_default():
        request = _request.make_request(b.ys, b.xs, options=_dispatch.options())
        _dispatch.make_plan(request)
    assert not walks   # no op with an unassumed gradient: no weight's path is walked
    # nor is any weight's region (the towers' replay) walked when no towers are built
    assert request.weight_regions.walked() == 0
    for k, reads in enumerate(request.reads):   # and when asked, it is the walk's
        want = _graph_walk.downstream_ops(reads.read_tensors, frozenset(region))
        assert request.weight_regions[k] == want, k
    assert request.weight_regions.walked() == len(b.xs)


def test_unassumed_gradient_still_found():
    """The shortcut must not hide an overridden gradient on one weight's path."""
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 3])
        w1 = tf.Variable(tf.ones([3, 3]), name="w1")
        w2 = tf.Variable(tf.ones([3, 2]), name="w2")

        @tf.custom_gradient
        def mixing(h):   # a backward pass that mixes the examples
            return tf.identity(h), lambda dy: dy + tf.reduce_mean(dy, axis=0, keepdims=True)

        h = tf.tanh(mixing(tf.matmul(x, w1)))
        ys = tf.reduce_sum(tf.matmul(h, w2), axis=1)             # [B]
        plan = pertower.explain(ys, [w1, w2])
        assert plan.fallback == [0], str(plan)
        assert "overridden" in plan.reasons[0], plan.reasons[0]


def test_one_pull_back_per_weight_function():
    """tanh(W) read by two dense layers (one per half of the input): the two uses'
    results are summed before ONE pull-back through tanh, and match the loop."""
    with tf.Graph().as_default() as graph:
        rng = np.random.RandomState(7)
        x = tf.compat.v1.placeholder(tf.float32, [None, 2, 3])
        w = tf.Variable(rng.randn(3, 3).astype(np.float32), name="w")
        u = tf.tanh(w)                                             # a function of w alone
        h = tf.tanh(tf.matmul(x[:, 0], u)) + tf.matmul(x[:, 1], u)  # [B, 3]
        ys = tf.reduce_sum(tf.square(h), axis=1)                  # [B]
        plan = pertower.explain(ys, [w])
        assert not plan.fallback and len(plan.uses[0]) == 2, str(plan)
        n = len(graph.get_operations())
        grads = pertower.per_example_gradients(ys, [w])
        copies = [op for op in graph.get_operations()[n:]
                  if op.type == "Tanh" and op.name.endswith("_per_example")]
        assert len(copies) == 1, [op.name for op in copies]
        sess = tf.compat.v1.Session(graph=graph)
        sess.run(tf.compat.v1.global_variables_initializer())
        feed = {x: rng.randn(B, 2, 3).astype(np.float32)}
        want = common.run_oracle(oracle.loop_per_example_gradients, sess, ys, [w], feed)
        common.assert_all_close(sess.run(grads, feed), want, what="tanh(W) twice")
        sess.close()


def test_strided_slice_as_indexing():
    """`_shapes.strided_slice` gives what Python indexing gives, sharing its bounds."""
    with tf.Graph().as_default() as graph:
        value = np.arange(2 * 7 * 6 * 3, dtype=np.float32).reshape(2, 7, 6, 3)
        x = tf.compat.v1.placeholder(tf.float32, [None, 7, 6, 3])
        indices = [(slice(None), slice(1, 6, 2), slice(0, 5, 1), slice(None)),
                   (slice(None), slice(None, 4), slice(2, None, 3)),
                   (slice(1, None), slice(0, 7, 3))]
        with _shapes.ShapeCache(2).active():
            n = len(graph.get_operations())
            got = [_shapes.strided_slice(x, index) for index in indices]
            again = _shapes.strided_slice(x, indices[0])
            assert len(graph.get_operations()) - n <= 4 * len(indices) + 1
        with tf.compat.v1.Session(graph=graph) as sess:
            results = sess.run(got + [again], {x: value})
        for index, result in zip(indices + [indices[0]], results):
            np.testing.assert_array_equal(result, value[index])
            assert [d for d in got[indices.index(index)].shape.as_list()[1:]] == list(
                value[index].shape[1:])


def test_one_override_backward_per_computation(monkeypatch):
    """tf.nn.silu (a tf.custom_gradient: one registered function per call) on four
    dense layers, three of [B, 4] (one with its own beta) and one of [B, 6]: the plan
    builds the scratch backward once per output shape (2), not per op (4), reads no
    forward analysis per override, and the gradients match the loop. An override that
    reads its `op` argument is built per op."""
    from pertower import _overrides   # pylint: disable=import-outside-toplevel
    builds, analyses = [], []
    original_build, original_analyze = _overrides._build, _overrides._batch_axis.analyze
    monkeypatch.setattr(_overrides, "_build", lambda op, scope: builds.append(op) or
                        original_build(op, scope))
    monkeypatch.setattr(_overrides._batch_axis, "analyze", lambda *a, **k: analyses.append(
        a[0]) or original_analyze(*a, **k))
    with tf.Graph().as_default() as graph:
        rng = np.random.RandomState(3)
        x = tf.compat.v1.placeholder(tf.float32, [None, 4])
        h, xs = x, []
        for j, (width, beta) in enumerate(((4, 1.0), (4, 1.0), (4, 0.5), (6, 1.0))):
            w = tf.Variable(rng.randn(int(h.shape[1]), width).astype(np.float32) / 2,
                            name=f"w{j}")
            h = tf.nn.silu(tf.matmul(h, w), beta=beta)
            xs.append(w)
        ys = tf.reduce_sum(tf.square(h), axis=1)                   # [B]
        plan = pertower.explain(ys, xs)
        assert not plan.fallback, str(plan)
        swishes = [op for op in graph.get_operations() if op.type == "IdentityN"]
        assert len(swishes) == 4
        assert len(builds) == 2, [op.name for op in builds]
        # the request's analysis of ys, then one per distinct backward (its input's
        # gradient, in a scratch graph); none of the forward per override
        assert [t for t in analyses if t.graph is graph] == [ys], analyses
        assert len(analyses) == 3, [t.name for t in analyses]
        grads = pertower.per_example_gradients(ys, xs)
        sess = tf.compat.v1.Session(graph=graph)
        sess.run(tf.compat.v1.global_variables_initializer())
        feed = {x: rng.randn(B, 4).astype(np.float32)}
        want = common.run_oracle(oracle.loop_per_example_gradients, sess, ys, xs, feed)
        common.assert_all_close(sess.run(grads, feed), want, what="silu layers")
        sess.close()
        templates = _overrides.Templates()
        builds.clear()
        for op in swishes:
            templates.backward(op, "probe")
        assert templates.built == 2 and len(builds) == 2

    name = f"Build3ReadsOp{id(builds)}"

    @tf.RegisterGradient(name)
    def _reads_op(op, dy):   # its result depends on op: never shared
        return dy * 2.0 * op.inputs[0]

    with tf.Graph().as_default() as graph:
        x = tf.compat.v1.placeholder(tf.float32, [None, 3])
        with graph.gradient_override_map({"Square": name}):
            squares = [tf.square(x), tf.square(x + 1.0)]
        templates = _overrides.Templates()
        backwards = [templates.backward(s.op, "probe") for s in squares]
        assert templates.built == 2
        assert backwards[0].graph is not backwards[1].graph


def _stacked_cnn(transpose_b):
    """ys [B] of Conv2D -> BiasAdd -> relu -> DepthwiseConv2dNative -> BiasAdd -> relu ->
    Conv2D -> MatMul (W or W^T) -> BiasAdd -> tanh -> MatMul, on [B, 5, 5, 2]: every
    weight-consuming op but the first lies between two uses' outputs."""
    rng = np.random.RandomState(7 + transpose_b)

    def weight(name, *shape):
        return tf.Variable(rng.uniform(-0.5, 0.5, shape).astype(np.float32), name=name)

    x = tf.compat.v1.placeholder(tf.float32, [None, 5, 5, 2], name="x")
    xs = [weight("k", 3, 3, 2, 3), weight("b1", 3), weight("d", 3, 3, 3, 2), weight("b2", 6),
          weight("w", 4, 18) if transpose_b else weight("w", 18, 4), weight("b3", 4),
          weight("v", 4, 2), weight("k2", 3, 3, 6, 2)]
    h = tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(x, xs[0], 1, "SAME"), xs[1]))  # [B, 5, 5, 3]
    h = tf.nn.relu(tf.nn.bias_add(tf.nn.depthwise_conv2d(h, xs[2], [1, 1, 1, 1], "SAME"),
                                  xs[3]))                                   # [B, 5, 5, 6]
    h = tf.nn.conv2d(h, xs[7], 1, "SAME")                                    # [B, 5, 5, 2]
    h = tf.reshape(h[:, 1:4, 1:4, :], [-1, 18])                             # [B, 18]
    h = tf.tanh(tf.nn.bias_add(tf.matmul(h, xs[4], transpose_b=transpose_b), xs[5]))
    ys = tf.reduce_sum(tf.square(tf.matmul(h, xs[6])), axis=1)             # [B]
    return ys, xs, x


BACKWARD_SCOPE = "per_example/per_example_gradients/gradients/gradients/"


@pytest.mark.parametrize("transpose_b", [False, True])
def test_backward_pass_builds_no_weight_gradient(transpose_b):
    """The one backward pass to the uses' outputs builds, for the weight-consuming ops it
    goes through, their batch-side input's gradient only (`rules._input_gradients`): no
    Conv2DBackpropFilter, DepthwiseConv2dNativeBackpropFilter or BiasAddGrad, no MatMul
    for a weight; the ops get their own gradient back (a later tf.gradients builds the
    weights' gradients as before); and the result is the loop's."""
    with tf.Graph().as_default() as graph:
        ys, xs, x = _stacked_cnn(transpose_b)
        n = len(graph.get_operations())
        with tf.name_scope("per_example"):
            grads = pertower.per_example_gradients(ys, xs)
        built = collections.Counter(op.type for op in graph.get_operations()[n:]
                                    if op.name.startswith(BACKWARD_SCOPE))
        assert built["Conv2DBackpropInput"] == 1 and built["MatMul"] == 2, built
        assert built["DepthwiseConv2dNativeBackpropInput"] == 1, built
        for op_type in ("Conv2DBackpropFilter", "DepthwiseConv2dNativeBackpropFilter",
                        "BiasAddGrad"):
            assert built[op_type] == 0, (op_type, built)
        # pylint: disable-next=protected-access
        assert all(op._gradient_function is None for op in graph.get_operations())
        n = len(graph.get_operations())
        batch = tf.gradients(tf.reduce_sum(ys), xs)
        again = collections.Counter(op.type for op in graph.get_operations()[n:])
        assert again["Conv2DBackpropFilter"] == 2 and again["BiasAddGrad"] == 3, again
        assert again["DepthwiseConv2dNativeBackpropFilter"] == 1, again
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            feed = {x: np.random.RandomState(3).randn(B, 5, 5, 2).astype(np.float32)}
            got, summed = sess.run([grads, batch], feed)
            want = common.run_oracle(oracle.loop_per_example_gradients, sess, ys, xs, feed)
        common.assert_all_close(got, want, what="per-example gradients", kind="deep")
        common.assert_all_close([g.sum(axis=0) for g in got], summed, what="their sum",
                                kind="deep")

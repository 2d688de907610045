"""Weights read inside functional control flow (While, If, function calls) against the
one-example oracle: Keras RNN layers, tf.cond, a hand-written tf.while_loop, a
tf.function, and the refusals for what cannot be replayed."""

import dataclasses

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import pertower
from pertower import oracle
from tests import cases
from tests import common


@dataclasses.dataclass
class Built:
    case: cases.Case
    got: dict        # name -> list of pertower tensors
    loop: oracle.SliceLoop
    batch_gradient: list
    jacobian_loops: list = None  # one SliceLoop per output entry k of outputs [B, K]
    fetched: dict = None         # `values()`, once run

    def values(self):
        """The values of every tensor of `got` (same keys) and of the batch gradient
        (key "batch_gradient"), from one `sess.run` shared by the tests of this case."""
        if self.fetched is None:
            keys = list(self.got)
            values = self.case.sess.run([self.got[k] for k in keys] + [self.batch_gradient],
                                        self.case.feed)
            self.fetched = dict(zip(keys + ["batch_gradient"], values))
        return self.fetched

    def jacobian_oracle(self):
        """[B, K, *x.shape] per x: the one-example loop of d outputs[i, k] / d x."""
        case = self.case
        per_k = [loop.run(case.sess, case.feed, case.B) for loop in self.jacobian_loops]
        return [np.stack([rows[j] for rows in per_k], axis=1) for j in range(len(case.xs))]


def _build(case, methods=("towers",), microbatches=True, jacobians=False):
    """pertower's tensors for `case`, with the oracle's gradients built first: TF's
    while_v2 gradient edits the forward While op, which a session that already ran
    the graph cannot follow, so all gradients are built before the first run."""
    with case.graph.as_default():
        loop = oracle.SliceLoop(case.ys, case.xs)
        batch_gradient = [tf.convert_to_tensor(g)
                          for g in tf.gradients(tf.reduce_sum(case.ys), case.xs)]
        got = {}
        for method in methods:
            got[f"per_example/{method}"] = pertower.per_example_gradients(
                case.ys, case.xs, batch_size=case.B, method=method)
        if microbatches:
            got["microbatches"] = pertower.microbatch_gradients(
                case.ys, case.xs, num_microbatches=2, batch_size=case.B)
        jacobian_loops = None
        if jacobians:
            got["jacobians"] = pertower.per_example_jacobians(case.outputs, case.xs,
                                                              batch_size=case.B)
            K = case.outputs.shape[1]                       # outputs [B, K]
            jacobian_loops = [oracle.SliceLoop(case.outputs[:, k], case.xs) for k in range(K)]
        case.sess = tf.compat.v1.Session(graph=case.graph)
        case.sess.run(tf.compat.v1.global_variables_initializer())
    return Built(case, got, loop, batch_gradient, jacobian_loops)


def _rnn_case(layer, unroll, B=4):
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(11)
        x = tf.compat.v1.placeholder(tf.float32, [None, 3, 2], name="sequences")
        rnn = getattr(keras.layers, layer)(3, unroll=unroll)
        head = keras.layers.Dense(2)
        out = head(rnn(x))                                     # [B, 2]
        ys = tf.reduce_sum(tf.sin(out), axis=1)                # [B]
    feed = {x: np.random.RandomState(7).randn(B, 3, 2).astype(np.float32)}
    xs = list(rnn.trainable_weights) + list(head.trainable_weights)
    return cases.Case(f"{layer}(unroll={unroll})", graph, None, ys, xs, feed, [x], B,
                       outputs=out, **common.tolerance(np.float32, "deep"))


def _cond_case(B=4):
    """tf.cond (v2, an If op) whose true branch reads the kernel w and the scale v."""
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(12)
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        w = tf.compat.v1.get_variable("w", [3, 3])
        v = tf.compat.v1.get_variable("v", [3])
        flag = tf.compat.v1.placeholder_with_default(True, [], name="flag")
        h = tf.cond(flag, lambda: tf.tanh(tf.matmul(x, w)) * v, lambda: x * v)  # [B, 3]
        ys = tf.reduce_sum(h ** 2, axis=1)                                       # [B]
    feed = {x: np.random.RandomState(8).randn(B, 3).astype(np.float32)}
    return cases.Case("cond", graph, None, ys, [w, v], feed, [x], B, outputs=h)


def _while_case(B=4):
    """A hand-written tf.while_loop whose body reads w and v three times, with a
    tf.cond nested in the body."""
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(13)
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        w = tf.compat.v1.get_variable("w", [3, 3])
        v = tf.compat.v1.get_variable("v", [3])

        def body(i, h):
            h = tf.cond(i > 0, lambda: tf.tanh(tf.matmul(h, w) + v), lambda: h * v)
            return i + 1, h

        _, h = tf.while_loop(lambda i, h: i < 3, body, [tf.constant(0), x])     # [B, 3]
        ys = tf.reduce_sum(h ** 2, axis=1)                                       # [B]
    feed = {x: np.random.RandomState(9).randn(B, 3).astype(np.float32)}
    return cases.Case("while_loop", graph, None, ys, [w, v], feed, [x], B, outputs=h)


def _function_case(B=4):
    """A tf.function (StatefulPartitionedCall) that captures the weight w."""
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(14)
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        w = tf.compat.v1.get_variable("w", [3, 2])

        @tf.function(autograph=False)
        def layer(a):
            return tf.tanh(tf.matmul(a, w))

        out = layer(x)                                         # [B, 2]
        ys = tf.reduce_sum(out, axis=1)                        # [B]
    feed = {x: np.random.RandomState(10).randn(B, 3).astype(np.float32)}
    return cases.Case("tf.function", graph, None, ys, [w], feed, [x], B, outputs=out)


def _gathers_in_functions_case(B=4):
    """An embedding table gathered inside a tf.function and inside a while loop body
    that also calls that tf.function (ResourceGather -> GatherV2 in the functions)."""
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(16)
        ids = tf.compat.v1.placeholder(tf.int32, [None, 3], name="ids")
        table = tf.compat.v1.get_variable("table", [6, 2])

        @tf.function(autograph=False)
        def look(i):
            return tf.nn.embedding_lookup(table, i)

        def body(k, h):
            rows = tf.nn.embedding_lookup(table, ids[:, k]) * look(ids[:, 0])   # [B, 2]
            return k + 1, h + tf.reduce_sum(rows ** 2, axis=1)

        _, acc = tf.while_loop(lambda k, h: k < 3, body,
                               [tf.constant(0), tf.zeros_like(tf.cast(ids[:, 0], tf.float32))])
        out = tf.sin(look(ids))                                                # [B, 3, 2]
        ys = acc + tf.reduce_sum(out, axis=[1, 2])                             # [B]
    feed = {ids: np.array([[1, 2, 2], [0, 5, 3], [4, 4, 4], [5, 1, 0]])[:B]}
    return cases.Case("gathers in functions", graph, None, ys, [table], feed, [ids], B)


CASES = {
    "SimpleRNN": lambda: _build(_rnn_case("SimpleRNN", False)),
    # the Jacobians of a While (K = 2 gradients through each tower's loop copy): heavy
    "SimpleRNN_jacobians": lambda: _build(_rnn_case("SimpleRNN", False), microbatches=False,
                                          jacobians=True),
    # B = 3 where no microbatches are built: each tower builds its own loop gradient
    "GRU": lambda: _build(_rnn_case("GRU", False, B=3), microbatches=False),
    "LSTM": lambda: _build(_rnn_case("LSTM", False, B=3), microbatches=False),
    "SimpleRNN_unrolled": lambda: _build(_rnn_case("SimpleRNN", True, B=3),
                                         microbatches=False),
    "GRU_unrolled": lambda: _build(_rnn_case("GRU", True, B=3), microbatches=False),
    "LSTM_unrolled": lambda: _build(_rnn_case("LSTM", True, B=3), microbatches=False),
    "cond": lambda: _build(_cond_case(), methods=("towers", "auto")),
    "cond_jacobians": lambda: _build(_cond_case(), jacobians=True),
    # two examples and no microbatches where each tower copies a loop (microbatches of
    # towers over control flow: SimpleRNN's While, cond's If, tf.function's call)
    "while_loop": lambda: _build(_while_case(B=2), methods=("towers", "auto"),
                                 microbatches=False),
    "tf.function": lambda: _build(_function_case(), jacobians=True),
    "gathers_in_functions": lambda: _build(_gathers_in_functions_case(B=2),
                                           microbatches=False),
}
# The default run builds one case per mechanism: a Keras RNN's While (SimpleRNN, with
# microbatches), an If, a hand-written while_loop with a nested cond, a function call
# (with Jacobians), gathers inside functions. GRU and LSTM read their weights through the
# same While as SimpleRNN (the LSTM's is also run by tests/test_rules_recurrent.py and
# the legacy checks) and the unrolled layers hold no control flow: they run with -m
# heavy, as do the Jacobians through SimpleRNN's While and cond's If (the towers'
# Jacobians through control flow: the function call of "tf.function").
HEAVY_CASES = ("GRU", "LSTM", "SimpleRNN_unrolled", "GRU_unrolled", "LSTM_unrolled",
               "SimpleRNN_jacobians", "cond_jacobians")


@pytest.fixture(scope="module", params=[
    pytest.param(name, marks=pytest.mark.heavy) if name in HEAVY_CASES else name
    for name in sorted(CASES)])
def built(request):
    result = CASES[request.param]()
    yield result
    result.case.sess.close()


def test_per_example_gradients_match_oracle(built):
    case = built.case
    want = built.loop.run(case.sess, case.feed, case.B)
    for key, values in built.values().items():
        if key.startswith("per_example/"):
            common.assert_all_close(values, want, case.rtol, case.atol, f"{case.name} {key}")


def test_microbatch_gradients_match_oracle(built):
    case = built.case
    if "microbatches" not in built.got:
        pytest.skip(f"microbatches are checked on the other control-flow cases ({case.name} "
                    "is slow to build)")
    want = built.loop.run(case.sess, case.feed, 2)
    common.assert_all_close(built.values()["microbatches"], want, case.rtol, case.atol,
                            f"{case.name} 2 microbatches")


def test_per_example_gradients_sum_to_the_batch_gradient(built):
    case = built.case
    per_example = built.values()["per_example/towers"]
    batch_gradient = built.values()["batch_gradient"]
    common.assert_all_close([g.sum(axis=0) for g in per_example], batch_gradient,
                            case.rtol * 10, case.atol * 10, f"{case.name} sum")


def test_per_example_jacobians_match_oracle(built):
    case = built.case
    if "jacobians" not in built.got:
        pytest.skip(f"Jacobians are checked on tf.function (SimpleRNN's and cond's with -m "
                    f"heavy), not {case.name}")
    got = built.values()["jacobians"]
    want = built.jacobian_oracle()
    common.assert_all_close(got, want, case.rtol, case.atol, f"{case.name} Jacobians")


def test_a_body_that_writes_the_weight_is_refused_with_its_op():
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        w = tf.compat.v1.get_variable("w", [3])

        def write_then_read():
            with tf.control_dependencies([w.assign_add(tf.ones([3]))]):
                return x * w.read_value()

        ys = tf.reduce_sum(tf.cond(tf.constant(True), write_then_read, lambda: x * w), axis=1)
        ops_before = len(tf.compat.v1.get_default_graph().get_operations())
        with pytest.raises(NotImplementedError,
                           match=r"the weight 'w:0' read inside op 'cond' \(If\), .*passes "
                                 r"the weight to op .* of type AssignAddVariableOp.*writes or "
                                 r"otherwise uses the variable cannot be replayed on a copy.*"
                                 r"Leave this weight out of `xs`"):
            pertower.per_example_gradients(ys, [w], batch_size=2)
        # refused before any op was added
        assert len(tf.compat.v1.get_default_graph().get_operations()) == ops_before


@pytest.mark.heavy
def test_masked_bidirectional_rnn_with_sparse_embedding_matches_oracle():
    """A text model: Embedding(mask_zero) -> Bidirectional(SimpleRNN) (two While ops with
    a mask; the LSTM's loop is tested on its own above) -> pooling -> Dense, the
    embedding's gradients sparse. Heavy (two loops with a mask, built for the towers and
    the oracle): the default run checks a masked Keras loop on the rules
    (tests/test_rules_recurrent_v1.py, mask_zero), a Keras RNN's While on the towers
    (SimpleRNN above) and sparse=True (tests/test_sparse.py)."""
    with tf.Graph().as_default() as graph:
        common.seed_weights(15)
        ids = tf.compat.v1.placeholder(tf.int32, [None, 5], name="ids")
        embedding = keras.layers.Embedding(10, 4, mask_zero=True)
        rnn = keras.layers.Bidirectional(keras.layers.SimpleRNN(3, return_sequences=True))
        pooled = keras.layers.GlobalAveragePooling1D()(rnn(embedding(ids)))   # [B, 6]
        ys = keras.layers.Dense(1)(pooled)[:, 0]                                # [B]
        xs = tf.compat.v1.trainable_variables()
        loop = oracle.SliceLoop(ys, xs)
        grads = pertower.per_example_gradients(ys, xs, batch_size=2, sparse=True)
        assert isinstance(grads[0], pertower.PerExampleIndexedSlices)
        dense = [grads[0].to_dense()] + grads[1:]
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            feed = {ids: np.array([[1, 2, 3, 0, 0], [9, 8, 7, 6, 5]])}   # masked, full
            common.assert_all_close(sess.run(dense, feed), loop.run(sess, feed, 2), kind="deep",
                                    what="masked bidirectional RNN")


def _recurrent_model(layer, seed=17):
    """A fresh graph: [B, 3, 2] sequences -> `layer`(3) (a v2 While) -> Dense(2) -> [B]."""
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(seed)
        x = tf.compat.v1.placeholder(tf.float32, [None, 3, 2], name="sequences")
        rnn = getattr(keras.layers, layer)(3)
        head = keras.layers.Dense(2)
        ys = tf.reduce_sum(tf.sin(head(rnn(x))), axis=1)                   # [B]
    return graph, x, ys, list(rnn.trainable_weights) + list(head.trainable_weights)


def _plain_tf_reference(layer, values, X, learning_rate):
    """Plain TensorFlow on the same model and weight values, every gradient built before
    the first run: the one-example loop, and the weights after one `minimize` step of
    the mean of `ys`."""
    graph, x, ys, xs = _recurrent_model(layer)
    with graph.as_default():
        loop = oracle.SliceLoop(ys, xs)
        train = tf.compat.v1.train.GradientDescentOptimizer(learning_rate).minimize(
            tf.reduce_mean(ys), var_list=xs)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for v, value in zip(xs, values):
                v.load(value, sess)
            want = loop.run(sess, {x: X}, len(X))
            sess.run(train, {x: X})
            return want, sess.run(xs)


@pytest.mark.parametrize("layer, order", [
    ("SimpleRNN", "pertower_first"),     # the same While edit as GRU's and LSTM's
    pytest.param("GRU", "pertower_first", marks=pytest.mark.heavy),
    pytest.param("LSTM", "pertower_first", marks=pytest.mark.heavy),
    pytest.param("GRU", "model_run_first", marks=pytest.mark.heavy)])
def test_recurrent_layer_and_a_training_op_built_after_the_first_run(layer, order):
    """The towers differentiate copies of the layer's While op; the original is edited
    as a `tf.gradients` through it would edit it (pertower._towers.later_gradients).
    pertower_first: the per-example gradients are built and run, then `minimize` of the
    mean loss is built and run; its step equals plain TF's (which builds its gradients
    before the first run) and changes the weights. model_run_first: the session runs the
    model before the pertower call; pertower's gradients still run and match the loop."""
    B, learning_rate = 3, 0.5
    X = np.random.RandomState(5).randn(B, 3, 2).astype(np.float32)
    graph, x, ys, xs = _recurrent_model(layer)
    with graph.as_default(), tf.compat.v1.Session(graph=graph) as sess:
        if order == "model_run_first":
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(ys, {x: X})
        grads = pertower.per_example_gradients(ys, xs, batch_size=B)
        if order == "pertower_first":
            sess.run(tf.compat.v1.global_variables_initializer())
        got = sess.run(grads, {x: X})
        values = sess.run(xs)
        want, stepped = _plain_tf_reference(layer, values, X, learning_rate)
        common.assert_all_close(got, want, kind="deep", what=f"{layer} {order}")
        if order == "pertower_first":
            train = tf.compat.v1.train.GradientDescentOptimizer(learning_rate).minimize(
                tf.reduce_mean(ys), var_list=xs)
            sess.run(train, {x: X})
            after = sess.run(xs)
            assert any(not np.allclose(a, v) for a, v in zip(after, values))
            common.assert_all_close(after, stepped, kind="deep", what=f"{layer} minimize step")


def test_cond_and_function_and_a_training_op_built_after_the_first_run():
    """The If of a tf.cond and the call of a tf.function reading the weights (both edited
    by their TF gradients like a While): `minimize` built after pertower's gradients have
    run steps the weights by the sum of those gradients over the batch."""
    B, learning_rate = 3, 0.1
    with tf.Graph().as_default() as graph:
        common.seed_weights(18)
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        w = tf.compat.v1.get_variable("w", [3, 3])
        v = tf.compat.v1.get_variable("v", [3, 2])

        @tf.function(autograph=False)
        def layer(a):
            return tf.tanh(tf.matmul(a, v))

        flag = tf.compat.v1.placeholder_with_default(True, [], name="flag")
        h = tf.cond(flag, lambda: tf.sin(tf.matmul(x, w)), lambda: x)       # [B, 3]
        ys = tf.reduce_sum(layer(h) ** 2, axis=1)                           # [B]
        grads = pertower.per_example_gradients(ys, [w, v], batch_size=B, method="towers")
        feed = {x: np.random.RandomState(6).randn(B, 3).astype(np.float32)}
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            got = sess.run(grads, feed)
            before = sess.run([w, v])
            train = tf.compat.v1.train.GradientDescentOptimizer(learning_rate).minimize(
                tf.reduce_sum(ys), var_list=[w, v])
            sess.run(train, feed)
            after = sess.run([w, v])
    # the oracle in a graph of its own: a gradient through the cond built here would
    # edit the forward ops this test is about
    with tf.Graph().as_default() as twin:
        x2 = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        w2 = tf.compat.v1.Variable(before[0])
        v2 = tf.compat.v1.Variable(before[1])
        h2 = tf.cond(tf.constant(True), lambda: tf.sin(tf.matmul(x2, w2)), lambda: x2)
        ys2 = tf.reduce_sum(tf.tanh(tf.matmul(h2, v2)) ** 2, axis=1)
        loop = oracle.SliceLoop(ys2, [w2, v2])
        with tf.compat.v1.Session(graph=twin) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            want = loop.run(sess, {x2: feed[x]}, B)
    common.assert_all_close(got, want, what="cond and tf.function")
    common.assert_all_close(after, [b - learning_rate * g.sum(axis=0)
                                    for b, g in zip(before, want)], what="minimize step")

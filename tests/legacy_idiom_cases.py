"""Small models built the way old TF1 tutorials and papers' code built them, for the
heavy matrix of tests/test_legacy_idioms.py (and its legacy script): placeholders with a
None batch, tf.compat.v1.get_variable (scopes, reuse, partitioners), raw tf.nn ops,
tf.compat.v1.layers, tf.compat.v1.nn.rnn_cell cells under the v1 RNN functions, and
the per-example loss as `ys`.

`CASES` maps a name to a builder () -> (ys, feed) in the current graph; `REFUSED` maps
a name to (builder, words the refusal must contain). `check_case` compares
per-example gradients and norms (no batch_size) with the one-example loop at B = 3.
"""

import numpy as np
import tensorflow as tf

import pertower
from pertower import oracle
from tests import common

__all__ = ["CASES", "REFUSED", "check_case", "check_refused",
           "assert_gradients_and_norms_match_loop"]

v1 = tf.compat.v1
B = 3
CASES = {}
REFUSED = {}


def _case(function):
    CASES[function.__name__] = function
    return function


def _xent(logits, labels):
    return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)


def _head(h, labels, name="head"):
    flat = tf.reshape(h, [-1, int(np.prod(h.shape.as_list()[1:]))])
    return _xent(tf.matmul(flat, v1.get_variable(name, [flat.shape.as_list()[1], 3])), labels)


def _model(shape, build, dtype=tf.float32, high=None):
    """Placeholders x [None, *shape] and y [None]; ys = build(x, y); a feed of B rows."""
    rng = np.random.RandomState(0)
    x = v1.placeholder(dtype, [None] + list(shape), name="x")
    y = v1.placeholder(tf.int32, [None], name="y")
    ys = build(x, y)
    value = (rng.randint(0, high, [B] + list(shape)) if high
             else rng.randn(B, *shape).astype(np.float32))
    return ys, {x: value, y: rng.randint(0, 3, B)}


@_case
def xw_plus_b_scope_reuse():
    def build(x, y):
        def layer(h):
            with v1.variable_scope("shared", reuse=v1.AUTO_REUSE):
                return tf.nn.relu(v1.nn.xw_plus_b(h, v1.get_variable("W", [4, 4]),
                                                  v1.get_variable("b", [4])))
        return _head(layer(layer(x)), y)
    return _model([4], build)


@_case
def partitioned_matmul():
    def build(x, y):
        with v1.variable_scope("p", partitioner=v1.fixed_size_partitioner(3)):
            W = v1.get_variable("W", [6, 4])
        return _head(tf.tanh(tf.matmul(x, W) + v1.get_variable("b", [4])), y)
    return _model([6], build)


@_case
def raw_convolutions():
    def build(x, y):
        h = tf.nn.atrous_conv2d(x, v1.get_variable("K1", [3, 3, 2, 3]), 2, "SAME")
        h = tf.nn.separable_conv2d(h, v1.get_variable("D", [3, 3, 3, 1]),
                                   v1.get_variable("P", [1, 1, 3, 2]), [1, 1, 1, 1], "SAME")
        h = tf.nn.local_response_normalization(tf.nn.relu(h), depth_radius=1, alpha=0.1)
        h, _ = tf.nn.max_pool_with_argmax(h, [1, 2, 2, 1], [1, 2, 2, 1], "SAME")
        out_shape = tf.stack([tf.shape(x)[0], 8, 8, 2])
        h = tf.nn.conv2d_transpose(h, v1.get_variable("K2", [3, 3, 2, 2]), out_shape,
                                   [1, 2, 2, 1], "SAME")
        return _head(h, y)
    return _model([8, 8, 2], build)


@_case
def conv1d_strided():
    return _model([9, 2], lambda x, y: _head(
        tf.nn.conv1d(x, v1.get_variable("K", [3, 2, 3]), 2, "VALID"), y))


@_case
def layers_convolutions():
    L = v1.layers

    def build(x, y):
        h = L.conv2d(x, 3, 3, padding="same", dilation_rate=2, activation=tf.nn.relu)
        h = L.separable_conv2d(h, 3, 3, depth_multiplier=2)
        h = L.conv2d_transpose(h, 2, 3, strides=2, padding="same")
        h = L.batch_normalization(h, training=False)
        return _xent(L.dense(L.flatten(L.average_pooling2d(h, 2, 2)), 3), y)
    return _model([6, 6, 2], build)


@_case
def layers_conv1d_conv3d():
    L = v1.layers

    def build(x, y):
        h = L.conv3d(x, 2, 3, padding="same")
        h = L.conv1d(tf.reshape(h, [-1, 16, 4]), 3, 3, padding="same")
        return _xent(L.dense(L.dropout(L.flatten(h), 0.5, training=False), 3), y)
    return _model([4, 4, 2, 2], build)


@_case
def layer_norm_by_moments_and_v1_losses():
    L = v1.layers

    def build(x, y):
        h = L.dense(x, 5)
        mean, var = tf.nn.moments(h, [1], keepdims=True)   # per example
        h = tf.nn.batch_normalization(h, mean, var, v1.get_variable("beta", [5]),
                                      v1.get_variable("gamma", [5]), 1e-3)
        logits = L.dense(tf.clip_by_value(h, -1, 1) + tf.stop_gradient(h), 3)
        none = v1.losses.Reduction.NONE
        return (v1.losses.sparse_softmax_cross_entropy(y, logits, reduction=none)
                + tf.reduce_sum(v1.losses.huber_loss(tf.one_hot(y, 3), logits, weights=2.0,
                                                     reduction=none), 1))
    return _model([4], build)


@_case
def overridden_gradients_and_shadow_reads():
    L = v1.layers

    @tf.custom_gradient
    def clipped(h):
        return tf.identity(h), lambda dy: tf.clip_by_value(dy, -0.1, 0.1)

    def build(x, y):
        h = clipped(L.dense(x, 5))
        with v1.get_default_graph().gradient_override_map({"Sign": "Identity"}):
            h = tf.sign(h) * 0.5 + h
        W = v1.get_variable("W", [5, 3])
        ema = v1.train.ExponentialMovingAverage(0.9)
        ema.apply([W])
        return (_xent(tf.matmul(h, W) + tf.matmul(h, ema.average(W)), y)
                + 0.1 * tf.nn.l2_loss(W))   # a weight decay term in every example's loss
    return _model([4], build)


@_case
def tied_embedding_with_max_norm():
    def build(x, y):
        E = v1.get_variable("E", [10, 4], initializer=v1.random_normal_initializer(stddev=2.0))
        h = tf.reduce_mean(v1.nn.embedding_lookup(E, x, max_norm=1.0), 1)
        return _xent(tf.matmul(h, E[:3], transpose_b=True), y)
    return _model([4], build, tf.int32, high=10)


@_case
def sparse_ids_padded_with_minus_one():
    """Ids padded with -1 (0 a valid id) made sparse by hand: tf.where, tf.gather_nd."""
    ids = v1.placeholder(tf.int64, [None, 4], name="ids")
    y = v1.placeholder(tf.int32, [None], name="y")
    where = tf.where(tf.not_equal(ids, -1))
    sp = tf.SparseTensor(where, tf.gather_nd(ids, where), tf.shape(ids, out_type=tf.int64))
    h = v1.nn.embedding_lookup_sparse(v1.get_variable("E", [10, 4]), sp, None, combiner="sqrtn")
    ys = _xent(tf.matmul(h, v1.get_variable("W", [4, 3])), y)
    return ys, {ids: np.array([[1, 1, 0, -1], [0, -1, -1, -1], [4, 5, 6, 7]]), y: [0, 1, 2]}


def _rnn(cell_fn, runner):
    cells = v1.nn.rnn_cell

    def build(x, y):
        if runner == "dynamic":
            out, _ = v1.nn.dynamic_rnn(cell_fn(cells), x, dtype=tf.float32)
            return _head(out[:, -1], y)
        if runner == "bidirectional":
            (fw, bw), _ = v1.nn.bidirectional_dynamic_rnn(cell_fn(cells), cell_fn(cells), x,
                                                          dtype=tf.float32)
            return _head(tf.concat([fw[:, -1], bw[:, 0]], 1), y)
        outs, _ = v1.nn.static_rnn(cell_fn(cells), tf.unstack(x, axis=1), dtype=tf.float32)
        return _head(outs[-1], y)
    return lambda: _model([4, 3], build)


CASES.update({
    "dynamic_rnn_multi_gru_lstm": _rnn(lambda c: c.MultiRNNCell(
        [c.DropoutWrapper(c.GRUCell(4), output_keep_prob=1.0),
         c.ResidualWrapper(c.BasicLSTMCell(4))]), "dynamic"),
    "bidirectional_lstm_projection": _rnn(
        lambda c: c.LSTMCell(3, num_proj=2, cell_clip=0.5), "bidirectional"),
    "static_rnn_lstm_peepholes": _rnn(lambda c: c.LSTMCell(3, use_peepholes=True), "static"),
})


@_case
def scan_and_map_fn_over_time():
    def build(x, y):
        W, U = v1.get_variable("W", [3, 4]), v1.get_variable("U", [4, 4])
        steps = tf.transpose(x, [1, 0, 2])
        hs = tf.scan(lambda h, xt: tf.tanh(tf.matmul(xt, W) + tf.matmul(h, U)), steps,
                     initializer=tf.zeros([tf.shape(x)[0], 4]))
        side = tf.map_fn(lambda xt: tf.matmul(xt, W), steps)
        return _head(hs[-1] + tf.reduce_sum(side, 0), y)
    return _model([4, 3], build)


REFUSED.update({
    "batch_normalization_training": (lambda: _model([4], lambda x, y: _xent(v1.layers.dense(
        v1.layers.batch_normalization(v1.layers.dense(x, 5), training=True), 3), y)),
        "couples the examples"),
    "batch_moments": (lambda: _model([4], lambda x, y: _xent(tf.nn.batch_normalization(
        x, *tf.nn.moments(x, [0]), None, None, 1e-3) @ v1.get_variable("W", [4, 3]), y)),
        "couples the examples"),
    "v1_loss_default_reduction": (lambda: _model(
        [4], lambda x, y: v1.losses.sparse_softmax_cross_entropy(y, v1.layers.dense(x, 3))),
        "reduction=NONE"),
})


def check_case(name):
    """Per-example gradients and norms of CASES[name] (no batch_size) against the loop."""
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(0)
        ys, feed = CASES[name]()
        xs = v1.trainable_variables()
        grads = pertower.per_example_gradients(ys, xs)
        norms = pertower.per_example_norms(ys, xs)
        loop = oracle.SliceLoop(ys, xs)
        sess = v1.Session(graph=graph)
        sess.run(v1.global_variables_initializer())
    assert_gradients_and_norms_match_loop(sess, grads, norms, loop, feed, name)


def assert_gradients_and_norms_match_loop(sess, grads, norms, loop, feed, what):
    """Runs per-example gradients `grads` and norms `norms` ([B]) on `feed` (B = 3
    examples) and compares them with the one-example loop `loop`
    (`oracle.SliceLoop`). Returns (loop's per-example gradients, their norms)."""
    tolerance = common.tolerance(np.float32, "deep")
    got, got_norms = sess.run([grads, norms], feed)
    want = loop.run(sess, feed, B)
    common.assert_all_close(got, want, what=f"{what}: per-example gradients", **tolerance)
    want_norms = np.sqrt(sum(np.sum(g.reshape(B, -1) ** 2, axis=1) for g in want))
    common.assert_all_close([got_norms], [want_norms], what=f"{what}: norms", **tolerance)
    return want, want_norms


def check_refused(name):
    """REFUSED[name] is refused with a ValueError naming the reason."""
    build, words = REFUSED[name]
    with tf.Graph().as_default():
        ys, _ = build()
        try:
            pertower.per_example_gradients(ys, v1.trainable_variables())
        except ValueError as error:
            assert words in str(error), f"{name}: {error}"
            return
    raise AssertionError(f"{name}: not refused")

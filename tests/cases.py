"""The shared test models: every model that more than one test module builds.

Each `build_*` function builds one model in a graph of its own and returns a `Case`:
the per-example values `ys` [B, ...], the weights, the feeds for a batch of B examples,
and what the slow oracle (`pertower.oracle`) needs. Models are built on placeholders
whose batch axis is None unless the case is about static batch axes; then the oracle
runs on a second, None-batch input to the same model.

- `BUILDERS`: the scenario models (an MLP in float32 and float64, a static-batch MLP, a
  CNN, an embedding model, a shared layer, a subclassed model, tf.compat.v1.layers);
- `RULE_MODELS`: one model per op rule (and two that fall back), built by `build_case`;
- `build_cifar_case`: the bench's CIFAR conv net;
- `build_hidden_features`: x [B, 3] -> Dense(6, tanh) -> Dense(4), the activations h
  [B, 4] that the batch-axis tests build their ops on;
- `language_model`: Embedding -> a Keras recurrent layer -> Dense, the loop tests' model;
- scenario 2 (several microbatches, two placeholders) checkable by hand.

Every builder seeds its weights with `common.seed_weights`, so a model's weights are the
same whatever ran before in the process. Tolerances, the comparison and the oracle's
runner are in tests/common.py.
"""

import dataclasses

import numpy as np
import tensorflow as tf
import tf_keras as keras

from benchmarks import models as models_lib
from tests import common

__all__ = ["Case", "BUILDERS", "RULE_MODELS", "build_case", "build_cifar_case",
           "build_hidden_features", "random_normal_variable", "dense_sequence", "mixed",
           "mixing_op",
           "run_scenario_2_hand_checkable_case", "run_scenario_2_two_placeholders_case",
           "check_scenario_2_two_placeholders_case"]


@dataclasses.dataclass
class Case:
    """One model in a graph of its own, with a session and a batch to feed.

    `rtol` and `atol` are the tolerances its comparisons use (`common.tolerance` of its
    dtype and kind of graph)."""

    name: str
    graph: tf.Graph
    sess: tf.compat.v1.Session
    ys: tf.Tensor            # [B, ...] per-example values
    xs: list                 # the weights
    feed: dict               # placeholder -> [B, ...] values
    batch: list              # the batch placeholders
    B: int
    outputs: tf.Tensor = None  # [B, K] a multi-output tensor for Jacobians
    oracle_ys: tf.Tensor = None  # ys on None-batch inputs (static cases)
    oracle_outputs: tf.Tensor = None
    oracle_feed: dict = None
    rtol: float = common.tolerance(np.float32)["rtol"]
    atol: float = common.tolerance(np.float32)["atol"]
    # the one-example loop's values on this model, each computed once
    oracles: common.OracleCache = dataclasses.field(default_factory=common.OracleCache)

    def oracle(self):
        """(ys, outputs, feed) for the one-example loop."""
        if self.oracle_ys is None:
            return self.ys, self.outputs, self.feed
        return self.oracle_ys, self.oracle_outputs, self.oracle_feed




def _session(graph):
    sess = tf.compat.v1.Session(graph=graph)
    sess.run(tf.compat.v1.global_variables_initializer())
    return sess


def build_mlp(B=6, dtype=tf.float32, name="mlp"):
    """Scenario 1: Keras Sequential MLP, cost = (net(x) - y) ** 2, [B, 1]."""
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(1)
        x = tf.compat.v1.placeholder(dtype, [None, 5], name="x")
        y = tf.compat.v1.placeholder(dtype, [None, 1], name="y")
        net = keras.Sequential([
            keras.layers.Dense(16, activation="tanh", dtype=dtype.name),
            keras.layers.Dense(8, activation="relu", dtype=dtype.name),
            keras.layers.Dense(3, dtype=dtype.name),
        ])
        out = net(x)                                    # [B, 3]
        cost = (out[:, :1] - y) ** 2                    # [B, 1]
        sess = _session(graph)
    rng = np.random.RandomState(0)
    feed = {x: rng.randn(B, 5).astype(dtype.as_numpy_dtype),
            y: rng.randn(B, 1).astype(dtype.as_numpy_dtype)}
    return Case(name, graph, sess, cost, list(net.trainable_weights), feed, [x, y], B,
                outputs=out, **common.tolerance(dtype))


def build_static_mlp(B=4):
    """An MLP on placeholders with a static batch axis [B, 5]; the oracle runs the same
    model on a None-batch placeholder."""
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(2)
        x = tf.compat.v1.placeholder(tf.float32, [B, 5], name="x_static")
        x_any = tf.compat.v1.placeholder(tf.float32, [None, 5], name="x_any")
        net = keras.Sequential([keras.layers.Dense(7, activation="sigmoid"),
                                keras.layers.Dense(2)])
        out, oracle_out = net(x), net(x_any)          # [B, 2]
        ys = tf.reduce_sum(out ** 2, axis=1)           # [B]
        oracle_ys = tf.reduce_sum(oracle_out ** 2, axis=1)
        sess = _session(graph)
    values = np.random.RandomState(1).randn(B, 5).astype(np.float32)
    return Case("static_mlp", graph, sess, ys, list(net.trainable_weights), {x: values}, [x],
                B, outputs=out, oracle_ys=oracle_ys, oracle_outputs=oracle_out,
                oracle_feed={x_any: values})


def build_cnn(B=3):
    """Scenario 3: Conv2D(16, 5, same, elu) -> Flatten -> Dense(128, relu) -> Dense(1)."""
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(3)
        x = tf.compat.v1.placeholder(tf.float32, [None, 32, 32, 1], name="images")
        model = models_lib.cnn_keras_model()
        ys = model(x)                                   # [B, 1]
        sess = _session(graph)
    feed = {x: np.random.RandomState(2).rand(B, 32, 32, 1).astype(np.float32)}
    return Case("cnn", graph, sess, ys, list(model.trainable_weights), feed, [x], B,
                outputs=ys, **common.tolerance(np.float32, "deep"))


def build_embedding(B=4):
    """Functional model: ids [B, 4] -> Embedding(20, 6) -> Flatten, with dense features
    -> Dense(2); ys is a softmax cross-entropy per example [B]."""
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(4)
        ids = keras.Input(shape=(4,), dtype="int32", name="ids")
        feats = keras.Input(shape=(3,), name="feats")
        e = keras.layers.Flatten()(keras.layers.Embedding(20, 6)(ids))
        h = keras.layers.Concatenate()([e, feats])
        logits = keras.layers.Dense(2)(keras.layers.Dense(5, activation="relu")(h))
        model = keras.Model([ids, feats], logits)
        labels = tf.compat.v1.placeholder(tf.int32, [None], name="labels")
        out = model([ids, feats])
        ys = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=out)
        sess = _session(graph)
    rng = np.random.RandomState(3)
    # repeated ids within an example: their rows' gradients must add up
    id_values = np.array([[1, 2, 2, 7], [3, 3, 3, 3], [0, 19, 5, 1], [7, 1, 2, 9]])[:B]
    feed = {ids: id_values, feats: rng.randn(B, 3).astype(np.float32),
            labels: rng.randint(0, 2, B)}
    return Case("embedding", graph, sess, ys, list(model.trainable_weights), feed,
                [ids, feats, labels], B, outputs=out)


def build_shared_layer(B=5):
    """One Dense layer applied twice (its kernel read twice per example)."""
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(5)
        x = tf.compat.v1.placeholder(tf.float32, [None, 4], name="x")
        shared = keras.layers.Dense(4, activation="tanh")
        head = keras.layers.Dense(2)
        out = head(shared(shared(x)) + shared(x))       # [B, 2]
        ys = tf.reduce_sum(tf.sin(out), axis=1)         # [B]
        sess = _session(graph)
    feed = {x: np.random.RandomState(4).randn(B, 4).astype(np.float32)}
    xs = list(shared.trainable_weights) + list(head.trainable_weights)
    return Case("shared_layer", graph, sess, ys, xs, feed, [x], B, outputs=out)


class _SequenceModel(keras.Model):
    """Subclassed model: Conv1D -> LayerNormalization -> Dropout -> Flatten -> Dense."""

    def __init__(self):
        super().__init__()
        self.conv = keras.layers.Conv1D(4, 3, strides=2, padding="valid", activation="relu")
        self.norm = keras.layers.LayerNormalization()
        self.drop = keras.layers.Dropout(0.5)
        self.flat = keras.layers.Flatten()
        self.out = keras.layers.Dense(2)

    def call(self, inputs, training=None):
        h = self.norm(self.conv(inputs))
        return self.out(self.flat(self.drop(h, training=training)))


def build_subclassed(B=4):
    """Subclassed model on sequences [B, 9, 3], Dropout in inference mode."""
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(6)
        x = tf.compat.v1.placeholder(tf.float32, [None, 9, 3], name="seq")
        model = _SequenceModel()
        out = model(x)                                  # [B, 2]
        ys = tf.reduce_sum(out ** 2, axis=1)            # [B]
        sess = _session(graph)
    feed = {x: np.random.RandomState(5).randn(B, 9, 3).astype(np.float32)}
    return Case("subclassed", graph, sess, ys, list(model.trainable_weights), feed, [x], B,
                outputs=out, **common.tolerance(np.float32, "deep"))


def build_compat_v1_layers(B=4):
    """tf.compat.v1.layers.dense and tf.compat.v1.get_variable (resource variables)."""
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(7)
        s = tf.compat.v1.placeholder(tf.float32, [None, 3], name="s")
        with tf.compat.v1.variable_scope("f"):
            h = tf.compat.v1.layers.dense(s, 6, tf.nn.tanh, name="hidden")
            scale = tf.compat.v1.get_variable("scale", [6], initializer=tf.ones_initializer())
            out = tf.compat.v1.layers.dense(h * scale, 2, name="out")   # [B, 2]
        ys = tf.reduce_sum(out, axis=1)                  # [B]
        sess = _session(graph)
        xs = tf.compat.v1.trainable_variables()
    feed = {s: np.random.RandomState(6).randn(B, 3).astype(np.float32)}
    return Case("compat_v1_layers", graph, sess, ys, xs, feed, [s], B, outputs=out)


BUILDERS = {
    "mlp": build_mlp,
    "mlp_float64": lambda B=6: build_mlp(B, dtype=tf.float64, name="mlp_float64"),
    "static_mlp": build_static_mlp,
    "cnn": build_cnn,
    "embedding": build_embedding,
    "shared_layer": build_shared_layer,
    "subclassed": build_subclassed,
    "compat_v1_layers": build_compat_v1_layers,
}


def build_case(name, build, feed_shapes, B=4, dtype=tf.float32, ids=None, seed=0,
               user_gradients=False):
    """A Case from `build(inputs) -> (ys, xs)` on None-batch placeholders.

    `user_gradients` builds tf.gradients(sum(ys), xs) before the session's first run,
    as a training op would: TensorFlow's gradient of a `tf.function` call rewrites the
    call op, which fails once the session has run the graph (so the oracle's own
    `tf.gradients` could not be built after it)."""
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(seed)
        inputs = [tf.compat.v1.placeholder(dtype if s != "ids" else tf.int32,
                                           [None] + list(ids if s == "ids" else s),
                                           name=f"in{j}")
                  for j, s in enumerate(feed_shapes)]
        ys, xs = build(*inputs)
        if user_gradients:
            tf.gradients(tf.reduce_sum(ys), xs)
        sess = tf.compat.v1.Session(graph=graph)
        sess.run(tf.compat.v1.global_variables_initializer())
    rng = np.random.RandomState(seed)
    feed = {}
    for p, s in zip(inputs, feed_shapes):
        if s == "ids":
            feed[p] = np.array([[1, 2, 2, 7], [3, 3, 3, 3], [0, 9, 5, 1], [7, 1, 2, 9]])[:B]
        else:
            feed[p] = rng.randn(B, *s).astype(dtype.as_numpy_dtype)
    return Case(name, graph, sess, ys, xs, feed, inputs, B, **common.tolerance(dtype, "deep"))


def random_normal_variable(shape, name, dtype=tf.float32):
    """A tf.compat.v1 variable of `shape` drawn from N(0, 1) (the graph's seed applies)."""
    return tf.compat.v1.get_variable(name, shape, dtype=dtype,
                                     initializer=tf.compat.v1.random_normal_initializer())


def dense_sequence(x):            # Keras Dense on [B, T, d]: Tensordot = Reshape + MatMul
    layer = keras.layers.Dense(3, activation="tanh")
    return tf.reduce_sum(layer(x) ** 2, axis=[1, 2]), layer.trainable_weights


def _matmul_transposed(x):
    w = random_normal_variable([3, 4], "w_t")
    return tf.reduce_sum(tf.sin(tf.matmul(x, w, transpose_b=True)), axis=1), [w]


def _batch_matmul(x):              # [B, 5, 4] @ [4, 3] and adjoint_b
    w1, w2 = random_normal_variable([4, 3], "w1"), random_normal_variable([2, 3], "w2")
    h = tf.tanh(tf.matmul(x, w1))                                   # [B, 5, 3]
    return tf.reduce_sum(tf.matmul(h, w2, adjoint_b=True) ** 2, axis=[1, 2]), [w1, w2]


def _einsum(x):                     # einsum and Keras EinsumDense
    w = random_normal_variable([4, 2, 3], "w_e")
    dense = keras.layers.EinsumDense("abc,cd->abd", output_shape=(5, 2), bias_axes="d")
    h = tf.einsum("btd,dhe->bthe", x, w)                             # [B, 5, 2, 3]
    return (tf.reduce_sum(tf.cos(h), axis=[1, 2, 3]) +
            tf.reduce_sum(dense(x) ** 2, axis=[1, 2])), [w] + dense.trainable_weights


def _broadcast(x):                  # x * scale + offset, w - x, x - v
    scale, offset = random_normal_variable([4], "scale"), random_normal_variable([1, 4], "offset")
    w, v = random_normal_variable([4], "w_sub"), random_normal_variable([5, 1], "v_sub")
    h = tf.tanh(x * scale + offset)                                 # [B, 5, 4]
    return tf.reduce_sum((w - h) ** 2 + tf.sin(h - v), axis=[1, 2]), [scale, offset, w, v]


def _layer_norm(x):
    dense = keras.layers.Dense(3)
    norm = keras.layers.LayerNormalization()
    return (tf.reduce_sum(tf.sin(norm(dense(x))), axis=[1, 2]),
            dense.trainable_weights + norm.trainable_weights)


def _conv(strides, padding, dilations, kernel=(3, 2)):
    def build(x):                   # tf.nn.conv2d on [B, 7, 6, 2]
        w = random_normal_variable(list(kernel) + [2, 3], "filter", x.dtype)
        b = random_normal_variable([3], "bias", x.dtype)
        z = tf.nn.bias_add(tf.nn.conv2d(x, w, strides, padding, dilations=dilations), b)
        return tf.reduce_sum(tf.tanh(z) ** 2, axis=[1, 2, 3]), [w, b]
    return build


def _grouped_conv(x):              # tf.nn.conv2d, 2 groups: filter [3, 3, 4/2, 6] on [B, 7, 6, 4]
    w = random_normal_variable([3, 3, 2, 6], "grouped_filter")
    z = tf.nn.conv2d(x, w, [1, 2, 1, 1], "SAME")
    return tf.reduce_sum(tf.tanh(z) ** 2, axis=[1, 2, 3]), [w]


def _keras_grouped_conv(x):        # Keras Conv2D(groups=2): kernel [3, 3, 4/2, 4] on [B, 5, 5, 4]
    """Keras 2 runs a grouped convolution through tf.function(jit_compile=True) (TF's
    CPU kernels without oneDNN have none): the kernel is read by the XLA-compiled call,
    whose body's Conv2D rule covers it (rules/function_call.py), the bias by BiasAdd."""
    layer = keras.layers.Conv2D(4, 3, groups=2, strides=(1, 2), activation="tanh")
    return tf.reduce_sum(layer(x) ** 2, axis=[1, 2, 3]), layer.trainable_weights


def _keras_convs(x):                # Keras Conv1D (ExpandDims + Conv2D) and Conv2D
    conv1 = keras.layers.Conv1D(3, 3, strides=2, padding="valid", activation="relu")
    h = conv1(x)                                                     # [B, 2, 3]
    dense = keras.layers.Dense(2)
    return tf.reduce_sum(dense(keras.layers.Flatten()(h)) ** 2, axis=1), (
        conv1.trainable_weights + dense.trainable_weights)


def _depthwise(x):
    """Keras DepthwiseConv2D (strided, SAME) and the native op (VALID). Dilated
    depthwise convolutions are not tested: TF's own DepthwiseConv2dNativeBackpropFilter
    (oneDNN build) fails on them, so the oracle cannot run."""
    layer = keras.layers.DepthwiseConv2D(3, strides=2, depth_multiplier=2, padding="same")
    w = random_normal_variable([2, 2, 8, 1], "dw")
    h = tf.compat.v1.nn.depthwise_conv2d_native(layer(x), w, [1, 1, 1, 1], "VALID")
    return tf.reduce_sum(tf.sin(h), axis=[1, 2, 3]), layer.trainable_weights + [w]


def _time_distributed_conv(x):     # [B, 3, 5, 5, 2] -> Reshape [B*3, 5, 5, 2] -> Conv2D
    layer = keras.layers.TimeDistributed(keras.layers.Conv2D(3, 2, strides=2))
    return tf.reduce_sum(tf.tanh(layer(x)) ** 2, axis=[1, 2, 3, 4]), layer.trainable_weights


def _embedding(ids):
    emb = keras.layers.Embedding(10, 3)
    table = random_normal_variable([10, 2], "table")
    h = tf.concat([emb(ids), tf.gather(table, ids)], axis=2)       # [B, 4, 5]
    return tf.reduce_sum(tf.tanh(h) ** 2, axis=[1, 2]), emb.trainable_weights + [table]


def mixed(x):
    """Covered and uncovered reads: `k1` only by a MatMul (rules); `k2` by a MatMul and
    by the Pow of an L2 term added to every row (rules, the second through the
    weight-only Pow, Sum and Mul); `scale` squared (plus 0.5) into the bounds of a ClipByValue
    (which has no rule: towers)."""
    k1, k2 = random_normal_variable([4, 3], "k1"), random_normal_variable([3, 2], "k2")
    scale = random_normal_variable([], "scale_sq")
    h = tf.tanh(tf.matmul(x, k1))
    z = tf.matmul(h, k2)
    bound = 0.5 + tf.square(scale)                                      # []
    z = tf.raw_ops.ClipByValue(t=z, clip_value_min=-bound, clip_value_max=bound)  # [B, 2]
    ys = tf.reduce_sum(z ** 2, axis=1) + 0.1 * tf.reduce_sum(k2 ** 2)   # [B]
    return ys, [k1, k2, scale]


def mixing_op(x):
    """A cross product of each row with another (the Cross op) keeps rows, but the
    analysis does not know the op: every weight falls back (sound, and the towers'
    answer)."""
    w = random_normal_variable([4, 3], "w_cross")
    h = tf.matmul(x, w)
    return tf.reduce_sum(tf.linalg.cross(h, tf.sin(h)) ** 2, axis=1), [w]


RULE_MODELS = {
    # name: (build, feed shapes, options, names of weights expected to fall back)
    "dense_sequence": (dense_sequence, [(5, 4)], {}, []),
    "matmul_transposed": (_matmul_transposed, [(4,)], {}, []),
    "batch_matmul": (_batch_matmul, [(5, 4)], {}, []),
    "einsum": (_einsum, [(5, 4)], {}, []),
    "broadcast": (_broadcast, [(5, 4)], {}, []),
    "layer_norm": (_layer_norm, [(4, 5)], {}, []),
    "conv_same_strided": (_conv([1, 2, 2, 1], "SAME", None), [(7, 6, 2)], {}, []),
    "conv_valid_dilated": (_conv([1, 1, 1, 1], "VALID", [1, 2, 2, 1]), [(7, 6, 2)], {}, []),
    "conv_explicit_float64": (_conv([1, 2, 1, 1], [[0, 0], [1, 2], [0, 1], [0, 0]], None),
                              [(7, 6, 2)], {"dtype": tf.float64}, []),
    "conv_same_dilated_odd": (_conv([1, 1, 2, 1], "SAME", [1, 2, 1, 1], (2, 3)),
                              [(7, 6, 2)], {}, []),
    "grouped_conv": (_grouped_conv, [(7, 6, 4)], {}, []),
    "keras_grouped_conv": (_keras_grouped_conv, [(5, 5, 4)], {"user_gradients": True}, []),
    "keras_conv1d": (_keras_convs, [(7, 2)], {}, []),
    "depthwise": (_depthwise, [(7, 6, 4)], {}, []),
    "time_distributed_conv": (_time_distributed_conv, [(3, 5, 5, 2)], {}, []),
    "embedding_repeated_ids": (_embedding, ["ids"], {"ids": (4,), "B": 4}, []),
    "mixed_fallback": (mixed, [(4,)], {}, ["scale_sq"]),
    "mixing_op": (mixing_op, [(4,)], {}, ["w_cross"]),
}


# `language_model`'s sizes: T steps, a vocabulary of VOCAB ids, EMBED and UNITS wide
LM_T, LM_VOCAB, LM_EMBED, LM_UNITS = 4, 11, 3, 5
WHILE_OP_TYPES = ("While", "StatelessWhile")


def language_model(layer, seed):
    """Embedding -> `layer` (a Keras recurrent layer's name, return_sequences) -> Dense over
    the vocabulary, built in the default graph with weights seeded by `seed`; ys is each
    example's sum over its LM_T steps of the next-token cross-entropy.

    Returns:
      (ys [B], xs (the trainable variables), batch [ids, labels] ([B, LM_T] int32), the
      layer's While op, or None where the loop is a TF1 frame).
    """
    common.seed_weights(seed)
    ids = tf.compat.v1.placeholder(tf.int32, [None, LM_T], name="ids")
    labels = tf.compat.v1.placeholder(tf.int32, [None, LM_T], name="labels")
    hidden = getattr(keras.layers, layer)(LM_UNITS, return_sequences=True)(
        keras.layers.Embedding(LM_VOCAB, LM_EMBED)(ids))                   # [B, T, U]
    logits = keras.layers.Dense(LM_VOCAB)(hidden)                          # [B, T, V]
    ys = tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=labels, logits=logits), axis=1)                             # [B]
    loop = next((op for op in tf.compat.v1.get_default_graph().get_operations()
                 if op.type in WHILE_OP_TYPES), None)
    return ys, tf.compat.v1.trainable_variables(), [ids, labels], loop


def build_cifar_case(B=3):
    """The bench's CIFAR conv net (benchmarks.models) as a Case; ys [B]."""
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(5)
        built = models_lib.build("cifar", B, np.random.default_rng(5))
        sess = tf.compat.v1.Session(graph=graph)
        sess.run(tf.compat.v1.global_variables_initializer())
    return Case("cifar", graph, sess, built.ys, built.weights, built.feed, list(built.feed), B,
                **common.tolerance(np.float32, "deep"))


def build_hidden_features(B=4):
    """x [B, 3] -> Dense(6, tanh) -> Dense(4): `outputs` (and `ys`) is the activation h
    [B, 4] that a test builds its own ops on."""
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(5)
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        net = keras.Sequential([keras.layers.Dense(6, activation="tanh"),
                                keras.layers.Dense(4)])
        h = net(x)                                              # [B, 4]
        sess = _session(graph)
    feed = {x: np.random.RandomState(3).randn(B, 3).astype(np.float32)}
    return Case("hidden_features", graph, sess, h, list(net.trainable_weights), feed, [x], B,
                outputs=h)


def run_scenario_2_hand_checkable_case():
    """Scenario 2, checkable by hand: dense(s, 1, tanh) with a zero kernel, the batches
    [[1,2,3],[2,4,6]] and [[1,2,3],[2,4,7]] as two microbatches.

    Returns (kernel gradients [2, 3], their cosine); the answer is [[3, 6, 9],
    [3, 6, 10]] and 135 / sqrt(126 * 145). Works in TF2 graph mode and under
    disable_v2_behavior() (reference variables)."""
    import pertower  # pylint: disable=import-outside-toplevel

    with tf.Graph().as_default() as graph:
        s = tf.compat.v1.placeholder(tf.float32, [None, 3], name="s")
        f = tf.compat.v1.layers.dense(s, 1, tf.nn.tanh, name="f",
                                      kernel_initializer=tf.zeros_initializer())
        kernel = [v for v in tf.compat.v1.trainable_variables() if v.name == "f/kernel:0"]
        (g,) = pertower.microbatch_gradients(f, kernel, num_microbatches=2, batch_size=4)
        cosine = pertower.cosine_similarity(g[0], g[1])
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            feed = {s: np.array([[1, 2, 3], [2, 4, 6], [1, 2, 3], [2, 4, 7]], np.float32)}
            g_value, cos_value = sess.run([g, cosine], feed)
    return g_value[:, :, 0], cos_value


def run_scenario_2_two_placeholders_case():
    """The hand-checkable case of scenario 2 with the batches in two placeholders:
    ys = concat([dense(s1, 1, tanh), dense(s2, 1, tanh)], 0), one shared zero kernel.

    Returns (per-example kernel gradients [4, 3], per-batch kernel gradients [2, 3],
    their cosine, the same three from the oracle loop); the answer is the rows
    [1,2,3], [2,4,6], [1,2,3], [2,4,7] (tanh'(0) = 1), [[3, 6, 9], [3, 6, 10]] and
    135 / sqrt(126 * 145). Works in TF2 graph mode and under disable_v2_behavior()."""
    import pertower  # pylint: disable=import-outside-toplevel
    from pertower import oracle  # pylint: disable=import-outside-toplevel

    with tf.Graph().as_default() as graph:
        s1 = tf.compat.v1.placeholder(tf.float32, [None, 3], name="s1")
        s2 = tf.compat.v1.placeholder(tf.float32, [None, 3], name="s2")

        def f(s):
            return tf.compat.v1.layers.dense(s, 1, tf.nn.tanh, name="f",
                                             reuse=tf.compat.v1.AUTO_REUSE,
                                             kernel_initializer=tf.zeros_initializer())

        ys = tf.concat([f(s1), f(s2)], 0)                                # [B1 + B2, 1]
        kernel = [v for v in tf.compat.v1.trainable_variables() if v.name == "f/kernel:0"]
        (per_example,) = pertower.per_example_gradients(ys, kernel, batch_size=2)
        (g,) = pertower.microbatch_gradients(ys, kernel, num_microbatches=2, batch_size=2)
        cosine = pertower.cosine_similarity(g[0], g[1])
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            feed = {s1: np.array([[1, 2, 3], [2, 4, 6]], np.float32),
                    s2: np.array([[1, 2, 3], [2, 4, 7]], np.float32)}
            rows, g_value, cos_value = sess.run([per_example, g, cosine], feed)
            (want_rows,) = oracle.loop_several_batches_gradients(sess, ys, kernel, feed,
                                                                  [[s1], [s2]])
            (want_g,) = oracle.loop_several_batches_gradients(sess, ys, kernel, feed,
                                                               [[s1], [s2]], 2)
    return rows[:, :, 0], g_value[:, :, 0], cos_value, want_rows[:, :, 0], want_g[:, :, 0]


def check_scenario_2_two_placeholders_case():
    """Runs `run_scenario_2_two_placeholders_case` and asserts its hand-checked answer:
    kernel gradients g1 = [3, 6, 9] and g2 = [3, 6, 10], the oracle's rows and
    gradients, and cos(g1, g2) = 135 / sqrt(126 * 145)."""
    import math  # pylint: disable=import-outside-toplevel
    rows, g_value, cos_value, want_rows, want_g = run_scenario_2_two_placeholders_case()
    np.testing.assert_array_equal(rows, [[1, 2, 3], [2, 4, 6], [1, 2, 3], [2, 4, 7]])
    np.testing.assert_array_equal(g_value, [[3, 6, 9], [3, 6, 10]])
    np.testing.assert_array_equal(want_rows, rows)
    np.testing.assert_array_equal(want_g, g_value)
    want = 135 / math.sqrt(126 * 145)
    assert abs(cos_value - want) < 1e-6, (cos_value, want)

"""Shared test models and comparison helpers.

Each `build_*` function builds one model in a graph of its own and returns a `Case`:
the per-example values `ys` [B, ...], the weights, the feeds for a batch of B examples,
and what the slow oracle (`pertower.oracle`) needs. Models are built on placeholders
whose batch axis is None unless the case is about static batch axes; then the oracle
runs on a second, None-batch input to the same model.

Every builder seeds its weights with `seed_weights`, so a model's weights are the same
whatever ran before in the process; `tolerance` gives the float32 / float64 tolerances
that `assert_all_close` uses when none are passed; `run_oracle` runs the one-example
loop and skips the test when TensorFlow itself cannot compute that reference on this
machine.
"""

import dataclasses
import re

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

__all__ = ["Case", "BUILDERS", "assert_all_close", "tolerance", "run_oracle", "seed_weights",
           "run_scenario_2_hand_checkable_case", "run_scenario_2_two_placeholders_case"]

# Comparing two computations of the same values in different orders (batched vs one
# example at a time, other kernels): rtol for the relative error of each entry, atol
# for entries near zero.
_TOLERANCES = {
    np.dtype(np.float32): dict(rtol=1e-4, atol=1e-6),
    np.dtype(np.float64): dict(rtol=1e-10, atol=1e-12),
}

# TensorFlow errors that say its own kernels cannot compute a graph on this machine (the
# reference cannot be computed either, so there is nothing to compare with): (pattern
# matched on the error's message, why).
_REFERENCE_UNAVAILABLE = (
    (re.compile(r"Current CPU implementations do not yet support dilation rates larger "
                r"than 1"),
     "without oneDNN (TF_ENABLE_ONEDNN_OPTS=0, the default on CPUs without AVX-512) the "
     "CPU convolution gradient kernels refuse dilations > 1"),
    (re.compile(r"(does not support grouped convolutions|filter_size does not have enough "
                r"elements)"),
     "without oneDNN the CPU convolution kernels refuse grouped convolutions"),
)


@dataclasses.dataclass
class Case:
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
    rtol: float = _TOLERANCES[np.dtype(np.float32)]["rtol"]
    atol: float = _TOLERANCES[np.dtype(np.float32)]["atol"]

    def oracle(self):
        """(ys, outputs, feed) for the one-example loop."""
        if self.oracle_ys is None:
            return self.ys, self.outputs, self.feed
        return self.oracle_ys, self.oracle_outputs, self.oracle_feed


def tolerance(dtype):
    """The tolerances for comparing values of a floating dtype.

    Args:
      dtype: a `tf.DType`, a NumPy dtype or type, or an array (its dtype is used).

    Returns:
      dict(rtol=..., atol=...) for `np.allclose` / `assert_all_close`: float64 gets the
      float64 tolerances, every other dtype the float32 ones.
    """
    if isinstance(dtype, tf.DType):
        dtype = dtype.base_dtype.as_numpy_dtype
    dtype = dtype.dtype if isinstance(dtype, np.ndarray) else np.dtype(dtype)
    if dtype == np.float64:
        return dict(_TOLERANCES[np.dtype(np.float64)])
    return dict(_TOLERANCES[np.dtype(np.float32)])


def assert_all_close(got, want, rtol=None, atol=None, what="values"):
    """Compares two lists of arrays; collects every mismatch before failing.

    Args:
      got, want: lists of arrays of the same shapes.
      rtol, atol: the tolerances; None takes them from `tolerance(want[k].dtype)` for
        each array.
      what: the words that start the failure message.
    """
    assert len(got) == len(want), f"{what}: {len(got)} results, expected {len(want)}"
    problems = []
    for k, (g, w) in enumerate(zip(got, want)):
        g, w = np.asarray(g), np.asarray(w)
        if g.shape != w.shape:
            problems.append(f"[{k}] shape {g.shape} != {w.shape}")
            continue
        tol = tolerance(w.dtype) if np.issubdtype(w.dtype, np.floating) else dict(
            rtol=0.0, atol=0.0)
        tol = dict(rtol=tol["rtol"] if rtol is None else rtol,
                   atol=tol["atol"] if atol is None else atol)
        if not np.allclose(g, w, **tol):
            err = np.max(np.abs(g - w))
            problems.append(f"[{k}] max abs error {err:.3g} (scale {np.max(np.abs(w)):.3g})")
    assert not problems, f"{what}: " + "; ".join(problems)


def run_oracle(loop, *args, **kwargs):
    """Runs a one-example loop and returns its values; skips the test if TensorFlow
    cannot compute the reference on this machine.

    Args:
      loop: a function of `pertower.oracle` (e.g. `loop_per_example_gradients`), a
        `SliceLoop`'s `run`, or any function that runs the reference.
      *args, **kwargs: passed to `loop`.

    Returns:
      What `loop` returns.

    Raises:
      pytest.skip.Exception: TensorFlow raised one of the errors of
        `_REFERENCE_UNAVAILABLE` (its kernels on this machine cannot run the graph);
        the reason quotes TensorFlow's message and the op. Any other error propagates.
    """
    try:
        return loop(*args, **kwargs)
    except tf.errors.OpError as error:
        for pattern, why in _REFERENCE_UNAVAILABLE:
            found = pattern.search(error.message)
            if found:
                op = f" at op '{error.op.name}' ({error.op.type})" if error.op is not None else ""
                pytest.skip(f"TensorFlow cannot compute the one-example reference on this "
                            f"machine{op}: {found.group(0)} ({why})")
        raise


def seed_weights(seed):
    """Makes the weights built next in the default graph the same whatever ran before.

    Call inside `with graph.as_default()` of a fresh graph, before building layers.
    `keras.utils.set_random_seed` sets the graph-level seed (tf.compat.v1 initializers
    derive op-level seeds from it and this graph's op count) and Keras's seed generator
    (tf_keras initializers draw stateless seeds from it; unseeded, they would draw from
    Python's global `random`, which other tests and examples advance). It also seeds
    Python's `random` and NumPy's global generator; test inputs use their own
    `np.random.RandomState`.

    Args:
      seed: an int.
    """
    keras.utils.set_random_seed(seed)


def _session(graph):
    sess = tf.compat.v1.Session(graph=graph)
    sess.run(tf.compat.v1.global_variables_initializer())
    return sess


def build_mlp(B=6, dtype=tf.float32, name="mlp"):
    """Scenario 1: Keras Sequential MLP, cost = (net(x) - y) ** 2, [B, 1]."""
    graph = tf.Graph()
    with graph.as_default():
        seed_weights(1)
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
                outputs=out, **tolerance(dtype))


def build_static_mlp(B=4):
    """An MLP on placeholders with a static batch axis [B, 5]; the oracle runs the same
    model on a None-batch placeholder."""
    graph = tf.Graph()
    with graph.as_default():
        seed_weights(2)
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
        seed_weights(3)
        x = tf.compat.v1.placeholder(tf.float32, [None, 32, 32, 1], name="images")
        model = keras.Sequential([
            keras.layers.Conv2D(16, 5, padding="same", activation="elu",
                                input_shape=(32, 32, 1)),
            keras.layers.Flatten(),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(1),
        ])
        ys = model(x)                                   # [B, 1]
        sess = _session(graph)
    feed = {x: np.random.RandomState(2).rand(B, 32, 32, 1).astype(np.float32)}
    return Case("cnn", graph, sess, ys, list(model.trainable_weights), feed, [x], B,
                outputs=ys, rtol=1e-4, atol=1e-5)


def build_embedding(B=4):
    """Functional model: ids [B, 4] -> Embedding(20, 6) -> Flatten, with dense features
    -> Dense(2); ys is a softmax cross-entropy per example [B]."""
    graph = tf.Graph()
    with graph.as_default():
        seed_weights(4)
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
        seed_weights(5)
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
        seed_weights(6)
        x = tf.compat.v1.placeholder(tf.float32, [None, 9, 3], name="seq")
        model = _SequenceModel()
        out = model(x)                                  # [B, 2]
        ys = tf.reduce_sum(out ** 2, axis=1)            # [B]
        sess = _session(graph)
    feed = {x: np.random.RandomState(5).randn(B, 9, 3).astype(np.float32)}
    return Case("subclassed", graph, sess, ys, list(model.trainable_weights), feed, [x], B,
                outputs=out, rtol=1e-4, atol=1e-5)


def build_compat_v1_layers(B=4):
    """tf.compat.v1.layers.dense and tf.compat.v1.get_variable (resource variables)."""
    graph = tf.Graph()
    with graph.as_default():
        seed_weights(7)
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
    "mlp_float64": lambda: build_mlp(dtype=tf.float64, name="mlp_float64"),
    "static_mlp": build_static_mlp,
    "cnn": build_cnn,
    "embedding": build_embedding,
    "shared_layer": build_shared_layer,
    "subclassed": build_subclassed,
    "compat_v1_layers": build_compat_v1_layers,
}


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


def loop_rows_of_batch(sess, ys, xs, feed):
    """The per-example gradients by their definition on the whole batch, [B, *x.shape]
    per x: row i is tf.gradients(tf.reduce_sum(ys[i]), xs), run with `feed` (the whole
    batch), so values computed from the batch (its size, e.g. a mean's 1/B) are the
    whole batch's. B is the length of ys as run on `feed`."""
    B = len(sess.run(ys, feed))
    grads = []
    for i in range(B):
        row = tf.gradients(tf.reduce_sum(ys[i]), xs)
        grads.append([tf.zeros_like(x) if g is None else tf.convert_to_tensor(g)
                      for g, x in zip(row, xs)])
    rows = sess.run(grads, feed)
    return [np.stack([row[k] for row in rows]) for k in range(len(xs))]


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

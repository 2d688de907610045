"""Python-defined gradients and transposed convolutions under the towers, in either
shape mode: tests/test_tower_python_gradients.py runs `CHECKS` in graph mode (TensorShape
of ints), tests/legacy/test_tower_python_gradients.py under
`tf.compat.v1.disable_v2_behavior()` (Dimension objects, reference variables), each with
the environment's oneDNN setting; the heavy run adds each oneDNN setting in each mode.

Every model is a `Model`: `ys` [B, ...] built on a None-batch placeholder, the weights
and a feed. Each check compares `per_example_gradients` (method "towers" and "auto")
and `microbatch_gradients` (towers, M = 2) with the one-example loop
(`pertower.oracle`).
"""

import dataclasses

import numpy as np

B = 4


@dataclasses.dataclass
class Model:
    """ys [B, ...] on the placeholder x, the weights xs and a feed of B examples."""

    graph: object
    x: object
    ys: object
    xs: list
    feed: dict


def build(body, x_shape, seed=0):
    """A `Model` from `body(x) -> (ys, xs)` on a placeholder [None, *x_shape]."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tests import common  # pylint: disable=import-outside-toplevel
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(seed)
        x = tf.compat.v1.placeholder(tf.float32, [None] + list(x_shape), name="x")
        ys, xs = body(x)
    feed = {x: np.random.RandomState(seed + 1).randn(B, *x_shape).astype(np.float32)}
    return Model(graph, x, ys, list(xs), feed)


def compare_with_loop(model, methods=("towers", "auto"), kind="default", whole_batch=False):
    """Asserts that every method and the towers' microbatches match the loop, or with
    `whole_batch` (a cost divided by the batch size: its documented meaning is the whole
    batch's B) the per-example rows of the whole batch (`common.loop_rows_of_batch`)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import pertower  # pylint: disable=import-outside-toplevel
    from pertower import oracle  # pylint: disable=import-outside-toplevel
    from tests import common  # pylint: disable=import-outside-toplevel
    with model.graph.as_default():
        loop = oracle.SliceLoop(model.ys, model.xs)
        results = {m: pertower.per_example_gradients(model.ys, model.xs, batch_size=B,
                                                     method=m) for m in methods}
        halves = pertower.microbatch_gradients(model.ys, model.xs, num_microbatches=2,
                                               batch_size=B, method="towers")
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            if whole_batch:
                want = common.loop_rows_of_batch(sess, model.ys, model.xs, model.feed)
                for method, result in results.items():
                    common.assert_all_close(sess.run(result, model.feed), want,
                                            what=f"method={method!r}", kind=kind)
                return
            want = common.run_oracle(loop.run, sess, model.feed, B)
            for method, result in results.items():
                common.assert_all_close(sess.run(result, model.feed), want,
                                        what=f"method={method!r}", kind=kind)
            common.assert_all_close(sess.run(halves, model.feed),
                                    common.run_oracle(loop.run, sess, model.feed, 2),
                                    what="microbatch_gradients", kind=kind)


# -- item 4: gradients written in Python ----------------------------------------------

def keras_swish_mlp(x):
    """tf_keras Dense(8, swish) then Dense(3): swish's tf.custom_gradient closes over
    its input."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import tf_keras as keras  # pylint: disable=import-outside-toplevel
    net = keras.Sequential([keras.layers.Dense(8, activation="swish"),
                            keras.layers.Dense(3)])
    return tf.reduce_sum(tf.tanh(net(x)) ** 2, axis=1), net.trainable_weights


def _weight(shape, name):
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    return tf.compat.v1.get_variable(name, shape,
                                     initializer=tf.compat.v1.random_normal_initializer())


def softplus_closure(x):
    """A tf.custom_gradient whose backward reads a forward tensor it captured
    (sigmoid of its input), then a weight behind it."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    @tf.custom_gradient
    def softplus(h):
        s = tf.sigmoid(h)
        return tf.math.softplus(h), lambda dy: dy * s

    W, V = _weight([5, 6], "W"), _weight([6, 2], "V")
    return tf.reduce_sum(tf.matmul(softplus(tf.matmul(x, W)), V) ** 2, axis=1), [W, V]


def centring_custom_gradient(x):
    """A tf.custom_gradient whose backward centres dy over the batch and scales it by
    the captured input: it mixes the examples, each tower's copy mixes its own only."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    @tf.custom_gradient
    def centred(h):
        return tf.tanh(h), lambda dy: (dy - tf.reduce_mean(dy, 0, keepdims=True) + dy) * h

    W, V = _weight([5, 6], "W"), _weight([6, 2], "V")
    return tf.reduce_sum(tf.matmul(centred(tf.matmul(x, W)), V) ** 2, axis=1), [W, V]


def _register_centring_gradient():
    """A registered gradient (for gradient_override_map) that reads its op's input and
    centres dy over the batch; registered once per process."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    name = "PertowerTestCentredTanh"
    try:
        tf.RegisterGradient(name)(
            lambda op, dy: (dy - tf.reduce_mean(dy, 0, keepdims=True) + dy)
            * (1.0 - tf.tanh(op.inputs[0]) ** 2))
    except KeyError:   # already registered in this process
        pass
    return name


def centring_override_map(x):
    """gradient_override_map on Tanh with a backward that centres dy over the batch."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    name = _register_centring_gradient()
    W, V = _weight([5, 6], "W"), _weight([6, 2], "V")
    with tf.compat.v1.get_default_graph().gradient_override_map({"Tanh": name}):
        h = tf.tanh(tf.matmul(x, W))
    return tf.reduce_sum(tf.matmul(h, V) ** 2, axis=1), [W, V]


def custom_gradient_with_variables(x):
    """A tf.custom_gradient that reads a variable V and returns its gradient through
    `variables` (h^T dy: a sum over the examples it is given)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    W, V = _weight([5, 6], "W"), _weight([6, 2], "V")

    @tf.custom_gradient
    def linear(h):
        def grad(dy, variables):
            return (tf.matmul(dy, V, transpose_b=True),
                    [tf.matmul(h, dy, transpose_a=True) for _ in variables])
        return tf.matmul(h, V), grad

    return tf.reduce_sum(tf.tanh(linear(tf.tanh(tf.matmul(x, W)))) ** 2, axis=1), [W, V]


PYTHON_GRADIENT_MODELS = {
    "custom_gradient_with_variables": (custom_gradient_with_variables, [5]),
    "keras_swish_mlp": (keras_swish_mlp, [5]),
    "softplus_closure": (softplus_closure, [5]),
    "centring_custom_gradient": (centring_custom_gradient, [5]),
    "centring_override_map": (centring_override_map, [5]),
}


# -- item 14: transposed convolutions -------------------------------------------------

def keras_conv2d_transpose(x):
    """tf_keras Conv2DTranspose (its output shape stacks tf.shape(x)[0]), SAME and
    stride 2, then VALID stride 1, then Dense."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import tf_keras as keras  # pylint: disable=import-outside-toplevel
    net = keras.Sequential([
        keras.layers.Conv2DTranspose(3, 3, strides=2, padding="same", activation="tanh"),
        keras.layers.Conv2DTranspose(2, 2, padding="valid"),
        keras.layers.Flatten(), keras.layers.Dense(2)])
    return tf.reduce_sum(net(x) ** 2, axis=1), net.trainable_weights


def nn_conv2d_transpose_mean(x):
    """tf.nn.conv2d_transpose with output_shape [tf.shape(x)[0], ...] and a cost
    divided by the batch size (the whole batch's B, as documented)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    F = _weight([3, 3, 4, 2], "F")
    n = tf.shape(x)[0]
    h = tf.nn.conv2d_transpose(x, F, tf.stack([n, 9, 9, 4]), strides=2, padding="SAME")
    cost = tf.reduce_sum(tf.sin(h), axis=[1, 2, 3])
    return cost / tf.cast(n, tf.float32), [F]


def keras_conv3d_and_1d_transpose(x):
    """tf_keras Conv1DTranspose (on [B, 5, 2]) and Conv3DTranspose (on [B, 5, 2, 1, 1]
    reshaped from it)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import tf_keras as keras  # pylint: disable=import-outside-toplevel
    one_d = keras.layers.Conv1DTranspose(3, 2, strides=2)
    three_d = keras.layers.Conv3DTranspose(2, 2, strides=(1, 2, 1))
    h = one_d(tf.reshape(x, [-1, 5, 2]))
    g = three_d(tf.reshape(x, [-1, 5, 2, 1, 1]))
    ys = tf.reduce_sum(tf.tanh(h) ** 2, axis=[1, 2]) + tf.reduce_sum(g, axis=[1, 2, 3, 4])
    return ys, one_d.trainable_weights + three_d.trainable_weights


TRANSPOSED_CONV_MODELS = {
    "keras_conv2d_transpose": (keras_conv2d_transpose, [5, 5, 2]),
    "keras_conv3d_and_1d_transpose": (keras_conv3d_and_1d_transpose, [10]),
}
# cost / B: compared with the rows of the whole batch, whose B it divides by
WHOLE_BATCH_MODELS = {
    "nn_conv2d_transpose_mean": (nn_conv2d_transpose_mean, [5, 5, 2]),
}


def _check(name, body, shape, kind, whole_batch=False):
    def check():
        compare_with_loop(build(body, shape), kind=kind, whole_batch=whole_batch)
    check.__name__ = f"check_{name}_matches_the_loop"
    return check


CHECKS = ([_check(n, b, s, "default") for n, (b, s) in PYTHON_GRADIENT_MODELS.items()]
          + [_check(n, b, s, "deep") for n, (b, s) in TRANSPOSED_CONV_MODELS.items()]
          + [_check(n, b, s, "deep", True) for n, (b, s) in WHOLE_BATCH_MODELS.items()])

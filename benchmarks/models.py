"""The built-in models of `pertower demo` and the benchmarks (`python -m benchmarks`), defined once.

Notation:
    B   examples in the batch       P   weights (scalars over all trainable weights)
    A   a dense layer's input [B, i]    Z its pre-activation [B, j]

    mlp   MLP 100-256-256-1 (ReLU), cost (net(x) - y) ** 2, [B, 1]
    cnn   the scenario-3 CNN: Conv2D(16, 5, same, elu) -> Flatten -> Dense(128, relu)
          -> Dense(1) on [None, 32, 32, 1]; bench: cost (model(x) - t) ** 2, [B, 1]
    cifar a CIFAR-style conv net on [None, 32, 32, 3]: Conv2D(32, 3, same, relu) ->
          AveragePooling2D(2) -> Conv2D(64, 3, same, relu) -> AveragePooling2D(2) ->
          Conv2D(64, 3, same, relu) -> GlobalAveragePooling2D -> Dense(10); cost the
          sparse softmax cross-entropy of each example's logits [B, 10] with its
          label, [B]

Importing this module does not import TensorFlow (the command-line parser reads
`MODEL_NAMES` from it); the builders import it when called, in graph mode.
"""

import dataclasses

__all__ = ["MODEL_NAMES", "MLP_WIDTHS", "CNN_INPUT_SHAPE", "CIFAR_INPUT_SHAPE",
           "CIFAR_CLASSES", "BuiltModel", "cnn_keras_model", "cifar_keras_model",
           "build_mlp", "build_cnn", "build_cifar", "build", "split_feed"]

MODEL_NAMES = ("mlp", "cnn", "cifar")
# MLP input width, then the width of each Dense layer.
MLP_WIDTHS = (100, 256, 256, 1)
CNN_INPUT_SHAPE = (32, 32, 1)
CIFAR_INPUT_SHAPE = (32, 32, 3)
CIFAR_CLASSES = 10


@dataclasses.dataclass
class BuiltModel:
    """A model built in the default graph, with its per-example cost and a batch.

    Attributes:
      name: one of MODEL_NAMES.
      description: one line naming the layers and the cost.
      ys: the per-example cost, [B, 1] ([B] for cifar).
      weights: the trainable weights, in model order.
      feed: placeholder -> [B, ...] float32 values.
      dense_taps: (A [B, i], Z [B, j], kernel, bias) per Dense layer (MLP only, for the
        hand-written outer products), else None.
    """

    name: str
    description: str
    ys: object
    weights: list
    feed: dict
    dense_taps: list = None

    @property
    def num_weights(self):
        """P: the scalars over all weights."""
        total = 0
        for w in self.weights:
            size = 1
            for d in w.shape.as_list():
                size *= d
            total += size
        return total


def cnn_keras_model():
    """The scenario-3 CNN of `pertower demo` (defined there), [None, 32, 32, 1] -> [None, 1]."""
    from pertower.tools import demo  # pylint: disable=import-outside-toplevel

    return demo.cnn_keras_model()


def build_mlp(B, rng):
    """MLP 100-256-256-1 (ReLU), cost (net(x) - y) ** 2, [B, 1]. Each Dense is applied
    without activation so its pre-activation Z is a tensor hand-written methods use."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import tf_keras as keras  # pylint: disable=import-outside-toplevel

    n_in = MLP_WIDTHS[0]
    x = tf.compat.v1.placeholder(tf.float32, [None, n_in], name="x")
    y = tf.compat.v1.placeholder(tf.float32, [None, 1], name="y")
    layers = [keras.layers.Dense(width) for width in MLP_WIDTHS[1:]]
    A, taps = x, []
    for k, layer in enumerate(layers):
        Z = layer(A)                                        # [B, j]
        taps.append((A, Z, layer.kernel, layer.bias))
        A = tf.nn.relu(Z) if k + 1 < len(layers) else Z
    cost = (A - y) ** 2                                     # [B, 1]
    weights = [w for layer in layers for w in (layer.kernel, layer.bias)]
    feed = {x: rng.normal(size=(B, n_in)).astype("float32"),
            y: rng.normal(size=(B, 1)).astype("float32")}
    widths = "-".join(map(str, MLP_WIDTHS))
    return BuiltModel("mlp", f"MLP {widths} (ReLU), cost (net(x) - y)**2", cost, weights,
                      feed, taps)


def build_cnn(B, rng):
    """The scenario-3 CNN on [B, 32, 32, 1] images, cost (model(x) - t) ** 2, [B, 1]."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    x = tf.compat.v1.placeholder(tf.float32, [None, *CNN_INPUT_SHAPE], name="images")
    t = tf.compat.v1.placeholder(tf.float32, [None, 1], name="targets")
    model = cnn_keras_model()
    cost = (model(x) - t) ** 2                              # [B, 1]
    feed = {x: rng.normal(size=(B, *CNN_INPUT_SHAPE)).astype("float32"),
            t: rng.normal(size=(B, 1)).astype("float32")}
    return BuiltModel("cnn", "CNN Conv2D(16,5,same,elu)-Flatten-Dense(128,relu)-Dense(1) "
                      "on 32x32x1, cost (model(x) - t)**2", cost,
                      list(model.trainable_weights), feed)


def cifar_keras_model():
    """The CIFAR-style conv net as a Keras 2 Sequential, [None, 32, 32, 3] -> logits
    [None, 10]: three 3x3 SAME ReLU convolutions (32, 64, 64 filters) with 2x2 average
    pooling after the first two, global average pooling, Dense(10)."""
    import tf_keras as keras  # pylint: disable=import-outside-toplevel

    return keras.Sequential([
        keras.layers.Conv2D(32, 3, padding="same", activation="relu",
                            input_shape=CIFAR_INPUT_SHAPE),           # [B, 32, 32, 32]
        keras.layers.AveragePooling2D(2),                             # [B, 16, 16, 32]
        keras.layers.Conv2D(64, 3, padding="same", activation="relu"),  # [B, 16, 16, 64]
        keras.layers.AveragePooling2D(2),                             # [B, 8, 8, 64]
        keras.layers.Conv2D(64, 3, padding="same", activation="relu"),  # [B, 8, 8, 64]
        keras.layers.GlobalAveragePooling2D(),                        # [B, 64]
        keras.layers.Dense(CIFAR_CLASSES),                            # [B, 10]
    ])


def build_cifar(B, rng):
    """The CIFAR-style conv net on [B, 32, 32, 3] images, cost the sparse softmax
    cross-entropy of each example, [B]."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    x = tf.compat.v1.placeholder(tf.float32, [None, *CIFAR_INPUT_SHAPE], name="images")
    labels = tf.compat.v1.placeholder(tf.int32, [None], name="labels")
    model = cifar_keras_model()
    cost = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels,
                                                          logits=model(x))   # [B]
    feed = {x: rng.normal(size=(B, *CIFAR_INPUT_SHAPE)).astype("float32"),
            labels: rng.integers(0, CIFAR_CLASSES, size=B).astype("int32")}
    return BuiltModel("cifar", "CIFAR conv net 32x32x3: Conv(32,3,same,relu)-AvgPool2-"
                      "Conv(64,3,same,relu)-AvgPool2-Conv(64,3,same,relu)-GlobalAvgPool-"
                      "Dense(10), sparse softmax cross-entropy", cost,
                      list(model.trainable_weights), feed)


_BUILDERS = {"mlp": build_mlp, "cnn": build_cnn, "cifar": build_cifar}


def build(name, B, rng):
    """Builds model `name` (from MODEL_NAMES) in the default graph for B examples."""
    if name not in _BUILDERS:
        raise ValueError(f"benchmarks.models: unknown model {name!r}; choose from "
                         f"{', '.join(MODEL_NAMES)}.")
    return _BUILDERS[name](B, rng)


def split_feed(feed):
    """(inputs placeholder, targets placeholder) of a built model's two-entry feed: the
    inputs are the value of the highest rank."""
    keys = sorted(feed, key=lambda k: feed[k].ndim, reverse=True)
    if len(keys) != 2:
        raise ValueError(f"benchmarks.models: expected a feed of inputs and targets, "
                         f"got {len(keys)} entries")
    return keys[0], keys[1]

"""The zoo: real networks, built by name in the current graph at small inputs.

Notation:
    B   examples in the batch       T   time steps of a sequence
    V   vocabulary of the language models

Every network is built with `weights=None` (random weights), called in inference mode
(`training=False`), and given a per-example loss `[B]`: the sparse softmax
cross-entropy of its logits with a label (the language models: the mean over the T
steps of each example's next-token cross-entropy). Its batch placeholder has a None
batch dimension, so one graph serves every B.

    resnet50 mobilenet mobilenet_v2 densenet121 efficientnet_b0 vgg16
                         tf_keras.applications on [B, 32, 32, 3], 10 classes
                         (MobileNet alpha 0.25, MobileNetV2 alpha 0.35)
    inception_v3         tf_keras.applications on [B, 75, 75, 3] (its smallest input)
    xception             tf_keras.applications on [B, 71, 71, 3] (its smallest input)
    layers_cnn           the old idiom: tf.compat.v1.layers conv2d, batch_normalization
                         (training=False), max_pooling2d, dense, dropout (training=False)
                         on [B, 28, 28, 1], 10 classes
    ptb_lstm             a PTB-style language model: Embedding(V=1000, 128) ->
                         tf_keras LSTM(128) -> Dense(V) on [B, T=20] token ids
    dynamic_rnn_lstm     the same with a v1 `tf.compat.v1.nn.dynamic_rnn` over an
                         LSTMCell(128) and get_variable weights

`build(name, seed=None)` returns a `ZooNetwork` (loss, batch placeholder, feeds maker, weights);
`ZOO` lists the names, `CONVOLUTIONAL` those of convolutional networks, `FAST` the
small ones the default test run uses. Importing this module does not import
TensorFlow (the command-line parser reads `ZOO`).

Seeds: tf_keras' initializers given no seed (every application's, and ptb_lstm's) do not
follow the graph's seed (`tf.compat.v1.set_random_seed`): each draws a seed of its own
when it is built, from the generator `tf_keras.utils.set_random_seed` installs if it was
called, else from Python's `random`, and is then stateless (every run of the initializer
gives the same values). So unless something seeded those, every process gets other
weights, and a result seen at one process' weights cannot be reproduced in another.
`build(name, seed=S)` seeds both for the build and puts them back afterwards; the v1
idioms (layers_cnn, dynamic_rnn_lstm) follow the graph's seed.
"""

import contextlib
import dataclasses
import random
import warnings

__all__ = ["ZOO", "APPLICATIONS", "CONVOLUTIONAL", "RECURRENT", "FAST", "ZooNetwork",
           "build", "randomize_batch_norm_statistics"]

NUM_CLASSES = 10
VOCABULARY = 1000
STEPS = 20
HIDDEN = 128

# name -> (tf_keras.applications class, input side, keyword arguments)
APPLICATIONS = {
    "resnet50": ("ResNet50", 32, {}),
    "mobilenet": ("MobileNet", 32, {"alpha": 0.25}),
    "mobilenet_v2": ("MobileNetV2", 32, {"alpha": 0.35}),
    "densenet121": ("DenseNet121", 32, {}),
    "efficientnet_b0": ("EfficientNetB0", 32, {}),
    "inception_v3": ("InceptionV3", 75, {}),
    "xception": ("Xception", 71, {}),
    "vgg16": ("VGG16", 32, {}),
}
RECURRENT = ("ptb_lstm", "dynamic_rnn_lstm")
CONVOLUTIONAL = tuple(APPLICATIONS) + ("layers_cnn",)
ZOO = CONVOLUTIONAL + RECURRENT
# Small enough for the default test run (a few seconds at B=2).
FAST = ("layers_cnn",)


@dataclasses.dataclass
class ZooNetwork:
    """A zoo network built in the default graph.

    Attributes:
      name: its name in ZOO.
      description: one line: the network, its input and its loss.
      loss: the per-example loss, [B] float32.
      batch: the batch placeholder, [None, ...] (images or token ids).
      make_feed: make_feed(B, rng) -> {placeholder: value} with B examples (the batch
        and the labels), rng a `numpy.random.Generator`.
      weights: the trainable weights, in model order.
      labels: the labels placeholder, [None] or [None, T] int32.
      model: the Keras model, or None (layers_cnn, dynamic_rnn_lstm).

    `loss, batch, make_feed, weights = network` unpacks the four a user needs.
    """

    name: str
    description: str
    loss: object
    batch: object
    make_feed: object
    weights: list
    labels: object = None
    model: object = None

    def __iter__(self):
        return iter((self.loss, self.batch, self.make_feed, self.weights))

    @property
    def num_weights(self):
        """P: the scalars over all weights."""
        return sum(int(w.shape.num_elements()) for w in self.weights)


def _image_feed(batch, labels, side, channels):
    """make_feed for images in [0, 1) [B, side, side, channels] and labels [B]."""
    def make_feed(B, rng):
        return {batch: rng.random((B, side, side, channels), dtype="float32"),
                labels: rng.integers(0, NUM_CLASSES, size=B).astype("int32")}
    return make_feed


def _cross_entropy(labels, logits):
    """[B] (or [B, T]): sparse softmax cross-entropy of logits [B, (T,) C]."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)


def _application(name):
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import tf_keras as keras  # pylint: disable=import-outside-toplevel

    class_name, side, kwargs = APPLICATIONS[name]
    images = tf.compat.v1.placeholder(tf.float32, [None, side, side, 3], name="images")
    labels = tf.compat.v1.placeholder(tf.int32, [None], name="labels")
    model = getattr(keras.applications, class_name)(
        weights=None, input_shape=(side, side, 3), classes=NUM_CLASSES,
        classifier_activation=None, **kwargs)
    loss = _cross_entropy(labels, model(images, training=False))          # [B]
    options = "".join(f", {k}={v}" for k, v in kwargs.items())
    return ZooNetwork(name, f"tf_keras.applications.{class_name}(weights=None{options}) "
                      f"on {side}x{side}x3, inference mode, softmax cross-entropy",
                      loss, images, _image_feed(images, labels, side, 3),
                      list(model.trainable_weights), labels, model)


def _layers_cnn(name):
    """conv(32,5)-BN-relu-maxpool-conv(64,5)-relu-maxpool-flatten-dense(128)-dropout-dense(10)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    layers = tf.compat.v1.layers
    images = tf.compat.v1.placeholder(tf.float32, [None, 28, 28, 1], name="images")
    labels = tf.compat.v1.placeholder(tf.int32, [None], name="labels")
    with tf.compat.v1.variable_scope("layers_cnn"):
        h = layers.conv2d(images, 32, 5, padding="same", name="conv1")    # [B, 28, 28, 32]
        h = layers.batch_normalization(h, training=False, name="bn1")
        h = layers.max_pooling2d(tf.nn.relu(h), 2, 2)                      # [B, 14, 14, 32]
        h = layers.conv2d(h, 64, 5, padding="same", activation=tf.nn.relu,
                          name="conv2")                                    # [B, 14, 14, 64]
        h = layers.max_pooling2d(h, 2, 2)                                  # [B, 7, 7, 64]
        h = layers.dense(layers.flatten(h), 128, activation=tf.nn.relu, name="fc1")
        h = layers.dropout(h, 0.4, training=False)
        logits = layers.dense(h, NUM_CLASSES, name="logits")               # [B, 10]
        weights = tf.compat.v1.trainable_variables(scope="layers_cnn")
    return ZooNetwork(name, "tf.compat.v1.layers CNN conv(32,5)-BN-pool-conv(64,5)-pool-"
                      "dense(128)-dropout-dense(10) on 28x28x1, inference mode, softmax "
                      "cross-entropy", _cross_entropy(labels, logits), images,
                      _image_feed(images, labels, 28, 1), weights, labels)


def _token_feed(tokens, labels):
    """make_feed for token ids [B, T] and next tokens [B, T]."""
    def make_feed(B, rng):
        ids = rng.integers(0, VOCABULARY, size=(B, STEPS + 1)).astype("int32")
        return {tokens: ids[:, :-1], labels: ids[:, 1:]}
    return make_feed


def _ptb_lstm(name):
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import tf_keras as keras  # pylint: disable=import-outside-toplevel

    tokens = tf.compat.v1.placeholder(tf.int32, [None, STEPS], name="tokens")
    labels = tf.compat.v1.placeholder(tf.int32, [None, STEPS], name="next_tokens")
    model = keras.Sequential([
        keras.layers.Embedding(VOCABULARY, HIDDEN, input_length=STEPS),
        keras.layers.LSTM(HIDDEN, return_sequences=True),
        keras.layers.Dense(VOCABULARY),
    ])
    logits = model(tokens, training=False)                                 # [B, T, V]
    loss = tf.reduce_mean(_cross_entropy(labels, logits), axis=1)          # [B]
    return ZooNetwork(name, f"PTB-style LM: Embedding({VOCABULARY},{HIDDEN})-tf_keras "
                      f"LSTM({HIDDEN})-Dense({VOCABULARY}), T={STEPS}, mean next-token "
                      "cross-entropy", loss, tokens, _token_feed(tokens, labels),
                      list(model.trainable_weights), labels, model)


def _dynamic_rnn_lstm(name):
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    tokens = tf.compat.v1.placeholder(tf.int32, [None, STEPS], name="tokens")
    labels = tf.compat.v1.placeholder(tf.int32, [None, STEPS], name="next_tokens")
    with tf.compat.v1.variable_scope("dynamic_rnn_lstm"):
        init = tf.compat.v1.glorot_uniform_initializer()
        embedding = tf.compat.v1.get_variable("embedding", [VOCABULARY, HIDDEN],
                                              initializer=init)
        inputs = tf.nn.embedding_lookup(embedding, tokens)                 # [B, T, H]
        cell = tf.compat.v1.nn.rnn_cell.LSTMCell(HIDDEN, name="lstm_cell")
        outputs, _ = tf.compat.v1.nn.dynamic_rnn(cell, inputs, dtype=tf.float32)
        kernel = tf.compat.v1.get_variable("softmax_w", [HIDDEN, VOCABULARY],
                                           initializer=init)
        bias = tf.compat.v1.get_variable("softmax_b", [VOCABULARY],
                                         initializer=tf.compat.v1.zeros_initializer())
        logits = tf.tensordot(outputs, kernel, 1) + bias                   # [B, T, V]
        weights = tf.compat.v1.trainable_variables(scope="dynamic_rnn_lstm")
    loss = tf.reduce_mean(_cross_entropy(labels, logits), axis=1)          # [B]
    return ZooNetwork(name, f"PTB-style LM: embedding-v1 dynamic_rnn(LSTMCell({HIDDEN}))-"
                      f"softmax({VOCABULARY}), T={STEPS}, mean next-token cross-entropy",
                      loss, tokens, _token_feed(tokens, labels), weights, labels)


def build(name, seed=None):
    """Builds the zoo network `name` in the default graph (graph mode).

    Args:
      name: one of ZOO.
      seed: an int: the seed of tf_keras' unseeded initializers (`_keras_seed`), so the
        same `seed` gives the same initial weights in every process; None: they draw
        as tf_keras makes them (from `tf_keras.utils.set_random_seed`'s generator, else
        from Python's `random`). The v1 idioms' initializers follow the graph's seed
        (`tf.compat.v1.set_random_seed`) either way.

    Returns:
      A `ZooNetwork`: `loss` [B], `batch` (placeholder, None batch dimension),
      `make_feed(B, rng)`, `weights`; its variables are not initialized.

    Example:
      with tf.Graph().as_default():
          loss, batch, make_feed, weights = zoo.build("mobilenet")
          print(pertower.explain(loss, weights))
    """
    if name not in ZOO:
        raise ValueError(f"benchmarks.zoo.build: `name` must be one of {', '.join(ZOO)}, "
                         f"but received {name!r}.")
    builder = _application if name in APPLICATIONS else {
        "layers_cnn": _layers_cnn, "ptb_lstm": _ptb_lstm,
        "dynamic_rnn_lstm": _dynamic_rnn_lstm}[name]
    seeding = contextlib.nullcontext() if seed is None else _keras_seed(seed)
    with seeding, warnings.catch_warnings():  # the v1 idioms' deprecation warnings, by design
        warnings.simplefilter("ignore", UserWarning)
        return builder(name)


@contextlib.contextmanager
def _keras_seed(seed):
    """Within the body, tf_keras' unseeded initializers draw their seeds from
    `random.Random(seed)`: Python's `random` is seeded with `seed`, and so is the
    generator `tf_keras.utils.set_random_seed` installs (tf_keras draws from it when it
    is set); both are put back as they were afterwards."""
    try:
        from tf_keras.src import backend  # pylint: disable=import-outside-toplevel
        holder = backend._SEED_GENERATOR  # pylint: disable=protected-access
    except (ImportError, AttributeError):  # another tf_keras: Python's random alone
        holder = None
    state, generator = random.getstate(), getattr(holder, "generator", None)
    random.seed(seed)
    if holder is not None:
        holder.generator = random.Random(seed)
    try:
        yield
    finally:
        random.setstate(state)
        if holder is not None:
            holder.generator = generator


def randomize_batch_norm_statistics(sess, graph, seed):
    """Assigns random moving means in [-0.3, 0.3] and moving variances in [0.5, 1.5] to
    every batch normalization variable of `graph` (inference mode normalizes with them:
    with their initial 0 and 1 a wrong x_hat could go unnoticed). Returns how many."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    rng = np.random.default_rng(seed)
    with graph.as_default():
        assignments = []
        for variable in tf.compat.v1.global_variables():
            if variable.name.split("/")[-1].startswith("moving_mean"):
                low, high = -0.3, 0.3
            elif variable.name.split("/")[-1].startswith("moving_variance"):
                low, high = 0.5, 1.5
            else:
                continue
            value = rng.uniform(low, high, variable.shape.as_list()).astype("float32")
            assignments.append(tf.compat.v1.assign(variable, value))
        if assignments:
            sess.run(tf.group(assignments))
    return len(assignments)

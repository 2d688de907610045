"""pertower.keras on published networks, as a new user trains them: `model.fit` under
`DPKerasSGDOptimizer` in graph mode (tf_keras' v1 training loop), against the
one-example loop.

Notation:
    B   examples in the batch (3)       C   the clip norm        lr   the learning rate

The networks: tf_keras.applications with weights=None on [B, 32, 32, 3], 10 classes
(MobileNet alpha 0.25, MobileNetV2 alpha 0.35, ResNet50, DenseNet121, EfficientNetB0; the zoo's,
benchmarks/zoo.py), a Transformer encoder block (Embedding, MultiHeadAttention,
LayerNormalization, a feed-forward block, mean over the T tokens) and an
Embedding + LSTM text classifier. Each is compiled with a Keras loss of the default
reduction or reduction NONE. One fit step of the B examples with noise 0 must move every
weight w to w - lr * mean_i clip_C(g_i), g_i the loop's gradient of example i's loss,
with every weight on the rules (`pertower.explain` of the per-example loss behind
`model.total_loss`: no towers, no batch_size).

Batch normalization in training mode couples the examples (refused: test below); the
networks with it run in inference mode, as a user fine-tuning them with DP does:
moving statistics of some other data (`calibrate_batch_norm`, so that the activations
neither vanish nor explode as with the initial 0 and 1), then
`tf_keras.Model(inputs, network(inputs, training=False))`.
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import pertower
import pertower.keras as dp_keras
from benchmarks import zoo
from pertower import oracle
from pertower._keras import loss as keras_loss
from tests import common

B, C, LR = 3, 0.05, 0.5
NONE = keras.losses.Reduction.NONE
APPLICATIONS = ("mobilenet", "mobilenet_v2", "resnet50", "densenet121", "efficientnet_b0")
NETWORKS = APPLICATIONS + ("transformer", "lstm")
HEAVY = [pytest.param(name, reduction, marks=pytest.mark.heavy)
         for name in NETWORKS for reduction in (NONE, "auto")
         if (name, reduction) != ("mobilenet", NONE)]


def _transformer(T=8, V=50, D=16):
    """Token ids [B, T] -> logits [B, 10]: one post-norm encoder block, mean over T."""
    ids = keras.Input((T,), dtype="int32")
    h = keras.layers.Embedding(V, D)(ids)                                  # [B, T, D]
    h = keras.layers.LayerNormalization()(h + keras.layers.MultiHeadAttention(2, 8)(h, h))
    f = keras.layers.Dense(D)(keras.layers.Dense(32, activation="relu")(h))
    h = keras.layers.LayerNormalization()(h + f)
    return keras.Model(ids, keras.layers.Dense(10)(keras.layers.GlobalAveragePooling1D()(h)))


def calibrate_batch_norm(model, images, run):
    """Sets each BatchNormalization layer's moving mean and variance (+ 0.01) to those
    of its input over `images` in training mode; `run` evaluates the layers' inputs
    (a session's run in graph mode, numpy in TF2)."""
    # (BatchNormalizationV1 under disable_v2_behavior: not a keras.layers.BatchNormalization)
    norms = [layer for layer in model.layers if hasattr(layer, "moving_variance")]
    inputs = run(keras.Model(model.inputs, [n.input for n in norms])(
        tf.constant(images), training=True))
    values = []
    for norm, a in zip(norms, inputs):
        axes = tuple(range(a.ndim - 1))                                    # all but channels
        values += [(norm.moving_mean, a.mean(axes)),
                   (norm.moving_variance, a.var(axes) + 0.01)]
    keras.backend.batch_set_value(values)


def network(name, run):
    """(model, x [B, ...], y [B]): the network `name` of NETWORKS, the applications in
    inference mode with calibrated statistics; weights seeded by the caller."""
    rng = np.random.RandomState(0)
    y = rng.randint(0, 10, B).astype("int32")
    if name == "transformer":
        return _transformer(), rng.randint(0, 50, (B, 8)).astype("int32"), y
    if name == "lstm":
        model = keras.Sequential([keras.layers.Embedding(50, 8, input_length=6),
                                  keras.layers.LSTM(8), keras.layers.Dense(10)])
        return model, rng.randint(0, 50, (B, 6)).astype("int32"), y
    class_name, side, kwargs = zoo.APPLICATIONS[name]
    base = getattr(keras.applications, class_name)(
        weights=None, input_shape=(side, side, 3), classes=10, classifier_activation=None,
        **kwargs)
    calibrate_batch_norm(base, rng.rand(16, side, side, 3).astype("float32"), run)
    inputs = keras.Input((side, side, 3))
    return (keras.Model(inputs, base(inputs, training=False)),
            rng.rand(B, side, side, 3).astype("float32"), y)


def expected_step(weights, gradients):
    """w - lr * mean_i clip_C(g_i) per weight, and the norms ||g_i||; gradients[k] is
    [B, *w_k.shape]."""
    norms, mean = common.loop_clipped_mean(gradients, C)
    return [w - LR * g for w, g in zip(weights, mean)], norms


def sparse_cross_entropy(reduction):
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                      reduction=reduction)


def _fit_one_step(name, reduction):
    with tf.Graph().as_default():
        common.seed_weights(0)
        model, x, y = network(name, keras.backend.batch_get_value)
        model.compile(optimizer=dp_keras.DPKerasSGDOptimizer(
            l2_norm_clip=C, noise_multiplier=0.0, learning_rate=LR),
            loss=sparse_cross_entropy(reduction))
        weights = model.trainable_weights
        plan = pertower.explain(keras_loss.split_loss(model.total_loss).per_example,
                                weights)
        assert not plan.fallback and plan.verdict == "independent", plan
        # the loop's reference on the same weights, with its own label placeholder
        labels = tf.compat.v1.placeholder(tf.int32, [None])
        per_example = sparse_cross_entropy(NONE)(labels, model.outputs[0])
        loop = oracle.SliceLoop(per_example, weights)   # (before a run: While's gradient)
        sess = tf.compat.v1.keras.backend.get_session()
        gradients = loop.run(sess, {model.inputs[0]: x, labels: y}, B)
        before = sess.run(weights)
        model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
        return before, sess.run(weights), gradients


@pytest.mark.parametrize("name, reduction", [("mobilenet", NONE)] + HEAVY)
def test_one_fit_step_on_a_published_network_is_the_loops_clipped_mean(name, reduction):
    before, after, gradients = _fit_one_step(name, reduction)
    want, norms = expected_step(before, gradients)
    assert np.min(norms) > C, norms                        # clipping acts on every example
    # the first and the last weight move (the activations reach both ends)
    assert np.any(after[0] != before[0]) and np.any(after[-1] != before[-1])
    common.assert_all_close(after, want, what=f"{name}: weights after one fit step",
                            kind="deep")


def batch_norm_model():
    """Conv2D -> BatchNormalization "bn" (training mode in fit) -> Dense, on [B, 6, 6, 2]."""
    return keras.Sequential([
        keras.layers.Conv2D(2, 3, input_shape=(6, 6, 2)),                 # [B, 4, 4, 2]
        keras.layers.BatchNormalization(name="bn"),
        keras.layers.Flatten(), keras.layers.Dense(3)])


BATCH_NORM_REFUSAL = ("DPKerasSGDOptimizer: the op 'bn/.*couples the examples of the "
                      "batch.*batch normalization in training mode.*training=False.*"
                      r"tf_keras.Model\(inputs, network\(inputs, training=False\)\)")


def test_batch_norm_in_training_mode_is_refused_naming_the_layer_and_the_fix():
    rng = np.random.RandomState(1)
    x, y = rng.randn(4, 6, 6, 2).astype("float32"), rng.randint(0, 3, 4)
    with tf.Graph().as_default():
        model = batch_norm_model()
        model.compile(optimizer=dp_keras.DPKerasSGDOptimizer(1.0, 0.0),
                      loss=sparse_cross_entropy("auto"))
        with pytest.raises(ValueError, match=BATCH_NORM_REFUSAL):
            model.fit(x, y, batch_size=4, epochs=1, verbose=0)

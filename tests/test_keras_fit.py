"""pertower.keras: tf_keras' `model.fit` with the DP optimizers, against the one-example
loop (graph mode, tf_keras' v1 training loop).

One fit step (the whole data as one batch, shuffle=False) with noise_multiplier=0 moves
each weight w to w - lr * mean_g clip_C(g_g), g_g the loop's gradient of example (or
microbatch) g's mean loss; the optimizers survive model.save / load_model.
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import pertower
import pertower.keras as dp_keras
from pertower import oracle
from tests import common

B, CLIP, LR = 6, 0.5, 0.1
NONE = keras.losses.Reduction.NONE


def _model(kind):
    if kind == "dense":
        layers = [keras.layers.Dense(4, activation="tanh", input_shape=(5,)),
                  keras.layers.Dense(3)]
    else:
        layers = [keras.layers.Conv2D(2, 3, activation="relu", input_shape=(6, 6, 2)),
                  keras.layers.Flatten(), keras.layers.Dense(3)]
    return keras.Sequential(layers)


def _data(kind, rng):
    shape = (B, 5) if kind == "dense" else (B, 6, 6, 2)
    return rng.randn(*shape).astype(np.float32), rng.randint(0, 3, B)


def _flat_clipped_mean(means):
    return common.loop_clipped_mean(means, CLIP)[1]


def _per_layer_clipped_sum_over(divisor):
    """means -> sum_i clip_k(g_ik) / divisor per weight k, C_k = C / sqrt(K)."""
    def reference(means):
        clip = CLIP / np.sqrt(len(means))
        out = []
        for g in means:
            norms = np.sqrt(np.sum(g.reshape(len(g), -1) ** 2, axis=1))
            summed = np.tensordot(clip / np.maximum(norms, clip), g, axes=1)
            out.append((summed / divisor).astype(g.dtype))
        return out
    return reference


def _fit_one_step(kind, num_microbatches=None, accumulation_steps=1,
                  reference=_flat_clipped_mean, **options):
    """(weights before, weights after one fit step, `reference` of the loop's gradients
    of each microbatch's mean loss); checks `get_gradients` on the way."""
    rng = np.random.RandomState(0)
    with tf.Graph().as_default():
        common.seed_weights(0)
        model = _model(kind)
        optimizer = dp_keras.DPKerasSGDOptimizer(
            l2_norm_clip=CLIP, noise_multiplier=0.0, num_microbatches=num_microbatches,
            gradient_accumulation_steps=accumulation_steps, learning_rate=LR, **options)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=NONE)
        model.compile(optimizer=optimizer, loss=loss)
        x, y = _data(kind, rng)
        # the loop's reference on the same weights: its own label placeholder
        labels = tf.compat.v1.placeholder(tf.int32, [None])
        per_example = loss(labels, model.outputs[0])
        sess = tf.compat.v1.keras.backend.get_session()
        before = model.get_weights()
        feed = {model.inputs[0]: x, labels: y}
        M = B if num_microbatches is None else num_microbatches
        sums = oracle.loop_microbatch_gradients(sess, per_example, model.trainable_weights,
                                                feed, M)
        want = reference([g / (B // M) for g in sums])   # microbatch m's mean loss
        # get_gradients (TensorFlow Privacy's graph-mode entry) gives the same
        if accumulation_steps == 1:
            got = sess.run(optimizer.get_gradients(per_example, model.trainable_weights),
                           feed)
            common.assert_all_close(got, want, what="get_gradients", kind="deep")
        # k runs of B / k examples make one step
        model.fit(x, y, batch_size=B // accumulation_steps, epochs=1, shuffle=False,
                  verbose=0)
        return before, model.get_weights(), want


@pytest.mark.parametrize("kind, num_microbatches, accumulation_steps, options", [
    ("dense", None, 1, {}), ("conv", None, 1, {}), ("dense", 2, 1, {}), ("dense", 3, 1, {}),
    ("dense", None, 2, {}), ("conv", None, 3, {}),
    ("conv", None, 1, dict(clipping="per_layer", reference=_per_layer_clipped_sum_over(B))),
    ("dense", None, 2, dict(expected_batch_size=B + 2, clipping="per_layer",
                            reference=_per_layer_clipped_sum_over(B + 2)))])
def test_one_fit_step_is_sgd_on_the_loops_clipped_mean(kind, num_microbatches,
                                                       accumulation_steps, options):
    before, after, update = _fit_one_step(kind, num_microbatches, accumulation_steps,
                                          **options)
    assert any(np.any(g != 0) for g in update)
    common.assert_all_close(after, [w - LR * g for w, g in zip(before, update)],
                            what="weights after one fit step", kind="deep")


def test_keras_targets_are_proven_on_the_rules():
    # Keras' target placeholder is [None, None]; the cross-entropy's reshape keeps the
    # rows of the examples (no towers, no batch_size needed)
    with tf.Graph().as_default():
        model = _model("conv")
        model.compile(optimizer=dp_keras.DPKerasSGDOptimizer(1.0, 1.0),
                      loss=keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True, reduction=NONE))
        plan = pertower.explain(model.total_loss, model.trainable_weights)
        assert not plan.fallback, plan


@pytest.mark.parametrize("cls, options", [
    (dp_keras.DPKerasSGDOptimizer, dict(num_microbatches=2)),
    (dp_keras.DPKerasAdamOptimizer, dict(gradient_accumulation_steps=2, seed=3)),
    (dp_keras.DPKerasAdagradOptimizer, dict(clipping="per_layer", l2_norm_clip=[0.3, 0.4, 0.5,
                                                                            0.6])),
    (dp_keras.DPKerasSGDOptimizer, dict(
        expected_batch_size=6.0, adaptive_clipping=pertower.AdaptiveClipping(0.4, 0.3, 1.0)))])
def test_save_and_load_round_trip_and_evaluate_predict_run(cls, options, tmp_path):
    rng = np.random.RandomState(1)
    x, y = _data("dense", rng)
    path = str(tmp_path / "model.h5")
    arguments = dict(l2_norm_clip=0.7, noise_multiplier=1.3, learning_rate=0.05)
    arguments.update(options)
    with tf.Graph().as_default():
        common.seed_weights(1)
        model = _model("dense")
        model.compile(optimizer=cls(**arguments), loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=NONE))
        model.fit(x, y, batch_size=B, epochs=2, verbose=0)
        assert np.all(np.isfinite(model.evaluate(x, y, batch_size=B, verbose=0)))
        assert model.predict(x, verbose=0).shape == (B, 3)
        weights = model.get_weights()
        model.save(path)
    with tf.Graph().as_default():
        loaded = keras.models.load_model(path, custom_objects={cls.__name__: cls})
        config = loaded.optimizer.get_config()
        assert type(loaded.optimizer) is cls
        assert config["learning_rate"] == pytest.approx(arguments.pop("learning_rate"))
        if "adaptive_clipping" in arguments:
            arguments["adaptive_clipping"] = dict(target_quantile=0.4, learning_rate=0.3,
                                                  count_stddev=1.0)
        assert {k: config[k] for k in arguments} == arguments
        for w, v in zip(weights, loaded.get_weights()):
            np.testing.assert_array_equal(w, v)
        loaded.fit(x, y, batch_size=B, epochs=2, verbose=0)   # trains on after loading
        assert any(np.any(w != v) for w, v in zip(weights, loaded.get_weights()))


def test_make_keras_optimizer_class_refuses_other_classes():
    with pytest.raises(TypeError, match="make_keras_optimizer_class: `cls` must be a "
                                        "subclass of tf_keras.optimizers.legacy.Optimizer"):
        dp_keras.make_keras_optimizer_class(tf.compat.v1.train.GradientDescentOptimizer)


def test_minimize_is_private():
    # (TF2's default mode, where fit traces train_step: tests/eager/test_keras_fit_tf2.py)
    # in graph mode minimize is DPOptimizer's: a scalar loss is refused, as there
    with tf.Graph().as_default():
        model = _model("dense")
        optimizer = dp_keras.DPKerasSGDOptimizer(1.0, 1.0)
        with pytest.raises(ValueError, match="DP needs one loss per example"):
            optimizer.minimize(tf.reduce_sum(model.outputs[0]), model.trainable_weights)

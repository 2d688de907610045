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
from pertower._keras import loss as keras_loss
from tests import common

B, CLIP, LR = 6, 0.5, 0.1
NONE = keras.losses.Reduction.NONE


def _model(kind, kernel_l2=None):
    if kind == "dense":
        regularizer = None if kernel_l2 is None else keras.regularizers.l2(kernel_l2)
        layers = [keras.layers.Dense(4, activation="tanh", input_shape=(5,),
                                     kernel_regularizer=regularizer),
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
                  reference=_flat_clipped_mean, reduction=NONE, kernel_l2=None, **options):
    """(weights before, weights after one fit step, `reference` of the loop's gradients
    of each microbatch's mean loss, plus the regularizer's 2 * kernel_l2 * W on the first
    kernel); checks `get_gradients` on the way. `reduction` is the compiled loss's."""
    rng = np.random.RandomState(0)
    with tf.Graph().as_default():
        common.seed_weights(0)
        model = _model(kind, kernel_l2)
        optimizer = dp_keras.DPKerasSGDOptimizer(
            l2_norm_clip=CLIP, noise_multiplier=0.0, num_microbatches=num_microbatches,
            gradient_accumulation_steps=accumulation_steps, learning_rate=LR, **options)
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=reduction))
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=NONE)
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
        if kernel_l2 is not None:   # d/dW of kernel_l2 * ||W||^2, outside clipping
            want = [want[0] + 2 * kernel_l2 * before[0]] + want[1:]
        # k runs of B / k examples make one step
        model.fit(x, y, batch_size=B // accumulation_steps, epochs=1, shuffle=False,
                  verbose=0)
        return before, model.get_weights(), want


@pytest.mark.parametrize("kind, num_microbatches, accumulation_steps, options", [
    ("dense", None, 1, {}), ("conv", None, 1, {}), ("dense", 2, 1, {}), ("dense", 3, 1, {}),
    ("dense", None, 2, {}), ("conv", None, 3, {}),
    ("conv", None, 1, dict(clipping="per_layer", reference=_per_layer_clipped_sum_over(B))),
    ("dense", None, 2, dict(expected_batch_size=B + 2, clipping="per_layer",
                            reference=_per_layer_clipped_sum_over(B + 2))),
    # Keras' default reduction (the scalar mean): the same step; a weight regularizer:
    # its gradient is added after clipping and noise
    ("dense", None, 1, dict(reduction="auto")),
    ("dense", None, 2, dict(reduction="auto", kernel_l2=0.3)),
    pytest.param("conv", 3, 1, dict(reduction="auto"), marks=pytest.mark.heavy),
    pytest.param("dense", None, 3, dict(reduction="sum_over_batch_size"),
                 marks=pytest.mark.heavy),
    pytest.param("dense", None, 1, dict(reduction="auto", kernel_l2=0.3),
                 marks=pytest.mark.heavy)])
def test_one_fit_step_is_sgd_on_the_loops_clipped_mean(kind, num_microbatches,
                                                       accumulation_steps, options):
    before, after, update = _fit_one_step(kind, num_microbatches, accumulation_steps,
                                          **options)
    assert any(np.any(g != 0) for g in update)
    common.assert_all_close(after, [w - LR * g for w, g in zip(before, update)],
                            what="weights after one fit step", kind="deep")


@pytest.mark.parametrize("reduction", [NONE, "auto"])
def test_keras_targets_are_proven_on_the_rules(reduction):
    # Keras' target placeholder is [None, None]; the cross-entropy's reshape keeps the
    # rows of the examples (no towers, no batch_size needed); the default reduction's
    # mean is read back into those per-example losses
    with tf.Graph().as_default():
        model = _model("conv")
        model.compile(optimizer=dp_keras.DPKerasSGDOptimizer(1.0, 1.0),
                      loss=keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True, reduction=reduction))
        per_example = keras_loss.split_loss(model.total_loss).per_example
        assert per_example.shape.rank == 1
        plan = pertower.explain(per_example, model.trainable_weights)
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
        with pytest.raises(ValueError, match="pertower.keras.DPKerasSGDOptimizer: .*DP "
                                             "needs one loss per example"):
            optimizer.minimize(tf.reduce_sum(model.outputs[0]), model.trainable_weights)


def test_default_reduction_gives_scalar_history_and_other_losses_are_refused():
    rng = np.random.RandomState(2)
    x, y = _data("dense", rng)
    with tf.Graph().as_default():
        model = _model("dense")
        model.compile(optimizer=dp_keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        # a last batch smaller than the others (4 + 2) is fine with a scalar loss
        history = model.fit(x, y, batch_size=4, epochs=2, verbose=0).history
        assert np.shape(history["loss"]) == (2,) and np.all(np.isfinite(history["loss"]))
        assert np.shape(model.evaluate(x, y, batch_size=B, verbose=0)) == ()
    refused = [
        (dict(reduction="sum"), "sums the examples' losses .*reduction SUM"),
        (dict(activity_regularizer="l2"), "reads the examples but is not a mean of "
                                          "per-example losses"),
        # Keras divides a masked output's loss by the batch's count of unmasked entries
        (dict(masking=True), "couples the examples of the batch")]
    for options, message in refused:
        with tf.Graph().as_default():
            layers = [keras.layers.Dense(3, input_shape=(5,),
                                         activity_regularizer=options.get(
                                             "activity_regularizer"))]
            if options.get("masking"):
                layers.insert(0, keras.layers.Masking(input_shape=(5,)))
            model = keras.Sequential(layers)
            model.compile(optimizer=dp_keras.DPKerasSGDOptimizer(1.0, 1.0),
                          loss=keras.losses.SparseCategoricalCrossentropy(
                              from_logits=True, reduction=options.get("reduction", "auto")))
            with pytest.raises(ValueError, match=message):
                model.fit(x, y, batch_size=B, epochs=1, verbose=0)


def _accumulating_model(adaptive):
    common.seed_weights(3)
    model = _model("dense")
    options = (dict(expected_batch_size=float(B),
                    adaptive_clipping=pertower.AdaptiveClipping(0.5, 0.5, 0.0))
               if adaptive else {})
    model.compile(optimizer=dp_keras.DPKerasSGDOptimizer(
        CLIP, 0.0, gradient_accumulation_steps=3, learning_rate=LR, **options),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("how, adaptive", [("h5", False), ("checkpoint", True)])
def test_save_mid_accumulation_resumes_the_logical_batch(how, adaptive, tmp_path):
    # 3 runs of 2 examples make one step: saving after 2 runs and loading, the 3rd run
    # applies the step of all 6 (the accumulator's sums and run counter, and adaptive
    # clipping's C, are the optimizer's weights); without them it would not move
    x, y = _data("dense", np.random.RandomState(3))
    fit = dict(batch_size=2, epochs=1, shuffle=False, verbose=0)
    with tf.Graph().as_default():
        model = _accumulating_model(adaptive)
        model.fit(x, y, **fit)
        uninterrupted = model.get_weights()
        clip = tf.compat.v1.keras.backend.get_value(model.optimizer._dp.l2_norm_clip_variable)
    with tf.Graph().as_default():
        model = _accumulating_model(adaptive)
        model.fit(x[:4], y[:4], **fit)
        path = str(tmp_path / "model")
        if how == "h5":
            model.save(path + ".h5")
        else:   # a tf.train checkpoint of the model, the optimizer in it
            model.save_weights(path, save_format="tf")
    with tf.Graph().as_default():
        if how == "h5":
            cls = dp_keras.DPKerasSGDOptimizer
            model = keras.models.load_model(path + ".h5", custom_objects={cls.__name__: cls})
        else:
            model = _accumulating_model(adaptive)
            model.load_weights(path)
        loaded = model.get_weights()
        model.fit(x[4:], y[4:], **fit)
        assert any(np.any(w != v) for w, v in zip(loaded, model.get_weights()))
        common.assert_all_close(model.get_weights(), uninterrupted,
                                what="weights after a save mid-accumulation", kind="deep")
        if adaptive:   # C moved once, at the step, from the restored value
            assert clip != CLIP
            np.testing.assert_allclose(tf.compat.v1.keras.backend.get_value(
                model.optimizer._dp.l2_norm_clip_variable), clip, rtol=1e-6)

"""TensorFlow Privacy 0.9.0's `privacy/optimizers/dp_optimizer_keras_test.py`, ported to
`pertower.keras` (our own tests of the same claims; graph mode, tf_keras' v1 loop).

Ported (TFP test -> here):
- DPOptimizerComputeGradientsTest.testBaselineWithCallableLossNoNoise and
  testBaselineWithTensorLossNoNoise (eager, TFP's private `_compute_gradients` with a
  callable or a tape): the same losses and expected gradients through the public
  `get_gradients` in graph mode -> test_baseline_gradients_without_noise.
- testClippingNorm, testClippingNormMultipleVariables (1, 2, 4 microbatches) ->
  test_clipping_norm, test_clipping_norm_of_several_variables (numpy closed form).
- testNoiseMultiplier (ComputeGradients and GetGradients) -> test_noise_stddev: the
  stddev C * σ / M checked over 64 000 draws with a bound of 7 standard errors of the
  sample stddev (a false failure has probability < 1e-11), not TFP's ±0.5 on 1000.
- testKerasModelBaselineNoNoise (1, None) and GetGradientsTest.testBaselineNoNoise (the
  Estimator's linear regression, 1, 2, 4, None microbatches) ->
  test_linear_regression_learns (model.fit).
- GetGradientsTest.testClippingNorm (one clipped step = the unclipped one over its
  global norm) -> test_one_clipped_step_is_the_unclipped_one_over_its_norm.
- testKerasModelBaselineSaving, testKerasModelBaselineAfterSavingLoading (SavedModel,
  save_format="tf") -> test_saved_model_round_trip.
- testRaisesOnNoCallOfGetGradients (TFP: AssertionError) -> a RuntimeError that names
  the class, test_apply_gradients_before_computing_is_refused.
- testLargeBatchEmulationNoNoise, testLargeBatchEmulation (SGD 1, 2, 4; Adam 1;
  Adagrad 2) -> test_large_batch_emulation_without_noise,
  test_large_batch_emulation_updates_every_kth_run.
- Bad arguments (TFP checks them in its DP query): test_bad_arguments_are_refused.

Cases marked heavy (deselected by default: `-m heavy`) repeat a claim a default-run
case of the same test makes, with other classes or microbatch counts; the SavedModel
round trip is heavy (HDF5 and checkpoints: tests/test_keras_fit.py).

Not ported: the Vectorized* optimizers (dp_optimizer_keras_vectorized) and
DPFTRLTreeAggregationOptimizer (DPTreeAggregation*Test) are not part of pertower;
DPVectorizedOptimizerUnconnectedNodesTest is about the vectorized optimizers'
`unconnected_gradients_to_zero` (pertower gives an unreached weight pure noise and warns,
tests/test_dp.py). No case needs eager execution once TFP's `_compute_gradients` is read
as the public `get_gradients`; the Estimator cases run as `fit` (tf_estimator is gone
from TensorFlow 2.16 on).
"""

import math

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import pertower.keras as dp_keras
from tests import common

SGD, ADAM, ADAGRAD = (dp_keras.DPKerasSGDOptimizer, dp_keras.DPKerasAdamOptimizer,
                      dp_keras.DPKerasAdagradOptimizer)
DATA0 = np.array([[3.0, 4.0], [5.0, 6.0], [7.0, 8.0], [-1.0, 0.0]], np.float32)
DATA1 = np.array([[8.0], [2.0], [3.0], [1.0]], np.float32)


def _assert_close(got, want, what):
    """float32 results against float32 references (the float32 tolerances)."""
    common.assert_all_close(got, [np.asarray(w, np.float32) for w in want], what=what,
                            kind="tight")


def _loss(data, var):
    """[B]: 0.5 * ||data_i - var||^2, whose gradient in var is var - data_i."""
    return 0.5 * tf.reduce_sum(tf.math.squared_difference(data, var), axis=1)


def _gradients(cls, values, data, **arguments):
    """`get_gradients` of sum_k _loss(data_k, var_k), var_k starting at values[k]."""
    with tf.Graph().as_default():
        variables = [tf.Variable(np.array(v, np.float32)) for v in values]
        placeholders = [tf.compat.v1.placeholder(tf.float32, [None, d.shape[1]])
                        for d in data]
        loss = tf.add_n([_loss(p, v) for p, v in zip(placeholders, variables)])
        optimizer = cls(learning_rate=2.0, **arguments)
        gradients = optimizer.get_gradients(loss, variables)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            return sess.run(gradients, dict(zip(placeholders, data)))


@pytest.mark.parametrize("cls, num_microbatches", [
    (SGD, None), (ADAM, 2), pytest.param(SGD, 1, marks=pytest.mark.heavy), pytest.param(ADAGRAD, 4, marks=pytest.mark.heavy)])
def test_baseline_gradients_without_noise(cls, num_microbatches):
    # mean_i (var - data_i) for var0 = [1, 2], var1 = [3]
    got = _gradients(cls, [[1.0, 2.0], [3.0]], [DATA0, DATA1], l2_norm_clip=100.0,
                     noise_multiplier=0.0, num_microbatches=num_microbatches)
    _assert_close(got, [[-2.5, -2.5], [-0.5]], "gradients")


def test_clipping_norm():
    # one microbatch: the mean gradient (-4.5, -6) has norm 7.5, clipped to 1
    got = _gradients(SGD, [[0.0, 0.0]], [np.array([[3.0, 4.0], [6.0, 8.0]], np.float32)],
                     l2_norm_clip=1.0, noise_multiplier=0.0, num_microbatches=1)
    _assert_close(got, [[-0.6, -0.8]], "clipped gradient")


@pytest.mark.parametrize("num_microbatches", [
    2, pytest.param(1, marks=pytest.mark.heavy), pytest.param(4, marks=pytest.mark.heavy)])
def test_clipping_norm_of_several_variables(num_microbatches):
    data0 = np.array([[3.0, 6.0], [5.0, 6.0], [4.0, 8.0], [-1.0, 0.0]], np.float32)
    var0, var1, clip = np.array([1.0, 2.0]), np.array([3.0]), 2.5
    got = _gradients(SGD, [var0, var1], [data0, DATA1], l2_norm_clip=clip,
                     noise_multiplier=0.0, num_microbatches=num_microbatches)
    # each microbatch's mean gradient, one vector over both variables, clipped to 2.5
    per_example = np.concatenate([var0 - data0, var1 - DATA1], axis=1)       # [4, 3]
    means = per_example.reshape(num_microbatches, -1, 3).mean(axis=1)        # [M, 3]
    norms = np.linalg.norm(means, axis=1)
    want = (means * (clip / np.maximum(norms, clip))[:, None]).mean(axis=0)
    _assert_close(got, [want[:2], want[2:]], "clipped gradients")


@pytest.mark.parametrize("clip, sigma, num_microbatches", [
    (2.0, 4.0, 1), (8.0, 6.0, 8), pytest.param(4.0, 1.0, 4, marks=pytest.mark.heavy),
    pytest.param(3.0, 2.0, 4, marks=pytest.mark.heavy)])
def test_noise_stddev(clip, sigma, num_microbatches):
    # zero data and weights: the gradient is the noise alone, N(0, (C σ / M)^2) per entry
    # (16 examples, the noise divided by the M microbatches); 64 runs of 1000 entries
    draws, entries = 64, 1000
    with tf.Graph().as_default():
        var = tf.Variable(tf.zeros([entries]))
        data = tf.compat.v1.placeholder(tf.float32, [None, entries])
        optimizer = SGD(l2_norm_clip=clip, noise_multiplier=sigma,
                        num_microbatches=num_microbatches, seed=7, learning_rate=1.0)
        gradient, = optimizer.get_gradients(_loss(data, var), [var])
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            feed = {data: np.zeros([16, entries], np.float32)}
            noise = np.concatenate([sess.run(gradient, feed) for _ in range(draws)])
    n, want = noise.size, clip * sigma / num_microbatches
    # the sample stddev s of n normal draws: (s - σ) / σ ~ N(0, 1 / (2 n)); the mean
    # ~ N(0, σ^2 / n). 7 standard errors: a false failure has probability < 1e-11.
    assert abs(np.std(noise) / want - 1) < 7 / math.sqrt(2 * n), (np.std(noise), want)
    assert abs(np.mean(noise)) < 7 * want / math.sqrt(n), np.mean(noise)


def _linear_regression(num_microbatches, seed=0):
    """TFP's linear regression (y = x . [-5, 4, 3, 2] + 6, 1000 examples, batches of 8,
    one epoch, noise 0, clip 100): the fitted kernel and bias."""
    rng = np.random.RandomState(seed)
    x = rng.normal(scale=3.0, size=(1000, 4)).astype(np.float32)
    kernel, bias = np.array([[-5.0], [4.0], [3.0], [2.0]], np.float32), np.float32(6.0)
    with tf.Graph().as_default():
        model = keras.Sequential([keras.layers.Dense(
            1, input_shape=(4,), kernel_initializer="zeros", bias_initializer="zeros")])
        model.compile(optimizer=SGD(l2_norm_clip=100.0, noise_multiplier=0.0,
                                    num_microbatches=num_microbatches,
                                    learning_rate=0.05),
                      loss=keras.losses.MeanSquaredError(reduction="none"))
        model.fit(x, x @ kernel + bias, batch_size=8, epochs=1, shuffle=False, verbose=0)
        return model.get_weights(), (kernel, [bias])


@pytest.mark.parametrize("num_microbatches", [
    None, pytest.param(1, marks=pytest.mark.heavy), pytest.param(2, marks=pytest.mark.heavy),
    pytest.param(4, marks=pytest.mark.heavy)])
def test_linear_regression_learns(num_microbatches):
    got, want = _linear_regression(num_microbatches)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=0.05)


def test_one_clipped_step_is_the_unclipped_one_over_its_norm():
    # one example x = e_1, y = 6, weights 0, lr 1: the unclipped step is the gradient
    x, y = np.array([[1.0, 0.0, 0.0, 0.0]], np.float32), np.array([[6.0]], np.float32)
    steps = []
    for clip in (1e9, 1.0):
        with tf.Graph().as_default():
            model = keras.Sequential([keras.layers.Dense(
                1, input_shape=(4,), kernel_initializer="zeros", bias_initializer="zeros")])
            model.compile(optimizer=SGD(l2_norm_clip=clip, noise_multiplier=0.0,
                                        num_microbatches=1, learning_rate=1.0),
                          loss=keras.losses.MeanSquaredError(reduction="none"))
            model.fit(x, y, batch_size=1, epochs=1, verbose=0)
            steps.append(model.get_weights())
    norm = np.sqrt(sum(np.sum(w ** 2) for w in steps[0]))
    assert norm > 1
    _assert_close(steps[1], [w / norm for w in steps[0]], "clipped step")


@pytest.mark.heavy   # SavedModel's save; HDF5 and checkpoints: tests/test_keras_fit.py
def test_saved_model_round_trip(tmp_path):
    rng = np.random.RandomState(1)
    x = rng.normal(size=(16, 4)).astype(np.float32)
    y = x @ np.array([[-5.0], [4.0], [3.0], [2.0]], np.float32)
    path = str(tmp_path / "saved")
    with tf.Graph().as_default():
        model = keras.Sequential([keras.layers.Dense(1, input_shape=(4,), name="dense")])
        model.compile(optimizer=SGD(l2_norm_clip=100.0, noise_multiplier=0.0,
                                    learning_rate=0.05),
                      loss=keras.losses.MeanSquaredError(reduction="none"))
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        prediction = model.predict(x, verbose=0)
        model.save(path, save_format="tf")
        weights = model.get_weights()
        model.load_weights(path)      # TFP: load the weights back, fit on
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        assert any(np.any(w != v) for w, v in zip(weights, model.get_weights()))
    with tf.Graph().as_default():
        loaded = keras.models.load_model(path, custom_objects={SGD.__name__: SGD})
        np.testing.assert_allclose(loaded.predict(x, verbose=0), prediction, rtol=1e-6)


@pytest.mark.parametrize("cls", [SGD, ADAGRAD, ADAM])
def test_apply_gradients_before_computing_is_refused(cls):
    with tf.Graph().as_default():
        var = tf.Variable([0.0])
        optimizer = cls(l2_norm_clip=100.0, noise_multiplier=0.0, num_microbatches=1,
                        learning_rate=2.0)
        with pytest.raises(RuntimeError, match=f"pertower.keras.{cls.__name__}: call "
                                               "get_gradients or get_updates first"):
            optimizer.apply_gradients([(tf.constant([1.0]), var)])


def _emulation(cls, steps, xs):
    """var0 [1, 2], var1 [3] after each `minimize` run of sum over x's rows of
    var0 . x + var1 (d/dvar0 = x, d/dvar1 = 1), `steps` runs per noised step."""
    with tf.Graph().as_default():
        var0, var1 = tf.Variable([[1.0, 2.0]]), tf.Variable([3.0])
        x = tf.compat.v1.placeholder(tf.float32, [None, 2])
        loss = tf.reshape(tf.matmul(x, var0, transpose_b=True) + var1, [-1])   # [B]
        optimizer = cls(l2_norm_clip=100.0, noise_multiplier=0.0,
                        gradient_accumulation_steps=steps, learning_rate=1.0)
        train_op = optimizer.minimize(loss, [var0, var1])
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            values = []
            for batch in xs:
                sess.run(train_op, {x: batch})
                values.append(sess.run([var0, var1]))
            return values


def test_large_batch_emulation_without_noise():
    x1 = np.array([[2.0, 0.0], [0.0, 1.0]], np.float32)
    x2 = np.array([[4.0, 2.0], [2.0, 1.0]], np.float32)
    got = _emulation(SGD, 2, [x1, x2, x2, x2])
    # the step of runs 1-2 is the mean of their 4 examples' gradients, ((2, 1), 1)
    want = [([[1.0, 2.0]], [3.0]), ([[-1.0, 1.0]], [2.0]), ([[-1.0, 1.0]], [2.0]),
            ([[-4.0, -0.5]], [1.0])]
    for run, (g, w) in enumerate(zip(got, want)):
        _assert_close(g, w, f"variables after run {run + 1}")


@pytest.mark.parametrize("cls, steps", [
    (SGD, 4), pytest.param(SGD, 1, marks=pytest.mark.heavy), pytest.param(SGD, 2, marks=pytest.mark.heavy),
    pytest.param(ADAM, 1, marks=pytest.mark.heavy), pytest.param(ADAGRAD, 2, marks=pytest.mark.heavy)])
def test_large_batch_emulation_updates_every_kth_run(cls, steps):
    x = np.array([[2.0, 0.0], [0.0, 1.0]], np.float32)
    values = _emulation(cls, steps, [x] * steps)
    for run, (var0, var1) in enumerate(values[:-1]):
        np.testing.assert_array_equal(var0, [[1.0, 2.0]], err_msg=f"run {run + 1}")
        np.testing.assert_array_equal(var1, [3.0], err_msg=f"run {run + 1}")
    assert np.all(values[-1][0] != [[1.0, 2.0]]) and np.all(values[-1][1] != [3.0])


@pytest.mark.parametrize("arguments, error, message", [
    (dict(l2_norm_clip=-1.0), ValueError, "l2_norm_clip"),
    (dict(l2_norm_clip=0.0), ValueError, "l2_norm_clip"),
    (dict(noise_multiplier=-0.5), ValueError, "noise_multiplier"),
    (dict(num_microbatches=0), ValueError, "num_microbatches"),
    (dict(gradient_accumulation_steps=0), ValueError, "gradient_accumulation_steps"),
    (dict(clipping="global"), ValueError, "clipping")])
def test_bad_arguments_are_refused(arguments, error, message):
    options = dict(l2_norm_clip=1.0, noise_multiplier=1.0, learning_rate=0.1)
    options.update(arguments)
    with tf.Graph().as_default():
        with pytest.raises(error, match=f"pertower.keras.DPKerasSGDOptimizer: .*{message}"):
            SGD(**options)


def test_microbatches_that_do_not_divide_the_batch_are_refused_at_run_time():
    # TFP's tf.reshape fails; here a run-time check that names the class
    with tf.Graph().as_default():
        model = keras.Sequential([keras.layers.Dense(1, input_shape=(4,))])
        model.compile(optimizer=SGD(l2_norm_clip=1.0, noise_multiplier=1.0,
                                    num_microbatches=3, learning_rate=0.1),
                      loss=keras.losses.MeanSquaredError(reduction="none"))
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match="pertower.keras.DPKerasSGDOptimizer: `num_microbatches` "
                                 r"\(3\) must divide the batch size"):
            model.fit(np.zeros([4, 4], np.float32), np.zeros([4, 1], np.float32),
                      batch_size=4, verbose=0)

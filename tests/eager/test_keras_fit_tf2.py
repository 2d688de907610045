"""pertower in TensorFlow 2's default mode (eager execution on): tf_keras' `fit` traces
`train_step` into a `tf.function` and the DP optimizers build their step in that graph;
`pertower.per_example_gradients` works in a user's own `tf.function` (a `tf.while_loop`
there too, its weights on the rules).

The oracle is the one-example loop in eager mode: tf.GradientTape on each example's
loss (each microbatch's mean loss), clipped to norm C; one step with noise 0 is
w - lr * (sum_m clip_C(g_m)) / M.
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import pertower
import pertower.keras

LR = 0.5


def _sparse_ce():
    return tf_keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction=tf_keras.losses.Reduction.NONE)


def _dense_model():
    return tf_keras.Sequential([tf_keras.layers.Dense(5, activation="tanh", input_shape=(4,)),
                                tf_keras.layers.Dense(3)])


def _conv_model():
    return tf_keras.Sequential([
        tf_keras.layers.Conv2D(3, 3, activation="relu", input_shape=(6, 6, 2)),  # [B, 4, 4, 3]
        tf_keras.layers.Flatten(),                                               # [B, 48]
        tf_keras.layers.Dense(3)])                                               # [B, 3]


def _data(shape, n, seed=0):
    rng = np.random.RandomState(seed)
    return rng.randn(n, *shape).astype("float32"), rng.randint(0, 3, n).astype("int32")


def _loop_gradients(model, weights, x, y, groups):
    """Per group of examples (rows of x), the gradient of its mean loss at `weights`
    (one group per call of tf.GradientTape), each [*w.shape] per weight."""
    copy = tf_keras.models.clone_model(model)
    copy.set_weights(weights)
    mean_loss = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    found = []
    for rows in groups:
        with tf.GradientTape() as tape:
            loss = mean_loss(y[rows], copy(x[rows]))
        found.append([g.numpy() for g in tape.gradient(loss, copy.trainable_weights)])
    return found


def _clipped(gradients, C):
    norm = np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in gradients))
    return [g * min(1.0, C / norm) for g in gradients], norm


def _dp_step(model, weights, x, y, groups, C, divisor):
    """w - LR * sum_m clip_C(g_m) / divisor, and the norms ||g_m||."""
    clipped, norms = zip(*(_clipped(g, C) for g in _loop_gradients(model, weights, x, y,
                                                                    groups)))
    return [w - LR * sum(c[k] for c in clipped) / divisor
            for k, w in enumerate(weights)], norms


def _assert_weights(model, expected, atol=1e-5):
    worst = max(float(np.max(np.abs(w.numpy() - e)))
                for w, e in zip(model.trainable_weights, expected))
    assert worst < atol, f"weights differ from the loop's DP step by {worst}"


def _fit(model, optimizer, x, y, batch_size):
    model.compile(optimizer=optimizer, loss=_sparse_ce())
    weights = [w.numpy() for w in model.trainable_weights]
    history = model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    return weights, history


def test_eager_is_on():
    assert tf.executing_eagerly()


def test_fit_step_is_the_clipped_mean_of_the_loop():
    """B = 4, one step, noise 0: w - lr * mean_i clip_C(g_i), with C below some norms;
    history['loss'] is the mean loss at the starting weights (Keras averages in TF2)."""
    x, y = _data((4,), 4)
    model = _dense_model()
    optimizer = pertower.keras.DPKerasSGDOptimizer(l2_norm_clip=0.3, noise_multiplier=0.0,
                                                   learning_rate=LR)
    w0, history = _fit(model, optimizer, x, y, 4)
    expected, norms = _dp_step(model, w0, x, y, [[i] for i in range(4)], 0.3, 4)
    assert max(norms) > 0.3, norms   # clipping acts
    _assert_weights(model, expected)
    copy = tf_keras.models.clone_model(model)
    copy.set_weights(w0)
    mean = float(np.mean(_sparse_ce()(y, copy(x)).numpy()))
    np.testing.assert_allclose(history.history["loss"], [mean], rtol=1e-5)


def test_fit_conv_microbatches():
    """A conv net, B = 4 in M = 2 microbatches of 2: w - lr * mean_m clip_C(g_m)."""
    x, y = _data((6, 6, 2), 4, seed=1)
    model = _conv_model()
    optimizer = pertower.keras.DPKerasSGDOptimizer(l2_norm_clip=0.2, noise_multiplier=0.0,
                                                   num_microbatches=2, learning_rate=LR)
    w0, _ = _fit(model, optimizer, x, y, 4)
    expected, norms = _dp_step(model, w0, x, y, [[0, 1], [2, 3]], 0.2, 2)
    assert max(norms) > 0.2, norms
    _assert_weights(model, expected)


def test_fit_accumulation_with_a_smaller_last_batch_is_one_step_on_the_union():
    """6 examples in batches of 4 and 2 (the last one smaller: a retrace), k = 2
    accumulation steps: one step, w - lr * sum_i clip_C(g_i) / 6, from the
    accumulator made once outside the function."""
    x, y = _data((4,), 6, seed=2)
    model = _dense_model()
    optimizer = pertower.keras.DPKerasAdagradOptimizer(
        l2_norm_clip=0.3, noise_multiplier=0.0, gradient_accumulation_steps=2,
        learning_rate=LR, initial_accumulator_value=1.0, epsilon=0.0)
    w0, _ = _fit(model, optimizer, x, y, 4)
    clipped, _ = zip(*(_clipped(g, 0.3) for g in _loop_gradients(
        model, w0, x, y, [[i] for i in range(6)])))
    mean = [sum(c[k] for c in clipped) / 6 for k in range(len(w0))]
    # Adagrad from accumulator 1: w - lr * g / sqrt(1 + g^2)
    _assert_weights(model, [w - LR * g / np.sqrt(1.0 + g * g) for w, g in zip(w0, mean)])


def test_fit_adds_the_noise():
    """Noise σ = 1, C = 1, B = 4: the step minus the noiseless one is lr σ C / B times
    N(0, 1) draws; their sample stddev over the P = 1035 weights is within 12% (the
    estimate's relative error is about 1 / sqrt(2P) = 2.2%)."""
    x, y = _data((4,), 4, seed=3)
    model = tf_keras.Sequential([tf_keras.layers.Dense(64, activation="tanh",
                                                       input_shape=(4,)),
                                 tf_keras.layers.Dense(11)])
    optimizer = pertower.keras.DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0,
                                                   learning_rate=LR, seed=7)
    w0, _ = _fit(model, optimizer, x, y, 4)
    expected, _ = _dp_step(model, w0, x, y, [[i] for i in range(4)], 1.0, 4)
    noise = np.concatenate([(w.numpy() - e).ravel()
                            for w, e in zip(model.trainable_weights, expected)])
    assert noise.size == 1035
    assert abs(np.std(noise) / (LR * 1.0 * 1.0 / 4) - 1) < 0.12, np.std(noise)
    assert abs(np.mean(noise)) < 4 * LR / 4 / np.sqrt(noise.size)


def test_per_example_gradients_in_a_users_tf_function():
    """pertower.per_example_gradients and per_example_norms inside a user's own tf.function (not
    converted by AutoGraph; eager variables captured) against the tape's loop."""
    x, y = _data((6, 6, 2), 4, seed=4)
    model = _conv_model()
    model(x[:1])

    @tf.function
    def per_example(images, labels):
        loss = _sparse_ce()(labels, model(images))                  # [B]
        return (pertower.per_example_gradients(loss, model.trainable_weights),
                pertower.per_example_norms(loss, model.trainable_weights))

    gradients, norms = per_example(tf.constant(x), tf.constant(y))
    loop = _loop_gradients(model, model.get_weights(), x, y, [[i] for i in range(4)])
    for k, g in enumerate(gradients):
        np.testing.assert_allclose(g.numpy(), np.stack([e[k] for e in loop]), atol=2e-5)
    np.testing.assert_allclose(norms.numpy(), [_clipped(e, np.inf)[1] for e in loop],
                               rtol=1e-4)


def test_per_example_gradients_of_a_while_loop_in_a_users_tf_function():
    """A tf.while_loop in a user's tf.function (its body returns through Identity ops):
    h_{t+1} = tanh(x_t W + h_t U), T = 3, both weights on the rules, against the tape."""
    rng = np.random.RandomState(6)
    x = tf.constant(rng.randn(4, 3, 2).astype("float32"))                    # [B, T, 2]
    W = tf.Variable(rng.randn(2, 3).astype("float32"))
    U = tf.Variable(0.5 * rng.randn(3, 3).astype("float32"))

    def loss_of(inputs):                                                      # [b, T, 2]
        steps = tf.TensorArray(tf.float32, 3).unstack(tf.transpose(inputs, [1, 0, 2]))

        def body(t, h):
            return t + 1, tf.tanh(tf.matmul(steps.read(t), W) + tf.matmul(h, U))
        _, h = tf.while_loop(lambda t, h: t < 3, body,
                             (tf.constant(0), tf.zeros([tf.shape(inputs)[0], 3])))
        return tf.reduce_sum(h * h, axis=1)                                   # [b]

    @tf.function
    def per_example(inputs):
        loss = loss_of(inputs)
        plan = pertower.explain(loss, [W, U])
        assert not plan.fallback and plan.verdict == "independent", plan
        return pertower.per_example_gradients(loss, [W, U])

    gradients = per_example(x)
    for i in range(4):
        with tf.GradientTape() as tape:
            value = loss_of(x[i:i + 1])
        for g, want in zip(gradients, tape.gradient(value, [W, U])):
            np.testing.assert_allclose(g[i].numpy(), want.numpy(), atol=2e-5)


def test_run_eagerly_is_refused():
    """With run_eagerly=True there is no graph: a RuntimeError naming the switch."""
    x, y = _data((4,), 4)
    model = _dense_model()
    model.compile(optimizer=pertower.keras.DPKerasSGDOptimizer(1.0, 0.0, learning_rate=LR),
                  loss=_sparse_ce(), run_eagerly=True)
    with pytest.raises(RuntimeError, match="run_eagerly"):
        model.fit(x, y, batch_size=4, epochs=1, verbose=0)


def test_towers_over_a_nested_tf_function_are_refused():
    """A weight read in a tf.function called inside the user's tf.function falls to the
    towers (method="towers" here), whose copy of the call TensorFlow would differentiate
    with the whole batch's backward: refused, naming the call and the way out."""
    w = tf.Variable(np.ones((3, 2), "float32"))

    @tf.function
    def inner(x):
        return tf.tanh(tf.matmul(x, w)) ** 2                       # [B, 2]

    @tf.function(autograph=False)   # (with AutoGraph the error comes as a StagingError)
    def per_example(x):
        return pertower.per_example_gradients(tf.reduce_sum(inner(x), axis=1), [w],
                                              method="towers", batch_size=4)

    with pytest.raises(NotImplementedError, match="inside a tf.function.*disable_eager"):
        per_example(tf.ones([4, 3]))


def _fit_with(make_optimizer, x, y):
    """The weights after 2 epochs of fit (batches of 4, 4, 2: Keras traces train_step
    again for the last batch's shape) from the same initial weights."""
    tf_keras.utils.set_random_seed(3)
    model = _dense_model()
    model.compile(optimizer=make_optimizer(model), loss=_sparse_ce())
    model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    return [w.numpy() for w in model.trainable_weights]


def test_every_noise_mechanism_trains_across_retraces():
    """Banded MF noise and DP-FTRL's tree keep their variables across Keras' retraces
    (made once, outside the function). With noise 0 every mechanism's fit is DP-SGD's:
    the tree's residual is the clipped mean (FTRL without noise is SGD), the banded
    noise is 0; with noise each run moves off that by a finite amount."""
    x, y = _data((4,), 10)
    sgd = lambda sigma: lambda m: pertower.keras.DPKerasSGDOptimizer(  # noqa: E731
        1.0, sigma, learning_rate=LR, seed=1)
    banded = lambda sigma: lambda m: pertower.keras.DPKerasSGDOptimizer(  # noqa: E731
        1.0, sigma, learning_rate=LR, mechanism=pertower.BandedMFNoise(3, steps=10, seed=1))
    ftrl = lambda sigma: lambda m: pertower.keras.DPFTRLTreeAggregationOptimizer(  # noqa: E731
        1.0, sigma, m, noise_seed=1, learning_rate=LR)
    want = _fit_with(sgd(0.0), x, y)
    for make in (banded, ftrl):
        got = _fit_with(make(0.0), x, y)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
        noisy = _fit_with(make(1.0), x, y)
        assert all(np.all(np.isfinite(n)) for n in noisy)
        assert max(np.max(np.abs(n - w)) for n, w in zip(noisy, want)) > 1e-3

"""pertower.keras on published networks in TensorFlow 2's default mode (eager execution
on): tf_keras' `fit` traces `train_step` into a tf.function, where the DP step is built.
The networks, the reference and the claims are those of tests/test_keras_fit_zoo.py
(its module docstring): one fit step of B = 3 examples with noise 0 is
w - lr * mean_i clip_C(g_i), g_i from tf.GradientTape on each example, with every weight
on the rules (the plan of the loss `minimize` receives in fit's graph).

Also the refusals a user meets there: batch normalization in training mode, and Keras'
TF2 LSTM, whose recurrence is a tf.function called inside fit's (its weights fall to
the towers, which cannot replay such a call inside a tf.function)."""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import pertower
import pertower.keras as dp_keras
from tests import test_keras_fit_zoo as zoo_fit

B, C, LR = zoo_fit.B, zoo_fit.C, zoo_fit.LR
NONE = keras.losses.Reduction.NONE


def _numpy(tensors):
    return [t.numpy() for t in tensors]


def _loop_gradients(model, x, y):
    """[B, *w.shape] per weight: the tape's gradient of each example's loss."""
    loss = zoo_fit.sparse_cross_entropy("auto")
    rows = []
    for i in range(B):
        with tf.GradientTape() as tape:
            value = loss(y[i:i + 1], model(x[i:i + 1], training=True))
        rows.append([tf.convert_to_tensor(g).numpy()
                     for g in tape.gradient(value, model.trainable_weights)])
    return [np.stack([r[k] for r in rows]) for k in range(len(rows[0]))]


def _one_fit_step_is_the_loops_clipped_mean(model, x, y, reduction, monkeypatch):
    optimizer = dp_keras.DPKerasSGDOptimizer(l2_norm_clip=C, noise_multiplier=0.0,
                                             learning_rate=LR)
    plans = []
    train_op = optimizer._train_op   # pylint: disable=protected-access

    def explained(loss, var_list, *args, **kwargs):
        plans.append(pertower.explain(loss, var_list))
        return train_op(loss, var_list, *args, **kwargs)

    monkeypatch.setattr(optimizer, "_train_op", explained)
    model.compile(optimizer=optimizer, loss=zoo_fit.sparse_cross_entropy(reduction))
    before = _numpy(model.trainable_weights)
    want, norms = zoo_fit.expected_step(before, _loop_gradients(model, x, y))
    model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert plans and all(not p.fallback and p.verdict == "independent" for p in plans), \
        plans
    assert np.min(norms) > C, norms
    after = _numpy(model.trainable_weights)
    assert np.any(after[0] != before[0]) and np.any(after[-1] != before[-1])
    worst = max(float(np.max(np.abs(a - w))) for a, w in zip(after, want))
    moved = max(float(np.max(np.abs(a - b))) for a, b in zip(after, before))
    assert worst < 1e-3 * moved + 1e-6, (worst, moved)


@pytest.mark.parametrize("name, reduction", [("mobilenet", NONE)] + [
    p for p in zoo_fit.HEAVY if p.values[0] != "lstm"])   # (refused: test below)
def test_one_tf2_fit_step_on_a_published_network_is_the_loops_clipped_mean(
        name, reduction, monkeypatch):
    keras.utils.set_random_seed(0)
    model, x, y = zoo_fit.network(name, _numpy)
    _one_fit_step_is_the_loops_clipped_mean(model, x, y, reduction, monkeypatch)


def test_default_reduction_of_a_static_batch_is_read_per_example(monkeypatch):
    """fit traces B = 3 of 3 examples with a static batch axis: Keras' mean divides by
    the number of entries folded into a constant, read back as the per-example mean."""
    keras.utils.set_random_seed(0)
    x, y = np.random.RandomState(4).randn(B, 6, 6, 2).astype("float32"), np.arange(B)
    model = keras.Sequential([keras.layers.Conv2D(2, 3, activation="tanh",
                                                  input_shape=(6, 6, 2)),
                              keras.layers.Flatten(), keras.layers.Dense(3)])
    _one_fit_step_is_the_loops_clipped_mean(model, x, y, "auto", monkeypatch)


@pytest.mark.parametrize("cell", [keras.layers.LSTMCell, keras.layers.GRUCell])
def test_tf2_fit_step_of_a_keras_rnn_of_a_cell_is_the_loops_clipped_mean(cell, monkeypatch):
    """keras.layers.RNN(cell) runs its loop in fit's own graph (a While whose body
    returns through Identity ops, as a tf.function's does): its weights on the rules."""
    keras.utils.set_random_seed(0)
    rng = np.random.RandomState(5)
    model = keras.Sequential([keras.layers.Embedding(50, 8, input_length=6),
                              keras.layers.RNN(cell(8)), keras.layers.Dense(10)])
    x, y = rng.randint(0, 50, (B, 6)).astype("int32"), rng.randint(0, 10, B).astype("int32")
    _one_fit_step_is_the_loops_clipped_mean(model, x, y, "auto", monkeypatch)


def _fit_refused(model, x, y):
    model.compile(optimizer=dp_keras.DPKerasSGDOptimizer(1.0, 0.0),
                  loss=zoo_fit.sparse_cross_entropy("auto"))
    model.fit(x, y, batch_size=len(x), epochs=1, verbose=0)


def test_batch_norm_in_training_mode_is_refused_naming_the_layer_and_the_fix():
    rng = np.random.RandomState(1)
    with pytest.raises(ValueError, match=zoo_fit.BATCH_NORM_REFUSAL.replace(
            "'bn/", r"'sequential(_\d+)?/bn/")):
        _fit_refused(zoo_fit.batch_norm_model(), rng.randn(4, 6, 6, 2).astype("float32"),
                     rng.randint(0, 3, 4))


def test_keras_tf2_lstm_is_refused_saying_what_to_do():
    # (in graph mode the same model trains on the rules: tests/test_keras_fit_zoo.py)
    rng = np.random.RandomState(2)
    model = keras.Sequential([keras.layers.Embedding(20, 4, input_length=5),
                              keras.layers.LSTM(4), keras.layers.Dense(3)])
    with pytest.raises(Exception, match="DPKerasSGDOptimizer: `ys` is computed inside a "
                                        "tf.function.*'sequential(_\\d+)?/lstm/PartitionedCall'.*"
                                        r"tf.compat.v1.disable_eager_execution\(\)"):
        _fit_refused(model, rng.randint(0, 20, (4, 5)), rng.randint(0, 3, 4))


def test_graph_mode_fit_with_accumulation_without_legacy_keras_env():
    """TF_USE_LEGACY_KERAS is unset in this session (tf.compat.v1.keras is Keras 3): a
    graph-mode fit whose DP step makes variables (an accumulator) initializes them in
    tf_keras' own session; 2 runs of 2 examples make one step of the 4."""
    rng = np.random.RandomState(3)
    x, y = rng.randn(4, 5).astype("float32"), rng.randint(0, 3, 4).astype("int32")
    with tf.Graph().as_default():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.layers.Dense(3, input_shape=(5,))])
        model.compile(optimizer=dp_keras.DPKerasSGDOptimizer(
            0.3, 0.0, gradient_accumulation_steps=2, learning_rate=LR),
            loss=zoo_fit.sparse_cross_entropy("auto"))
        kernel, bias = keras.backend.batch_get_value(model.trainable_weights)
        model.fit(x, y, batch_size=2, epochs=1, shuffle=False, verbose=0)
        after = keras.backend.batch_get_value(model.trainable_weights)
    # the loop: softmax cross-entropy's gradient of example i is x_i (p_i - e_yi)
    logits = x @ kernel + bias
    p = np.exp(logits - logits.max(1, keepdims=True))
    dz = p / p.sum(1, keepdims=True) - np.eye(3)[y]                        # [4, 3]
    gradients = [np.einsum("bi,bj->bij", x, dz), dz]
    norms = np.sqrt(sum(np.sum(g.reshape(4, -1) ** 2, axis=1) for g in gradients))
    scale = np.minimum(1.0, 0.3 / norms)
    want = [w - LR * np.tensordot(scale, g, axes=1) / 4
            for w, g in zip((kernel, bias), gradients)]
    assert np.max(norms) > 0.3, norms   # clipping acts
    for a, w in zip(after, want):
        np.testing.assert_allclose(a, w, rtol=1e-5, atol=1e-6)

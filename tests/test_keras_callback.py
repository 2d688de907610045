"""pertower.keras.ExampleScores against the one-example loop (graph mode, tf_keras' v1 fit).

At every step t of a fit the callback's norms of the examples it says were trained are
the loop's ||g_i(w_t)|| of those examples at the weights the step started from (a spy
callback runs the loop there), each example of an epoch of arrays is seen once however
Keras shuffles, and self_influence_i = sum_t η ||g_i(w_t)||^2 over the steps that trained
on i; with Keras' default reduction as with NONE. The same on Poisson batches
(`PoissonSequence`, whose fit builds its training function at the first batch), empty
ones included; the fetches leave with the fit.
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import pertower
import pertower.keras as dp_keras
from pertower import oracle
from tests import common

N, LR = 12, 0.1
NONE, AUTO = keras.losses.Reduction.NONE, keras.losses.Reduction.AUTO


class _Spy(keras.callbacks.Callback):
    """Before each step: the loop's gradient norms of all N examples at the current
    weights; after it: the scores' last step."""

    def __init__(self, scores, norms_of_all):
        super().__init__()
        self.scores, self.norms_of_all, self.steps = scores, norms_of_all, []

    def on_train_batch_begin(self, batch, logs=None):
        self._before = self.norms_of_all()

    def on_train_batch_end(self, batch, logs=None):
        self.steps.append((self._before, self.scores.last_step))


def _fit(optimizer_kind, fits, reduction=NONE, seed=0):
    """Trains with ExampleScores and the spy, compiled with a loss of `reduction`;
    `fits(model, x, y, callbacks)` runs the fit calls. Returns (scores, spy steps, the
    model's training function)."""
    rng = np.random.RandomState(seed)
    x, y = rng.randn(N, 5).astype(np.float32), rng.randint(0, 3, N)
    with tf.Graph().as_default():
        common.seed_weights(seed)
        model = keras.Sequential([keras.layers.Dense(4, activation="tanh", input_shape=(5,)),
                                  keras.layers.Dense(3)])
        optimizer = (dp_keras.DPKerasSGDOptimizer(0.5, 0.0, learning_rate=LR,
                                                  expected_batch_size=4.0)
                     if optimizer_kind == "dp" else keras.optimizers.legacy.SGD(LR))
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=reduction))
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=NONE)
        labels = tf.compat.v1.placeholder(tf.int32, [None])
        per_example = loss(labels, model.outputs[0])                        # [N]
        sess = tf.compat.v1.keras.backend.get_session()

        def norms_of_all():
            grads = oracle.loop_per_example_gradients(
                sess, per_example, model.trainable_weights, {model.inputs[0]: x, labels: y})
            return np.sqrt(sum(np.sum(g.reshape(N, -1) ** 2, axis=1) for g in grads))

        scores = dp_keras.ExampleScores(x)
        spy = _Spy(scores, norms_of_all)
        fits(model, x, y, [scores, spy])
        return scores, spy.steps, model.train_function


def _check_against_the_loop(scores, steps):
    influence = np.zeros(N)
    for before, (indices, norms, rate) in steps:
        common.assert_all_close([norms], [before[indices]], what="a step's norms")
        assert rate == pytest.approx(LR)
        influence[indices] += LR * before[indices] ** 2
    common.assert_all_close([scores.self_influence], [influence.astype(np.float32)],
                            what="self-influence")


@pytest.mark.parametrize("optimizer_kind, reduction", [("dp", NONE), ("sgd", AUTO)])
def test_scores_of_shuffled_batches_are_the_loops_keyed_by_index(optimizer_kind,
                                                                 reduction):
    def fits(model, x, y, callbacks):
        model.fit(x, y, batch_size=4, epochs=2, shuffle=True, verbose=0,
                  callbacks=callbacks)

    scores, steps, function = _fit(optimizer_kind, fits, reduction)
    assert len(steps) == 6
    np.testing.assert_array_equal(scores.times_seen, np.full(N, 2))   # once an epoch
    for epoch in (steps[:3], steps[3:]):
        seen = np.concatenate([indices for _, (indices, _, _) in epoch])
        np.testing.assert_array_equal(np.sort(seen), np.arange(N))
    assert [indices.tolist() for _, (indices, _, _) in steps[:3]] != [
        list(range(0, 4)), list(range(4, 8)), list(range(8, 12))]     # Keras shuffled
    _check_against_the_loop(scores, steps)
    assert np.all(scores.last_norms > 0)
    np.testing.assert_array_equal(scores.top(3), np.argsort(-scores.self_influence)[:3])
    assert function.fetches == [] and function.fetch_callbacks == {}   # removed at the end


def test_scores_on_poisson_batches_an_empty_one_included():
    # seed 2 with q = 0.15 draws 2, 0, 2, 0, 2 and 3 examples (checked below);
    # workers=0: the steps take the sequence's draws in order
    q, seed = 0.15, 2
    want = [len(b) for b in pertower.poisson_batches(np.arange(N), q, steps=6, seed=seed)]
    assert want == [2, 0, 2, 0, 2, 3]

    def fits(model, x, y, callbacks):
        sequence = dp_keras.PoissonSequence(x, y, q, steps_per_epoch=3, seed=seed)
        model.fit(sequence, epochs=2, verbose=0, workers=0, callbacks=callbacks)

    scores, steps, _ = _fit("dp", fits, AUTO)
    assert [len(indices) for _, (indices, _, _) in steps] == want
    _check_against_the_loop(scores, steps)
    assert scores.times_seen.sum() == sum(want)


def test_bad_inputs_are_refused_naming_the_fix():
    with pytest.raises(TypeError, match="pertower.ExampleScores: `x` must be the NumPy"):
        dp_keras.ExampleScores([[1.0, 2.0]])
    x = np.zeros((3, 2), np.float32)
    with tf.Graph().as_default():
        model = keras.Sequential([keras.layers.Dense(2, input_shape=(2,))])
        model.compile(optimizer=keras.optimizers.legacy.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True, reduction=NONE))
        with pytest.raises(ValueError, match=r"`x` has equal rows \(0 and 1\)"):
            model.fit(x, np.zeros(3), verbose=0, callbacks=[dp_keras.ExampleScores(x)])
        x = np.arange(6, dtype=np.float32).reshape(3, 2)
        with pytest.raises(ValueError, match="input is not a row of `x`"):
            model.fit(x + 100, np.zeros(3), verbose=0,
                      callbacks=[dp_keras.ExampleScores(x)])
        assert model.train_function.fetches == []       # detached on the error too
    with tf.Graph().as_default():
        model = keras.Sequential([keras.layers.Dense(2, input_shape=(2,))])
        model.compile(optimizer=keras.optimizers.legacy.SGD(0.1),
                      loss=keras.losses.MeanSquaredError(reduction="sum"))
        with pytest.raises(ValueError, match="pertower.ExampleScores: `model.total_loss` "
                                             ".* sums the examples' losses"):
            model.fit(x, x, verbose=0, callbacks=[dp_keras.ExampleScores(x)])

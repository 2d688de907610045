"""pertower.keras.PoissonSequence: Poisson batches for tf_keras' `model.fit` (graph mode).

Each batch is an independent Poisson sample (its size Binomial(N, q), checked with a
chi-square test on seeded draws: the numbers are fixed, so the test cannot flake), drawn
by the sampler of `pertower.poisson_batches` (the same seed gives the same batches). In
a fit of several epochs on batches of every size, 0 included (Keras' default reduction,
whose scalar loss Keras averages over the steps), each step with noise 0 moves w to
w - lr * sum_i clip_C(g_i) / (q N), g_i the one-example loop's gradients over that
step's batch; an empty batch with noise is a step of the noise alone.
"""

import numpy as np
import pytest
import scipy.stats
import tensorflow as tf
import tf_keras as keras

import pertower
import pertower.keras as dp_keras
from pertower import oracle
from tests import common

N, CLIP, LR = 12, 0.5, 0.1
NONE = keras.losses.Reduction.NONE


def _data(rng):
    return rng.randn(N, 5).astype(np.float32), rng.randint(0, 3, N)


def test_batch_sizes_are_binomial_and_examples_join_independently():
    n, q, draws = 40, 0.25, 4000
    x = np.arange(n, dtype=np.float32)[:, None]                          # [n, 1]
    sequence = dp_keras.PoissonSequence(x, np.arange(n), q, seed=0)
    assert len(sequence) == 4 and sequence.expected_batch_size == pytest.approx(10.0)
    batches = [sequence[0] for _ in range(draws)]
    for images, labels in batches[:50]:
        np.testing.assert_array_equal(images[:, 0], labels)             # rows stay paired
        assert np.all(np.diff(labels) > 0)                               # no repeats
    sizes = np.array([len(labels) for _, labels in batches])
    # chi-square goodness of fit to Binomial(n, q), tail bins merged to >= 5 expected
    pmf = scipy.stats.binom.pmf(np.arange(n + 1), n, q) * draws
    counts = np.bincount(sizes, minlength=n + 1)
    low, high = 4, 17        # bins 0..4 and 17..n merged: each expects >= 5
    observed = np.concatenate([[counts[:low + 1].sum()], counts[low + 1:high],
                               [counts[high:].sum()]])
    expected = np.concatenate([[pmf[:low + 1].sum()], pmf[low + 1:high], [pmf[high:].sum()]])
    assert expected.min() >= 5
    assert scipy.stats.chisquare(observed, expected).pvalue > 1e-4
    # every example joins about q * draws times (the binomial's 6-sigma band)
    joins = np.bincount(np.concatenate([labels for _, labels in batches]), minlength=n)
    assert np.all(np.abs(joins - q * draws) < 6 * np.sqrt(draws * q * (1 - q))), joins


def test_the_sampler_is_poisson_batches_and_the_seed_repeats_it():
    x, y = _data(np.random.RandomState(0))
    sequence = dp_keras.PoissonSequence(x, y, 0.3, seed=5)
    twin = dp_keras.PoissonSequence(x, y, 0.3, seed=5)
    batches = list(pertower.poisson_batches((x, y), 0.3, steps=6, seed=5))
    for want in batches:
        got, again = sequence[0], twin[3]           # the index does not choose the batch
        for a, b, c in zip(got, again, want):
            np.testing.assert_array_equal(a, c)
            np.testing.assert_array_equal(b, c)
    assert len({len(y) for _, y in batches}) > 1    # sizes vary


def test_inputs_without_targets_and_several_inputs():
    x, y = _data(np.random.RandomState(1))
    alone = dp_keras.PoissonSequence(x, sampling_probability=0.5, seed=1)[0]
    assert isinstance(alone, np.ndarray) and alone.shape[1:] == (5,)
    (a, b), (c,) = dp_keras.PoissonSequence([x, 2 * x], [y], 0.5, seed=1)[0]
    np.testing.assert_array_equal(2 * a, b)
    assert len(c) == len(a)


@pytest.mark.parametrize("arguments, error, match", [
    (dict(x=[1, 2], y=None, sampling_probability=0.5), TypeError,
     "`x` must be a NumPy array"),
    (dict(x=np.zeros((3, 2)), y=np.zeros(4), sampling_probability=0.5), ValueError,
     r"must share their first dimension N .* \[3, 4\]"),
    (dict(x=np.zeros((3, 2)), y=None), TypeError, "`sampling_probability`"),
    (dict(x=np.zeros((3, 2)), y=None, sampling_probability=1.5), ValueError,
     "sampling_probability"),
    (dict(x=np.zeros((3, 2)), y=None, sampling_probability=0.5, steps_per_epoch=0),
     ValueError, "steps_per_epoch")])
def test_bad_arguments_are_named(arguments, error, match):
    with pytest.raises(error, match=f"pertower.PoissonSequence: .*{match}"):
        dp_keras.PoissonSequence(**arguments)


def _compiled(x, y, q, seed, steps_per_epoch, noise_multiplier, reduction=None,
              noise_seed=None):
    """(model, PoissonSequence(x, y, q, steps_per_epoch, seed)): a Dense 5-4-3 network
    compiled with DPKerasSGDOptimizer (C = CLIP, lr = LR, divided by q N) and the
    sparse cross-entropy of `reduction` (None: Keras' default)."""
    model = keras.Sequential([keras.layers.Dense(4, activation="tanh", input_shape=(5,)),
                              keras.layers.Dense(3)])
    sequence = dp_keras.PoissonSequence(x, y, q, steps_per_epoch=steps_per_epoch, seed=seed)
    loss = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, **({} if reduction is None else dict(reduction=reduction)))
    model.compile(optimizer=dp_keras.DPKerasSGDOptimizer(
        l2_norm_clip=CLIP, noise_multiplier=noise_multiplier, learning_rate=LR,
        expected_batch_size=sequence.expected_batch_size, seed=noise_seed), loss=loss)
    return model, sequence


def _one_poisson_step(q, seed, noise_multiplier):
    """(weights before, after one fit step on the first batch of PoissonSequence(q,
    seed), its size)."""
    x, y = _data(np.random.RandomState(0))
    with tf.Graph().as_default():
        common.seed_weights(0)
        model, sequence = _compiled(x, y, q, seed, 1, noise_multiplier,
                                    reduction=NONE, noise_seed=1)
        before = model.get_weights()
        model.fit(sequence, epochs=1, verbose=0)
        after = model.get_weights()
    size = len(next(pertower.poisson_batches(np.arange(N), q, steps=1, seed=seed)))
    return before, after, size


def test_an_empty_batch_is_a_step_of_noise_alone():
    # seed 1 with q = 0.02 draws no example first (checked); (with noise 0 an empty
    # step moves nothing: the several epochs' test); noise only: every weight moves by
    # lr * N(0, (σ C)^2) / (q N), finite
    before, after, b = _one_poisson_step(0.02, seed=1, noise_multiplier=1.0)
    moves = np.concatenate([(v - w).ravel() for w, v in zip(before, after)])
    scale = LR * CLIP / (0.02 * N)
    assert b == 0 and np.all(moves != 0) and np.all(np.abs(moves) < 7 * scale)


class _Steps(keras.callbacks.Callback):
    """Each step's weights before and after, and the loop's clipped sum / (q N) over
    the step's batch (`batches`, in the order the sequence draws them) at the weights
    before."""

    def __init__(self, clipped_sum_over, batches):
        super().__init__()
        self.clipped_sum_over, self.batches, self.steps = clipped_sum_over, batches, []

    def on_train_batch_begin(self, batch, logs=None):
        index = self.batches[len(self.steps)]
        self.steps.append([self.model.get_weights(), self.clipped_sum_over(index)])

    def on_train_batch_end(self, batch, logs=None):
        self.steps[-1].append(self.model.get_weights())


def test_a_fit_of_several_epochs_takes_a_step_on_every_batch_size_0_included():
    # seed 0 with q = 0.15 draws batches of 3, 3, 1, 0, 3 and 2 examples (checked)
    q, seed = 0.15, 0
    batches = list(pertower.poisson_batches(np.arange(N), q, steps=6, seed=seed))
    assert [len(b) for b in batches] == [3, 3, 1, 0, 3, 2]
    x, y = _data(np.random.RandomState(2))
    with tf.Graph().as_default():
        common.seed_weights(2)
        model, sequence = _compiled(x, y, q, seed, 3, 0.0)
        labels = tf.compat.v1.placeholder(tf.int32, [None])
        per_example = keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=NONE)(labels, model.outputs[0])      # [b]
        sess = tf.compat.v1.keras.backend.get_session()

        def clipped_sum_over(index):
            if not len(index):
                return [np.zeros(w.shape.as_list(), np.float32)
                        for w in model.trainable_weights]
            grads = oracle.loop_per_example_gradients(
                sess, per_example, model.trainable_weights,
                {model.inputs[0]: x[index], labels: y[index]})
            return [g * len(index) / sequence.expected_batch_size
                    for g in common.loop_clipped_mean(grads, CLIP)[1]]

        spy = _Steps(clipped_sum_over, batches)
        # workers=0: the steps take the sequence's draws in order, as `batches`
        history = model.fit(sequence, epochs=2, verbose=0, workers=0, callbacks=[spy])
    assert len(spy.steps) == 6
    for t, (before, update, after) in enumerate(spy.steps):
        common.assert_all_close(after, [w - LR * g for w, g in zip(before, update)],
                                what=f"step {t} ({len(batches[t])} examples)", kind="deep")
    losses = history.history["loss"]
    assert len(losses) == 2 and all(np.isscalar(v) and np.isfinite(v) for v in losses)

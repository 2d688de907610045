"""DPOptimizer and compute_epsilon against NumPy references built on the oracle loop.

The reference DP step: per-example (or per-microbatch mean) gradients from the
one-example loop `pertower.oracle`, each clipped to global norm C in NumPy, averaged,
then applied by hand (SGD, or the first step of v1 Adam).
"""


import warnings

import dp_accounting
import numpy as np
import pytest
import scipy.stats
import tensorflow as tf
import tf_keras as keras

import pertower
from pertower import oracle
from tests import cases
from tests import common

LEARNING_RATE = 0.5


@pytest.fixture(scope="module")
def mlp_batch_size():   # tests/conftest.py's `mlp` at B = 6: one graph for the module's checks
    return 6


def _clip_reference(per_slice, clip):
    """NumPy: each row of every [M, ...] array clipped to global norm `clip`, averaged."""
    M = per_slice[0].shape[0]
    norms = np.sqrt(sum(np.sum(g.reshape(M, -1) ** 2, axis=1) for g in per_slice))  # [M]
    factors = clip / np.maximum(norms, clip)                                        # [M]
    return [np.tensordot(factors, g, axes=1) / M for g in per_slice], norms


def _reference_slices(case, num_microbatches):
    """Per-example gradients of the per-example mean loss, or microbatch-mean gradients
    ([M, *x.shape] each), from the one-example loop."""
    B = case.B
    M = B if num_microbatches is None else num_microbatches
    sums = oracle.loop_microbatch_gradients(case.sess, case.ys, case.xs, case.feed, M)
    return [g / (B // M) for g in sums]


def _adam_step(w, g, lr, beta1=0.9, beta2=0.999, epsilon=1e-8):
    """NumPy: the first step of tf.compat.v1.train.AdamOptimizer from zero slots."""
    m = (1 - beta1) * g
    v = (1 - beta2) * g * g
    lr_t = lr * np.sqrt(1 - beta2) / (1 - beta1)
    return w - lr_t * m / (np.sqrt(v) + epsilon)


# per-example clipping with Adam and microbatches with SGD by default; the rest heavy
@pytest.mark.parametrize("num_microbatches, optimizer_name", [(None, "adam"), (3, "sgd")] + [
    pytest.param(m, name, marks=pytest.mark.heavy) for m, name in (
        (None, "sgd"), (3, "adam"), (6, "sgd"), (6, "adam"), (1, "sgd"), (1, "adam"))])
def test_one_noiseless_step_equals_the_numpy_reference(mlp, optimizer_name, num_microbatches):
    with mlp.graph.as_default():
        initial = mlp.sess.run(mlp.xs)
        slices = _reference_slices(mlp, num_microbatches)
        M = slices[0].shape[0]
        norms = np.sqrt(sum(np.sum(g.reshape(M, -1) ** 2, axis=1) for g in slices))
        if M > 2:
            clip = float(np.median(norms))   # some slices clipped, some not
            assert (norms > clip * 1.01).any() and (norms < clip * 0.99).any()
        else:
            clip = 0.5 * float(norms.min())  # every slice clipped
        want_gradient, _ = _clip_reference(slices, clip)

        inner = (tf.compat.v1.train.GradientDescentOptimizer(LEARNING_RATE)
                 if optimizer_name == "sgd" else tf.compat.v1.train.AdamOptimizer(LEARNING_RATE))
        dp = pertower.DPOptimizer(inner, l2_norm_clip=clip, noise_multiplier=0.0,
                                  num_microbatches=num_microbatches)
        grads_and_vars = dp.compute_gradients(mlp.ys, var_list=mlp.xs, batch_size=mlp.B)
        assert [v for _, v in grads_and_vars] == mlp.xs
        before = tf.compat.v1.global_variables()
        train = dp.apply_gradients(grads_and_vars)
        mlp.sess.run(tf.compat.v1.variables_initializer(
            [v for v in tf.compat.v1.global_variables() if v not in before]))
        got_gradient = mlp.sess.run([g for g, _ in grads_and_vars], mlp.feed)
        ys_before = mlp.sess.run(mlp.ys, mlp.feed)
        mlp.sess.run(train, mlp.feed)
        updated = mlp.sess.run(mlp.xs)

    common.assert_all_close(got_gradient, want_gradient, kind="tight", what="DP gradient")
    if optimizer_name == "sgd":
        want = [w - LEARNING_RATE * g for w, g in zip(initial, want_gradient)]
    else:
        want = [_adam_step(w, g, LEARNING_RATE) for w, g in zip(initial, want_gradient)]
    common.assert_all_close(updated, want, 1e-5, 1e-5, f"{optimizer_name} DP step")
    assert not np.allclose(mlp.sess.run(mlp.ys, mlp.feed), ys_before)


@pytest.mark.parametrize("num_microbatches", [None, pytest.param(2, marks=pytest.mark.heavy)])
def test_a_loss_with_several_entries_per_example_is_averaged_per_example(mlp, num_microbatches):
    with mlp.graph.as_default():
        loss = mlp.outputs ** 2                                           # [B, 3]
        M = mlp.B if num_microbatches is None else num_microbatches
        sums = oracle.loop_microbatch_gradients(mlp.sess, loss, mlp.xs, mlp.feed, M)
        # the mean over a microbatch's B/M examples and their 3 entries each
        want, norms = _clip_reference([g / (mlp.B // M * 3) for g in sums], 0.05)
        assert (norms > 0.05).any()
        dp = pertower.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1), 0.05, 0.0,
                                  num_microbatches=num_microbatches)
        got = mlp.sess.run([g for g, _ in dp.compute_gradients(loss, mlp.xs, batch_size=6)],
                           mlp.feed)
    common.assert_all_close(got, want, 1e-5, 1e-7, "[B, 3] loss")


# a static batch axis and float64 by default; a shared layer and the cnn heavy (every
# rule's clipped sum: test_every_rule_s_clipped_sum_is_the_reweighted_oracle)
@pytest.mark.parametrize("builder", ["static_mlp", "mlp_float64"] + [
    pytest.param(name, marks=pytest.mark.heavy) for name in ("shared_layer", "cnn")])
def test_noiseless_dp_gradient_on_other_models(builder):
    case = cases.BUILDERS[builder]()
    with case.graph.as_default():
        ys, _, feed = case.oracle()
        per_example = oracle.loop_per_example_gradients(case.sess, ys, case.xs, feed)
        norms = np.sqrt(sum(np.sum(g.reshape(case.B, -1) ** 2, axis=1) for g in per_example))
        clip = float(np.median(norms))
        want, _ = _clip_reference(per_example, clip)
        dp = pertower.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1), clip, 0.0)
        # a static batch axis needs no batch_size
        batch_size = None if builder == "static_mlp" else case.B
        grads = [g for g, _ in dp.compute_gradients(case.ys, case.xs, batch_size=batch_size)]
        got = case.sess.run(grads, case.feed)
    common.assert_all_close(got, want, case.rtol, case.atol, f"{builder} DP gradient")


def test_minimize_with_sparse_embedding_gradients_and_global_step():
    case = cases.build_embedding(B=4)
    with case.graph.as_default():
        initial = case.sess.run(case.xs)
        slices = _reference_slices(case, None)
        want_gradient, norms = _clip_reference(slices, 0.5)
        assert (norms > 0.5).any()
        step = tf.compat.v1.train.create_global_step()
        case.sess.run(step.initializer)
        dp = pertower.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer(LEARNING_RATE),
                                  l2_norm_clip=0.5, noise_multiplier=0.0)
        train = dp.minimize(case.ys, global_step=step, var_list=case.xs, batch_size=case.B)
        case.sess.run(train, case.feed)
        updated, step_value = case.sess.run([case.xs, step])
    want = [w - LEARNING_RATE * g for w, g in zip(initial, want_gradient)]
    common.assert_all_close(updated, want, kind="tight", what="embedding DP step")
    assert step_value == 1


def test_default_var_list_is_the_trainable_variables():
    case = cases.build_compat_v1_layers(B=4)
    with case.graph.as_default():
        dp = pertower.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1), 1.0, 0.0)
        grads_and_vars = dp.compute_gradients(case.ys, batch_size=case.B)
        got = case.sess.run([g for g, _ in grads_and_vars], case.feed)
        variables = [v for _, v in grads_and_vars]
        want, _ = _clip_reference(_reference_slices(case, None), 1.0)
    assert {v.name for v in variables} == {v.name for v in case.xs}
    order = [case.xs.index(v) for v in variables]
    common.assert_all_close(got, [want[k] for k in order], kind="tight", what="default var_list")


def _dropout_mlp(B, rate=0.5):
    """x [B, 5] -> Dense(16, relu) -> Dropout (training) -> Dense(1); loss [B]."""
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(9)
        x = tf.compat.v1.placeholder(tf.float32, [None, 5])
        hidden = keras.layers.Dense(16, activation="relu")
        head = keras.layers.Dense(1)
        dropped = keras.layers.Dropout(rate)(hidden(x), training=True)       # [B, 16]
        out = head(dropped)                                                 # [B, 1]
        loss = tf.reduce_sum(out ** 2, axis=1)                              # [B]
        weights = hidden.trainable_weights + head.trainable_weights
        feed = {x: np.random.RandomState(0).randn(B, 5).astype(np.float32) * 3}
    return graph, loss, weights, dropped, out, feed


def test_dropout_clips_the_gradients_of_the_run_s_own_draw():
    # one sess.run: the DP gradient, the rules' per-example gradients of the same draw,
    # and the dropped activations. Every rule differentiates the same forward pass, so
    # the DP gradient is sum_i f_i g_i / B with f_i = min(1, C / ||g_i||) of THESE g_i.
    B, clip = 8, 30.0
    graph, loss, weights, dropped, out, feed = _dropout_mlp(B)
    with graph.as_default():
        dp = pertower.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                  l2_norm_clip=clip, noise_multiplier=0.0)
        with warnings.catch_warnings():
            warnings.simplefilter("error")   # the rules cover every weight: no warning
            grads = [g for g, _ in dp.compute_gradients(loss, weights, batch_size=B)]
        per_example = pertower.per_example_gradients(loss, weights, method="rules")
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            runs = [sess.run([grads, per_example, dropped, out], feed) for _ in range(3)]
    masks = []
    for got, g_i, d, o in runs:
        # the head kernel's per-example gradient is d_i ⊗ 2 o_i: the draw of this run
        common.assert_all_close([g_i[2]], [d[:, :, None] * 2 * o[:, None, :]], kind="tight",
                                what="head kernel per-example gradient")
        norms = np.sqrt(sum(np.sum(g.reshape(B, -1) ** 2, axis=1) for g in g_i))   # [B]
        assert (norms > clip * 1.01).any() and (norms < clip * 0.99).any(), norms
        want, _ = _clip_reference(g_i, clip)
        common.assert_all_close(got, want, kind="tight", what="DP gradient with dropout")
        factors = clip / np.maximum(norms, clip)
        assert np.all(factors * norms <= clip * (1 + 1e-6))
        masks.append(d != 0)
    assert not all(np.array_equal(masks[0], m) for m in masks[1:])  # new draws each run


def test_dropout_with_towers_clips_each_example_to_the_bound():
    # method="towers": the towers replay the model with their own draws; the clipped
    # gradients are those draws' and still bounded by C
    B = 8
    graph, loss, weights, _, _, feed = _dropout_mlp(B)
    with graph.as_default():
        dp = pertower.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                  l2_norm_clip=1e-3, noise_multiplier=0.0, method="towers")
        with pytest.warns(UserWarning, match="depends on the random op"):
            grads = [g for g, _ in dp.compute_gradients(loss, weights, batch_size=B)]
        norm = tf.linalg.global_norm(grads)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            norms = [sess.run(norm, feed) for _ in range(10)]
    # every example's gradient is far above the clip, so each contributes norm 1e-3 and
    # the average has norm <= 1e-3 (equal only when all point the same way)
    assert max(norms) <= 1e-3 * (1 + 1e-5), norms
    assert min(norms) > 1e-4 and len(set(norms)) > 1, norms


@pytest.fixture(scope="module")
def noise_graph(mlp):
    """The MLP with a noiseless and two noisy DP gradients of one batch (seed 7 and 8)."""
    with mlp.graph.as_default():
        def gradients(noise, seed=None):
            dp = pertower.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                      l2_norm_clip=1.5, noise_multiplier=noise, seed=seed)
            return [g for g, _ in dp.compute_gradients(mlp.ys, mlp.xs, batch_size=mlp.B)]
        before = set(tf.compat.v1.global_variables())
        clean = gradients(0.0)
        noisy = gradients(2.0, seed=7)
        other = gradients(2.0, seed=8)
        # the noise's seed and draw counter (`_dp.noise.GaussianNoise`)
        mlp.sess.run(tf.compat.v1.variables_initializer(
            [v for v in tf.compat.v1.global_variables() if v not in before]))
    return mlp, clean, noisy, other


def _noise_samples(case, clean, noisy, runs):
    """The noise of `runs` sess.runs: noisy - clean, flattened per run, [runs, P]."""
    rows = []
    for _ in range(runs):
        c, n = case.sess.run([clean, noisy], case.feed)
        rows.append(np.concatenate([(b - a).ravel() for a, b in zip(c, n)]))
    return np.stack(rows)


def test_noise_std_is_noise_multiplier_times_clip_over_batch(noise_graph):
    case, clean, noisy, _ = noise_graph
    samples = _noise_samples(case, clean, noisy, runs=20).ravel().astype(np.float64)
    n = samples.size
    sigma = 2.0 * 1.5 / case.B
    # (n-1) s^2 / sigma^2 ~ chi-square(n-1); accept within the two-sided 1e-6 quantiles
    statistic = (n - 1) * samples.var(ddof=1) / sigma ** 2
    low, high = scipy.stats.chi2.ppf([1e-6, 1 - 1e-6], n - 1)
    assert low < statistic < high, (samples.std(ddof=1), sigma, n)
    # the mean of n N(0, sigma^2) draws: within 5 standard errors of 0
    assert abs(samples.mean()) < 5 * sigma / np.sqrt(n)


def test_noise_differs_between_weights_runs_and_seeds(noise_graph):
    case, clean, noisy, other = noise_graph
    first, second = _noise_samples(case, clean, noisy, runs=2)
    assert not np.allclose(first, second)  # a new draw per sess.run
    c, n = case.sess.run([clean, noisy], case.feed)
    # the two bias vectors of the last layers have different sizes; compare the first
    # entries of every weight: one draw per weight would repeat them
    heads = [(b - a).ravel()[0] for a, b in zip(c, n)]
    assert len(set(np.round(heads, 6))) == len(heads)
    seven, eight = case.sess.run([noisy, other], case.feed)
    assert not np.allclose(np.concatenate([s.ravel() for s in seven]),
                           np.concatenate([s.ravel() for s in eight]))


def _seeded_noise(seed, runs=2):
    """Builds a fresh graph without a graph-level seed and returns the noise of `runs`
    sess.runs of a DP gradient with op seed `seed`."""
    with tf.Graph().as_default() as graph:
        x = tf.compat.v1.placeholder(tf.float32, [None, 3])
        w = tf.compat.v1.get_variable("w", [3, 2], initializer=tf.ones_initializer())
        loss = tf.reduce_sum(tf.matmul(x, w) ** 2, axis=1)             # [B]
        dp = pertower.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1), 1.0, 1.0,
                                  seed=seed)
        clean = pertower.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1), 1.0, 0.0)
        (g, _), = dp.compute_gradients(loss, [w], batch_size=4)
        (g0, _), = clean.compute_gradients(loss, [w], batch_size=4)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            feed = {x: np.arange(12, dtype=np.float32).reshape(4, 3)}
            return [np.subtract(*sess.run([g, g0], feed)) for _ in range(runs)]


def test_seed_makes_the_noise_repeatable():
    first, again, other = _seeded_noise(3), _seeded_noise(3), _seeded_noise(4)
    np.testing.assert_array_equal(np.stack(first), np.stack(again))
    assert not np.allclose(first[0], first[1])
    assert not np.allclose(first[0], other[0])


def test_errors_name_the_argument(mlp):
    sgd = tf.compat.v1.train.GradientDescentOptimizer(0.1)
    with mlp.graph.as_default():
        with pytest.raises(ValueError, match="DP needs one loss per example"):
            pertower.DPOptimizer(sgd, 1.0, 1.0).compute_gradients(
                tf.reduce_mean(mlp.ys), mlp.xs, batch_size=6)
        with pytest.raises(ValueError, match=r"`num_microbatches` \(4\) must divide the batch "
                                             r"size \(6\)"):
            pertower.DPOptimizer(sgd, 1.0, 1.0, num_microbatches=4).compute_gradients(
                mlp.ys, mlp.xs, batch_size=6)
        with pytest.raises(RuntimeError, match="call compute_gradients first"):
            pertower.DPOptimizer(sgd, 1.0, 1.0).apply_gradients(
                [(tf.zeros_like(v), v) for v in mlp.xs])
        with pytest.raises(ValueError, match="`grad_loss` must be None"):
            pertower.DPOptimizer(sgd, 1.0, 1.0).compute_gradients(
                mlp.ys, mlp.xs, batch_size=6, grad_loss=tf.ones_like(mlp.ys))
        with pytest.raises(TypeError, match="not a callable"):
            pertower.DPOptimizer(sgd, 1.0, 1.0).compute_gradients(lambda: mlp.ys, mlp.xs)
        with pytest.raises(ValueError, match="`var_list` is empty"):
            pertower.DPOptimizer(sgd, 1.0, 1.0).compute_gradients(mlp.ys, [], batch_size=6)
    for bad_clip in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"`l2_norm_clip` must be a positive number"):
            pertower.DPOptimizer(sgd, bad_clip, 1.0)
    with pytest.raises(TypeError, match="`l2_norm_clip` must be a positive number"):
        pertower.DPOptimizer(sgd, "1", 1.0)
    with pytest.raises(ValueError, match="`noise_multiplier` must be a non-negative number"):
        pertower.DPOptimizer(sgd, 1.0, -0.5)
    with pytest.raises(ValueError, match="`num_microbatches` must be a positive integer"):
        pertower.DPOptimizer(sgd, 1.0, 1.0, num_microbatches=0)
    with pytest.raises(TypeError, match="`seed` must be an int"):
        pertower.DPOptimizer(sgd, 1.0, 1.0, seed=1.5)
    with pytest.raises(TypeError, match="tf.compat.v1.train.Optimizer instance"):
        pertower.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer, 1.0, 1.0)


def _direct_epsilon(steps, noise, q, delta):
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(dp_accounting.PoissonSampledDpEvent(
        q, dp_accounting.GaussianDpEvent(noise)), steps)
    return accountant.get_epsilon(delta)


@pytest.mark.parametrize("steps, noise, q, delta", [
    (1000, 1.1, 256 / 60000, 1e-5), (50, 0.8, 0.05, 1e-6), (10, 3.0, 1.0, 1e-3)])
def test_compute_epsilon_agrees_with_dp_accounting(steps, noise, q, delta):
    assert pertower.compute_epsilon(steps, noise, q, delta) == pytest.approx(
        _direct_epsilon(steps, noise, q, delta), rel=1e-12)


def test_compute_epsilon_decreases_with_noise_and_grows_with_steps():
    by_noise = [pertower.compute_epsilon(500, noise, 0.02, 1e-5) for noise in (0.7, 1.0, 2.0, 4.0)]
    assert all(a > b for a, b in zip(by_noise, by_noise[1:])), by_noise
    by_steps = [pertower.compute_epsilon(steps, 1.0, 0.02, 1e-5) for steps in (10, 100, 1000)]
    assert all(a < b for a, b in zip(by_steps, by_steps[1:])), by_steps
    assert pertower.compute_epsilon(0, 1.0, 0.02, 1e-5) == 0.0


def test_compute_epsilon_without_sampling_is_below_the_classic_rdp_bound():
    # q = 1: T steps of the Gaussian mechanism have RDP T*a/(2 sigma^2) at order a; the
    # classic conversion eps <= rdp + log(1/delta)/(a-1) (Mironov 2017, Prop. 3) bounds
    # the accountant's tighter conversion from above, minimized over a > 1.
    steps, noise, delta = 10, 3.0, 1e-3
    orders = np.linspace(1.01, 200, 20000)
    classic = np.min(steps * orders / (2 * noise ** 2) + np.log(1 / delta) / (orders - 1))
    eps = pertower.compute_epsilon(steps, noise, 1.0, delta)
    assert 0.8 * classic < eps <= classic + 1e-9, (eps, classic)


@pytest.mark.parametrize("kwargs, message", [
    (dict(steps=-1), "`steps` must be a non-negative integer"),
    (dict(steps=1.5), "`steps` must be a non-negative integer"),
    (dict(noise_multiplier=0), r"`noise_multiplier` must be in \(0, inf\)"),
    (dict(sampling_probability=0), r"`sampling_probability` must be in \(0, 1\]"),
    (dict(sampling_probability=1.5), r"`sampling_probability` must be in \(0, 1\]"),
    (dict(delta=0), r"`delta` must be in \(0, 1\)"),
    (dict(delta=1), r"`delta` must be in \(0, 1\)"),
])
def test_compute_epsilon_rejects_bad_arguments(kwargs, message):
    arguments = dict(steps=10, noise_multiplier=1.0, sampling_probability=0.1, delta=1e-5)
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=message):
        pertower.compute_epsilon(**arguments)


@pytest.mark.parametrize("accountant,tolerance", [("rdp", 1e-3), ("pld", 2e-2)])
def test_compute_noise_multiplier_is_the_smallest_reaching_the_target(accountant, tolerance):
    steps, q, delta, target = 200, 0.02, 1e-5, 2.0
    sigma = pertower.compute_noise_multiplier(target, steps, q, delta, accountant=accountant,
                                              tolerance=tolerance)
    assert pertower.compute_epsilon(steps, sigma, q, delta, accountant=accountant) <= target
    assert pertower.compute_epsilon(steps, sigma * (1 - tolerance), q, delta,
                                    accountant=accountant) > target


@pytest.mark.parametrize("kwargs, message", [
    (dict(target_epsilon=0), r"`target_epsilon` must be in \(0, inf\)"),
    (dict(steps=0), "`steps` must be a positive integer"),
    (dict(sampling_probability=0), r"`sampling_probability` must be in \(0, 1\]"),
    (dict(delta=1), r"`delta` must be in \(0, 1\)"),
    (dict(accountant="gdp"), "`accountant` must be one of"),
    (dict(tolerance=0), r"`tolerance` must be in \(0, 0.5\]"),
    # ε(2^20) ~ sqrt(2 T log(1/δ)) / σ ~ 0.15
    (dict(target_epsilon=0.01, steps=10 ** 9, sampling_probability=1.0),
     "`target_epsilon` 0.01 is not reached by any noise multiplier up to"),
    (dict(target_epsilon=1e6, steps=1),
     r"`target_epsilon` 1e\+06 is reached by every noise multiplier down to"),
])
def test_compute_noise_multiplier_rejects_bad_arguments(kwargs, message):
    arguments = dict(target_epsilon=1.0, steps=10, sampling_probability=0.1, delta=1e-5)
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=f"pertower.compute_noise_multiplier: {message}"):
        pertower.compute_noise_multiplier(**arguments)


def test_public_names_are_exported():
    names = {"DPOptimizer", "compute_epsilon", "compute_noise_multiplier", "tracin",
             "tracin_over_checkpoints", "similarity_matrix", "class_similarity",
             "fisher_diagonal", "gradient_variance", "NoiseScale", "gradient_noise_scale",
             "empirical_ntk"}
    assert names <= set(pertower.__all__)
    assert all(hasattr(pertower, name) for name in names)


# The rules' clipped sums (`test_every_rule_s_clipped_sum_is_the_reweighted_oracle`) are
# checked in tests/test_rules.py, on the graphs and oracle values of its `model` fixture.


def test_microbatch_epsilon_figures_in_the_docs_are_the_accountant_s():
    # docs/dp_and_analytics.md states ε with σ and with TF Privacy's halved σ
    import pathlib, re  # pylint: disable=import-outside-toplevel,multiple-imports
    text = (pathlib.Path(__file__).parents[1] / "docs" / "dp_and_analytics.md").read_text()
    stated = re.search(r"`compute_epsilon` gives\s+ε = ([0-9.]+), and with σ/2 = 0.55 it "
                       r"gives ε = ([0-9.]+)", text)
    assert stated, "the docs no longer state the two figures"
    per_unit = pertower.compute_epsilon(1000, 1.1, 256 / 60000, 1e-5)
    halved = pertower.compute_epsilon(1000, 0.55, 256 / 60000, 1e-5)
    assert float(stated.group(1)) == pytest.approx(per_unit, abs=6e-4)
    assert float(stated.group(2)) == pytest.approx(halved, abs=6e-3)


def test_the_noise_sampler_draws_standard_normal_numbers():
    """`_dp.noise.standard_normal` (Box–Muller): 400,001 draws of one key pass a
    Kolmogorov–Smirnov test against N(0, 1) and have its moments; float64 works; the
    same key gives the same draws, another key others."""
    from pertower._dp import noise as noise_lib  # pylint: disable=import-outside-toplevel
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        key = tf.compat.v1.placeholder(tf.int64, [2])
        n = tf.compat.v1.placeholder(tf.int32, [])
        draws = noise_lib.standard_normal(n, key)
        wide = noise_lib.standard_normal(1001, key, tf.float64)
        z = sess.run(draws, {key: [11, 3], n: 400001}).astype(np.float64)
        again = sess.run(draws, {key: [11, 3], n: 400001})
        other = sess.run(draws, {key: [12, 3], n: 400001})
        z64 = sess.run(wide, {key: [5, 6]})
    assert z.shape == (400001,) and z64.shape == (1001,) and z64.dtype == np.float64
    np.testing.assert_array_equal(z, again)
    assert not np.allclose(z, other)
    assert scipy.stats.kstest(z, "norm").pvalue > 1e-6
    # mean, variance, skewness and excess kurtosis within 6 standard errors of N(0, 1)'s
    size = z.size
    assert abs(z.mean()) < 6 / np.sqrt(size)
    assert abs(z.var() - 1) < 6 * np.sqrt(2 / size)
    assert abs(scipy.stats.skew(z)) < 6 * np.sqrt(6 / size)
    assert abs(scipy.stats.kurtosis(z)) < 6 * np.sqrt(24 / size)
    assert np.isfinite(z).all() and np.abs(z).max() < 6.0

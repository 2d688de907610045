"""The DP modes of issue 19 and per-weight norms, against the one-example loop
`pertower.oracle` or a stated statistical bound.

Per-weight norms (`per_example_norms(..., per_weight=True)`), Poisson batches and the
empty batch, adaptive clipping (Andrew et al. 2021), per-layer clipping (McMahan et
al. 2018), gradient accumulation over several `sess.run` calls, a batch held in a
`tf.Variable`, and the PLD accountant. The noiseless steps are compared with NumPy
references built on the loop's per-example gradients; the noise with chi-square
bounds on its variance.
"""

import numpy as np
import pytest
import scipy.stats
import tensorflow as tf

import pertower
from pertower import oracle
from tests import cases
from tests import common


def _loop_weight_norms(case):
    """[B, K]: the loop's per-example gradient norm of each weight."""
    ys, _, feed = case.oracle()
    grads = common.run_oracle(oracle.loop_per_example_gradients, case.sess, ys, case.xs,
                              feed)                                   # [B, *x.shape] each
    return np.stack([np.sqrt(np.sum(g.reshape(case.B, -1) ** 2, axis=1)) for g in grads],
                    axis=1)


# rules with a cheap squared norm (dense, conv, embedding), formed ones, and weights
# left to towers (mixed_fallback: k2 and scale; mixing_op: every weight)
# (one fast representative; the others are heavy)
_PER_WEIGHT_MODELS = ["mlp"] + [
    pytest.param(name, marks=pytest.mark.heavy) for name in (
        "mixed_fallback", "cnn", "embedding", "dense_sequence", "layer_norm", "mixing_op")]


def _build(name):
    if name in cases.BUILDERS:
        return cases.BUILDERS[name]()
    build, shapes, options, _ = cases.RULE_MODELS[name]
    return cases.build_case(name, build, shapes, **options)


@pytest.mark.filterwarnings("ignore:.*could not prove")
@pytest.mark.parametrize("name", _PER_WEIGHT_MODELS)
def test_per_weight_norms_equal_the_loop(request, name):
    # the mlp: the module's graph (the `mlp` fixture); the others their own
    own = name != "mlp"
    case = _build(name) if own else request.getfixturevalue("mlp")
    with case.graph.as_default():
        results = {}
        for method in ("auto", "towers"):
            per_weight = pertower.per_example_norms(
                case.ys, case.xs, batch=case.batch, batch_size=case.B, method=method,
                per_weight=True)                                          # [B, K]
            assert per_weight.shape.as_list()[1:] == [len(case.xs)]
            results[method] = (per_weight, pertower.per_example_norms(
                case.ys, case.xs, batch=case.batch, batch_size=case.B, method=method))
        results = case.sess.run(results, case.feed)
        want = _loop_weight_norms(case)
    for method, (got, total) in results.items():
        common.assert_all_close([got], [want], kind="deep",
                                what=f"{name} {method} per-weight norms")
        # the [B] norms are the rows' root sum of squares
        common.assert_all_close([np.sqrt(np.sum(got ** 2, axis=1))], [total], kind="deep",
                                what=f"{name} {method} [B] norms")
    if own:
        case.sess.close()


def test_per_weight_must_be_a_bool(mlp):
    with mlp.graph.as_default(), pytest.raises(TypeError, match="`per_weight` must be True"):
        pertower.per_example_norms(mlp.ys, mlp.xs, per_weight="yes")


# ---- DP steps against NumPy references on the loop's per-example gradients ----------

LEARNING_RATE = 0.5


def _slice_feed(feed, rows):
    return {p: v[rows] for p, v in feed.items()}


def _loop_gradients(case, feed=None):
    """[B, *x.shape] per weight, from the one-example loop."""
    with case.graph.as_default():
        return common.run_oracle(oracle.loop_per_example_gradients, case.sess, case.ys,
                                 case.xs, case.feed if feed is None else feed)


def _flat_reference(grads, clip, divisor):
    """NumPy: each example's gradient clipped to global norm `clip`, summed, / divisor."""
    B = grads[0].shape[0]
    norms = np.sqrt(sum(np.sum(g.reshape(B, -1) ** 2, axis=1) for g in grads))   # [B]
    factors = clip / np.maximum(norms, clip)                                     # [B]
    return [(np.tensordot(factors, g, axes=1) / divisor).astype(g.dtype)
            for g in grads], norms


def _run_new(case, fetches, feed):
    """Initializes the variables made since the session's first run, then runs."""
    with case.graph.as_default():
        # one run for all the variables (the module's graph collects the DP states of
        # several tests)
        names = {name.decode() for name in
                 case.sess.run(tf.compat.v1.report_uninitialized_variables())}
        fresh = [v for v in tf.compat.v1.global_variables() if v.op.name in names]
        case.sess.run(tf.compat.v1.variables_initializer(fresh))
    return case.sess.run(fetches, feed)


def _sgd():
    return tf.compat.v1.train.GradientDescentOptimizer(LEARNING_RATE)


def test_per_layer_noiseless_gradient_equals_the_loop(mlp):
    grads = _loop_gradients(mlp)
    B, K = mlp.B, len(mlp.xs)
    norms = np.stack([np.sqrt(np.sum(g.reshape(B, -1) ** 2, axis=1)) for g in grads], 1)
    clips = [float(np.median(norms[:, k])) for k in range(K)]   # some clipped, some not
    assert (norms > np.array(clips) * 1.01).any() and (norms < np.array(clips) * 0.99).any()
    with mlp.graph.as_default():
        listed = pertower.DPOptimizer(_sgd(), l2_norm_clip=clips, noise_multiplier=0.0,
                                      clipping="per_layer")
        split = pertower.DPOptimizer(_sgd(), l2_norm_clip=1.0, noise_multiplier=0.0,
                                     clipping="per_layer")
        got = [[g for g, _ in dp.compute_gradients(mlp.ys, var_list=mlp.xs)]
               for dp in (listed, split)]
        got = mlp.sess.run(got, mlp.feed)
    for run, C in zip(got, (clips, [1.0 / np.sqrt(K)] * K)):
        want = [(np.tensordot(np.minimum(1.0, C[k] / norms[:, k]), g, axes=1) / B)
                .astype(g.dtype) for k, g in enumerate(grads)]
        common.assert_all_close(run, want, kind="deep", what="per-layer DP gradient")


def test_accumulated_steps_equal_one_step_on_the_logical_batch(mlp):
    case = mlp   # the module's graph: its weights as the checks before left them
    with case.graph.as_default():
        grads = _loop_gradients(case)
        clip = 0.8 * float(np.median(_flat_reference(grads, 1.0, 1)[1]))
        want, _ = _flat_reference(grads, clip, case.B)
        step = tf.compat.v1.train.get_or_create_global_step()
        dp = pertower.DPOptimizer(_sgd(), l2_norm_clip=clip, noise_multiplier=0.0,
                                  gradient_accumulation_steps=2)
        train = dp.minimize(case.ys, var_list=case.xs, global_step=step)
        before = case.sess.run(case.xs)
        _run_new(case, train, _slice_feed(case.feed, slice(0, 3)))   # 3 examples
        assert case.sess.run(step) == 0
        common.assert_all_close(case.sess.run(case.xs), before, rtol=0, atol=0,
                                what="weights after the first of two runs")
        case.sess.run(train, _slice_feed(case.feed, slice(3, 4)))     # 1 example
        assert case.sess.run(step) == 1
        after = case.sess.run(case.xs)
        # a third run starts a new step from zeroed accumulators
        assert case.sess.run(dp._step.accumulator.runs) == 0   # pylint: disable=protected-access
    common.assert_all_close([b - a for a, b in zip(after, before)],
                            [LEARNING_RATE * w for w in want], kind="deep",
                            what="one step over two accumulated runs")


def test_an_empty_batch_releases_the_noise_alone(mlp):
    empty = _slice_feed(mlp.feed, slice(0, 0))
    with mlp.graph.as_default():
        noisy = pertower.DPOptimizer(_sgd(), 1.0, 1.0, expected_batch_size=4, seed=3)
        counted = pertower.DPOptimizer(_sgd(), 1.0, 1.0, seed=3)
        silent = pertower.DPOptimizer(_sgd(), 1.0, 0.0)
        before = set(tf.compat.v1.global_variables())
        gradients = [[g for g, _ in dp.compute_gradients(mlp.ys, var_list=mlp.xs)]
                     for dp in (noisy, counted, silent)]
        mlp.sess.run(tf.compat.v1.variables_initializer(   # the noise's seed and counter
            [v for v in tf.compat.v1.global_variables() if v not in before]))
        got = mlp.sess.run(gradients, empty)
    for run in got[:2]:
        flat = np.concatenate([g.ravel() for g in run])
        assert np.all(np.isfinite(flat)) and np.std(flat) > 0.05
    # the same key: the noise / 4 against the noise / max(0, 1)
    common.assert_all_close(got[0], [g / 4 for g in got[1]], what="noise / expected size")
    assert all(np.all(g == 0) for g in got[2])


def test_adaptive_clip_follows_the_geometric_update_and_settles_at_the_quantile(mlp):
    case = mlp   # the module's graph (learning rate 0: this check leaves its weights)
    with case.graph.as_default():
        grads = _loop_gradients(case)
        _, norms = _flat_reference(grads, 1.0, 1)
        clip0 = 2.0 * float(norms.max())                  # every example unclipped
        options = pertower.AdaptiveClipping(target_quantile=0.5, learning_rate=0.2,
                                            count_stddev=0.0)
        dp = pertower.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.0),
                                  l2_norm_clip=clip0, noise_multiplier=0.0,
                                  expected_batch_size=case.B, adaptive_clipping=options)
        grads_and_vars = dp.compute_gradients(case.ys, var_list=case.xs)
        train = dp.apply_gradients(grads_and_vars)
        variable = dp.l2_norm_clip_variable
        assert variable is not None and variable not in tf.compat.v1.trainable_variables()
        got, _ = _run_new(case, [[g for g, _ in grads_and_vars], train], case.feed)
        common.assert_all_close(got, _flat_reference(grads, clip0, case.B)[0], kind="deep",
                                what="the step's gradient clipped with the old C")
        want = clip0 * np.exp(-0.2 * (np.mean(norms <= clip0) - 0.5))
        np.testing.assert_allclose(case.sess.run(variable), want, rtol=1e-5)
        for _ in range(60):   # the weights stay (learning rate 0): C settles
            case.sess.run(train, case.feed)
        clip = case.sess.run(variable)
    ordered = np.sort(norms)
    assert ordered[1] <= clip * (1 + 1e-5) and clip < ordered[2], (clip, ordered)


def _noise_draws(mlp, mode):
    """(noise [R, P] per weight, the expected stddev per weight) of `mode`: a noised
    gradient minus the noiseless one of the same clipping, over R runs."""
    B, K = mlp.B, len(mlp.xs)
    clips = [0.3 + 0.2 * k for k in range(K)]
    sigma, m = 1.3, 8.0
    # σ_b = 0.75: the gradient's σ_Δ = (σ^-2 - 1.5^-2)^(-1/2) = 2.0 σ, a split the
    # bound tells from σ
    adaptive = pertower.AdaptiveClipping(count_stddev=0.75)
    sigma_delta = (sigma ** -2 - 1.5 ** -2) ** -0.5
    modes = {
        "flat_expected": (dict(l2_norm_clip=0.7, expected_batch_size=m),
                          [sigma * 0.7 / m] * K),
        "per_layer": (dict(l2_norm_clip=clips, clipping="per_layer"),
                      [sigma * np.sqrt(K) * c / B for c in clips]),
        "adaptive": (dict(l2_norm_clip=0.7, expected_batch_size=m,
                          adaptive_clipping=adaptive), [sigma_delta * 0.7 / m] * K),
    }
    modes = {mode: modes[mode]}
    draws = {}
    with mlp.graph.as_default():
        fetches = {}
        for mode, (options, _) in modes.items():
            pair = []
            for noise in (sigma, 0.0):
                kept = dict(options)
                if noise == 0.0 and "adaptive_clipping" in kept:
                    kept["adaptive_clipping"] = pertower.AdaptiveClipping(count_stddev=0.75)
                dp = pertower.DPOptimizer(_sgd(), noise_multiplier=noise, seed=7, **kept)
                pair.append([g for g, _ in dp.compute_gradients(mlp.ys, var_list=mlp.xs)])
            fetches[mode] = [a - b for a, b in zip(*pair)]
        _run_new(mlp, [], mlp.feed)
        runs = [mlp.sess.run(fetches, mlp.feed) for _ in range(12)]
    for mode, (_, stddevs) in modes.items():
        draws[mode] = ([np.stack([r[mode][k].ravel() for r in runs]) for k in range(K)],
                       stddevs)
    return draws[mode]


@pytest.mark.parametrize("mode", ["per_layer"] + [
    pytest.param(mode, marks=pytest.mark.heavy) for mode in ("flat_expected", "adaptive")])
def test_noise_stddev_per_weight_within_a_chi_square_bound(mlp, mode):
    """sum z^2 / s^2 ~ chi2(n) for n draws of N(0, s^2); two-sided p >= 1e-6 per weight
    (a stddev off by sqrt(2) or more, e.g. σ for σ_Δ, or without per-layer's sqrt(K),
    falls outside on the larger weights)."""
    noise, stddevs = _noise_draws(mlp, mode)
    for z, s in zip(noise, stddevs):
        n = z.size
        statistic = float(np.sum(z.astype(np.float64) ** 2)) / s ** 2
        low, high = scipy.stats.chi2.ppf([1e-6, 1 - 1e-6], n)
        assert low < statistic < high, (mode, n, statistic / n)


def test_a_variable_holding_the_batch_is_accepted():
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(4)
        rng = np.random.RandomState(4)
        data = tf.Variable(rng.randn(4, 5).astype(np.float32), trainable=False)
        labels = tf.Variable(rng.randn(4, 1).astype(np.float32), trainable=False)
        kernel = cases.random_normal_variable([5, 3], "k_data")
        head = cases.random_normal_variable([3, 1], "h_data")
        def model(x, y):
            return tf.reduce_sum((tf.matmul(tf.tanh(tf.matmul(x, kernel)), head) - y) ** 2,
                                 axis=1)                                           # [B]
        ys = model(data, labels)
        dp = pertower.DPOptimizer(_sgd(), l2_norm_clip=0.5, noise_multiplier=0.0)
        got = [g for g, _ in dp.compute_gradients(ys, var_list=[kernel, head],
                                                  batch=[data, labels])]
        norms = pertower.per_example_norms(ys, [kernel, head], batch=[data, labels],
                                           per_weight=True)                       # [4, 2]
        # the loop: the same model on placeholders fed the variables' values
        x = tf.compat.v1.placeholder(tf.float32, [None, 5])
        y = tf.compat.v1.placeholder(tf.float32, [None, 1])
        loop_ys = model(x, y)
        sess = tf.compat.v1.Session()
        sess.run(tf.compat.v1.global_variables_initializer())
        got, norms, values = sess.run([got, norms, [data, labels]])
        grads = oracle.loop_per_example_gradients(sess, loop_ys, [kernel, head],
                                                  {x: values[0], y: values[1]})
    want, _ = _flat_reference(grads, 0.5, 4)
    common.assert_all_close(got, want, kind="deep", what="DP gradient of a variable batch")
    common.assert_all_close([norms], [np.stack(
        [np.sqrt(np.sum(g.reshape(4, -1) ** 2, axis=1)) for g in grads], 1)], kind="deep",
        what="per-weight norms of a variable batch")
    sess.close()


# ---- Poisson batches -----------------------------------------------------------------

def test_poisson_batches_include_each_example_with_probability_q():
    N, q, steps = 400, 0.05, 300
    ids = np.arange(N)
    labels = ids * 10
    batches = list(pertower.poisson_batches((ids, labels), q, steps=steps, seed=1))
    assert len(batches) == steps
    sizes = np.array([len(b[0]) for b in batches])
    # the mean of T Binomial(N, q) sizes: within 5 standard errors of N q
    assert abs(sizes.mean() - N * q) < 5 * np.sqrt(N * q * (1 - q) / steps)
    for b_ids, b_labels in batches:   # a subset, in order, the arrays kept aligned
        assert np.all(np.diff(b_ids) > 0) and np.array_equal(b_labels, b_ids * 10)
    counts = np.bincount(np.concatenate([b[0] for b in batches]), minlength=N)
    # every example's count is Binomial(T, q): a chi-square over the examples
    expected = steps * q
    statistic = np.sum((counts - expected) ** 2) / (expected * (1 - q))
    assert scipy.stats.chi2.sf(statistic, N - 1) > 1e-6
    # a small q gives empty batches, one array gives arrays, splits cut the same batch
    single = list(pertower.poisson_batches(ids, 0.001, steps=20, seed=2))
    assert any(len(b) == 0 for b in single) and isinstance(single[0], np.ndarray)
    split = list(pertower.poisson_batches(ids, 0.05, steps=5, seed=3, splits=3))
    whole = list(pertower.poisson_batches(ids, 0.05, steps=5, seed=3))
    assert all(len(s) == 3 and np.array_equal(np.concatenate(s), w)
               for s, w in zip(split, whole))
    assert len(list(pertower.poisson_batches(ids, 0.25))) == 4   # one epoch expected


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(arrays=[1, 2], sampling_probability=0.1), TypeError, "`arrays` must be a NumPy"),
    (dict(arrays=(np.zeros(3), np.zeros(4)), sampling_probability=0.1), ValueError,
     "share their first dimension"),
    (dict(arrays=np.zeros(3), sampling_probability=0.0), ValueError,
     "`sampling_probability` must be in"),
    (dict(arrays=np.zeros(3), sampling_probability=0.5, steps=-1), ValueError,
     "`steps` must be a non-negative"),
    (dict(arrays=np.zeros(3), sampling_probability=0.5, splits=0), ValueError,
     "`splits` must be a positive"),
])
def test_poisson_batches_errors_name_the_argument(kwargs, error, message):
    with pytest.raises(error, match=f"pertower.poisson_batches: .*{message}"):
        pertower.poisson_batches(**kwargs)


# ---- options and accounting ----------------------------------------------------------

@pytest.mark.parametrize("kwargs, error, message", [
    (dict(clipping="layer"), ValueError, "`clipping` must be one of"),
    (dict(clipping="per_layer", l2_norm_clip=[]), ValueError, "`l2_norm_clip` is an empty"),
    (dict(clipping="per_layer", l2_norm_clip=[1.0, -1.0]), ValueError,
     r"`l2_norm_clip\[1\]` must be a positive"),
    (dict(expected_batch_size=0), ValueError, "`expected_batch_size` must be a positive"),
    (dict(expected_batch_size=8, num_microbatches=2), ValueError, "leave num_microbatches"),
    (dict(adaptive_clipping=0.5), TypeError, "`adaptive_clipping` must be None or"),
    (dict(adaptive_clipping=pertower.AdaptiveClipping()), ValueError,
     "needs clipping='flat' and `expected_batch_size`"),
    (dict(adaptive_clipping=pertower.AdaptiveClipping(count_stddev=0.5),
          expected_batch_size=8), ValueError, "must exceed noise_multiplier / 2"),
    (dict(gradient_accumulation_steps=0), ValueError,
     "`gradient_accumulation_steps` must be a positive"),
])
def test_dp_mode_options_are_checked(kwargs, error, message):
    options = dict(l2_norm_clip=1.0, noise_multiplier=1.1)
    options.update(kwargs)
    with pytest.raises(error, match=f"pertower.DPOptimizer: .*{message}"):
        pertower.DPOptimizer(_sgd(), **options)
    with pytest.raises(ValueError, match="pertower.AdaptiveClipping: `target_quantile`"):
        pertower.AdaptiveClipping(target_quantile=1.5)


def test_per_layer_clip_count_must_match_the_variables(mlp):
    dp = pertower.DPOptimizer(_sgd(), l2_norm_clip=[1.0, 2.0], noise_multiplier=1.0,
                              clipping="per_layer")
    with mlp.graph.as_default(), pytest.raises(ValueError, match="has 2 clip norms, but "
                                               "var_list has 6"):
        dp.compute_gradients(mlp.ys, var_list=mlp.xs)


# σ = 2 by default: the PLD discretizes a narrower privacy-loss range (~0.2 CPU-s a call
# instead of ~0.9 at σ = 1.1); the heavy case takes a small σ and many steps
@pytest.mark.parametrize("steps, noise, q", [
    (100, 2.0, 0.01), pytest.param(1000, 0.8, 0.004, marks=pytest.mark.heavy)])
def test_pld_epsilon_is_dp_accounting_s_and_below_rdp(steps, noise, q):
    import dp_accounting  # pylint: disable=import-outside-toplevel
    from dp_accounting import pld  # pylint: disable=import-outside-toplevel
    accountant = pld.PLDAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    accountant.compose(dp_accounting.PoissonSampledDpEvent(
        q, dp_accounting.GaussianDpEvent(noise)), steps)
    want = accountant.get_epsilon(1e-5)
    got = pertower.compute_epsilon(steps, noise, q, 1e-5, accountant="pld")
    assert got == pytest.approx(want, rel=1e-9)
    rdp = pertower.compute_epsilon(steps, noise, q, 1e-5)   # the default is unchanged
    assert 0 < got < rdp


@pytest.mark.parametrize("accountant", [
    "rdp", pytest.param("pld", marks=pytest.mark.heavy)])
def test_adaptive_clipping_accounting_composes_the_count(accountant):
    sigma, count_stddev = 1.1, 3.0
    dp = pertower.DPOptimizer(_sgd(), 1.0, sigma, expected_batch_size=60,
                              adaptive_clipping=pertower.AdaptiveClipping(
                                  count_stddev=count_stddev))
    sigma_delta = dp.gradient_noise_multiplier
    assert sigma_delta == pytest.approx((sigma ** -2 - (2 * count_stddev) ** -2) ** -0.5)
    assert dp.clipping_options.count_stddev == count_stddev
    total = pertower.compute_epsilon(300, sigma, 0.02, 1e-5, accountant=accountant)
    split = pertower.compute_epsilon(300, sigma_delta, 0.02, 1e-5, accountant=accountant,
                                     clipped_count_stddev=count_stddev)
    alone = pertower.compute_epsilon(300, sigma_delta, 0.02, 1e-5, accountant=accountant)
    assert split == pytest.approx(total, rel=1e-6) and alone < total
    # the paper's default σ_b = expected_batch_size / 20
    assert pertower.AdaptiveClipping().resolved_count_stddev(60) == 3.0
    with pytest.raises(ValueError, match="pertower.compute_epsilon: `accountant` must be"):
        pertower.compute_epsilon(10, 1.0, 0.1, 1e-5, accountant="gdp")


def test_the_bench_s_dp_overhead_row_is_dp_minus_plain_minus_noise():
    from benchmarks import dp as bench_dp  # pylint: disable=import-outside-toplevel
    entries = [bench_dp.DPEntry("mlp", 8, "plain step", runs_ms=[2.0]),
               bench_dp.DPEntry("mlp", 8, "dp step[auto]", runs_ms=[7.5]),
               bench_dp.DPEntry("mlp", 8, "dp step[auto] σ=0", runs_ms=[6.0]),
               bench_dp.DPEntry("mlp", 8, "noise draw", runs_ms=[1.5]),
               bench_dp.DPEntry("cnn", 4, "plain step", runs_ms=[3.0])]   # no DP rows
    table = bench_dp.format_dp_table(entries)
    rows = [line for line in table.splitlines() if "dp − plain − noise" in line]
    assert len(rows) == 1 and rows[0].split()[-2:] == ["4.0", "2.00"], table

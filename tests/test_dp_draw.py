"""The DP noise draw's quality (`pertower._dp.noise`, issue 19 item 7): its numbers against
N(0, 1) (moments, a chi-square over equiprobable bins, the tails), its symmetry, finite
draws at the extreme Philox words, and its keys (the same key gives the same draws,
different keys independent ones), the same draws on one thread and on thread pools, and
the statistics of its pairs.

Every statistical bound is 6 standard errors of the statistic under N(0, 1) (or a p-value
above 1e-6): a correct draw fails one with probability about 2e-9, and the keys are fixed,
so each test gives the same answer on every run.
"""

import math
import types

import numpy as np
import pytest
import scipy.stats
import tensorflow as tf

from pertower._dp import noise as noise_lib

# the fast representative: 2h = 2^17 draws of one key
N = 2 ** 17
# keys of the independence check: neighbours, one bit apart, and the int64 extremes
KEYS = [[0, 0], [1, 0], [0, 1], [2, 0], [7, 3], [2 ** 62, 0], [-1, -1], [-(2 ** 63), 2 ** 63 - 1]]
# the largest uniform from one 32-bit Philox word ((w >> 9) · 2^-23, w = 2^32 - 1), and
# from two words in float64 (53 bits)
U32_MAX = 1 - 2.0 ** -23
U64_MAX = 1 - 2.0 ** -52


@pytest.fixture(scope="module")
def draw():
    """One graph and session: the draws of a fed key and n (float32, float64), their
    uniforms, and the transform of fed [2, h] uniforms."""
    graph = tf.Graph()
    with graph.as_default():
        key = tf.compat.v1.placeholder(tf.int64, [2])
        n = tf.compat.v1.placeholder(tf.int32, [])
        u32 = tf.compat.v1.placeholder(tf.float32, [2, None])
        u64 = tf.compat.v1.placeholder(tf.float64, [2, None])
        tensors = dict(z=noise_lib.normal_pairs(n, key),
                       z64=noise_lib.normal_pairs(n, key, tf.float64),
                       u=noise_lib.uniform_pairs(n, key), bm32=noise_lib.box_muller(u32),
                       bm64=noise_lib.box_muller(u64))
    sess = tf.compat.v1.Session(graph=graph)

    def run(name, **feed):
        placeholders = dict(key=key, n=n, u32=u32, u64=u64)
        return sess.run(tensors[name], {placeholders[k]: v for k, v in feed.items()})

    yield types.SimpleNamespace(run=run, graph=graph)
    sess.close()


def _check_normal(z, bins=64):
    """Asserts z ~ N(0, 1): mean, variance, skewness and excess kurtosis within 6
    standard errors, a chi-square over `bins` equiprobable bins with p > 1e-6, and the
    counts beyond ±2σ and ±3σ within 6 binomial standard errors."""
    z = z.astype(np.float64)
    size = z.size
    assert np.isfinite(z).all()
    assert abs(z.mean()) < 6 / math.sqrt(size)
    assert abs(z.var() - 1) < 6 * math.sqrt(2 / size)
    assert abs(scipy.stats.skew(z)) < 6 * math.sqrt(6 / size)
    assert abs(scipy.stats.kurtosis(z)) < 6 * math.sqrt(24 / size)
    edges = scipy.stats.norm.ppf(np.linspace(0, 1, bins + 1))              # [bins + 1]
    counts = np.histogram(z, edges)[0]
    assert counts.sum() == size
    assert scipy.stats.chisquare(counts).pvalue > 1e-6
    for t in (2.0, 3.0):
        p = 2 * scipy.stats.norm.sf(t)
        beyond = np.sum(np.abs(z) > t)
        assert abs(beyond - size * p) < 6 * math.sqrt(size * p * (1 - p)), t


def test_the_draws_are_standard_normal(draw):
    z = draw.run("z", key=[11, 5], n=N)
    assert z.shape == (N,) and z.dtype == np.float32
    _check_normal(z)
    # each half (the cosines, the sines) alone too
    for half in np.split(z, 2):
        _check_normal(half, bins=32)


def test_the_draws_are_symmetric(draw):
    """z and -z have one law: as many positive as negative draws (6 binomial standard
    errors), and |z| of the positive draws against |z| of the negative ones
    (two-sample Kolmogorov–Smirnov, p > 1e-6)."""
    z = draw.run("z", key=[3, 8], n=N).astype(np.float64)
    positive, negative = z[z > 0], -z[z < 0]
    assert abs(positive.size - negative.size) < 6 * math.sqrt(z.size)
    assert scipy.stats.ks_2samp(positive, negative).pvalue > 1e-6


def test_the_transform_is_symmetric_on_mirrored_angles(draw):
    """The angle words k and 2^23 - k give the same cosine and opposite sines, and k and
    k + 2^22 (half a turn) opposite draws: the transform itself is symmetric up to the
    rounding of 2π u (a few float32 ulps of r)."""
    rng = np.random.default_rng(0)
    k = np.concatenate([[1, 2, 2 ** 21, 2 ** 22 - 1], rng.integers(1, 2 ** 22, 60)])   # [h]
    radius_words = rng.integers(0, 2 ** 23, k.size)
    u0 = np.tile(radius_words * 2.0 ** -23, 3)                                     # [3h]
    u1 = np.concatenate([k, 2 ** 23 - k, k + 2 ** 22]) * 2.0 ** -23               # [3h]
    z = draw.run("bm32", u32=np.stack([u0, u1]).astype(np.float32)).astype(np.float64)
    cos, sin = np.split(z, 2)                                                      # [3h] each
    (c, c_mirror, c_turn), (s, s_mirror, s_turn) = np.split(cos, 3), np.split(sin, 3)
    tolerance = 4e-6 * 5.65
    np.testing.assert_allclose(c_mirror, c, atol=tolerance)
    np.testing.assert_allclose(s_mirror, -s, atol=tolerance)
    np.testing.assert_allclose(c_turn, -c, atol=tolerance)
    np.testing.assert_allclose(s_turn, -s, atol=tolerance)


@pytest.mark.parametrize("name, largest, dtype", [("bm32", U32_MAX, np.float32),
                                                  ("bm64", U64_MAX, np.float64)])
def test_the_extreme_words_give_finite_draws(draw, name, largest, dtype):
    """Uniforms 0 and the largest one Philox words give (1 - 2^-23 in float32, 1 - 2^-52
    in float64) as u0 and u1: every draw finite; u0 = 0 gives 0; the largest u0 gives
    r = sqrt(-2 ln(1 - u0)), the largest |z| the draw reaches (5.65 / 8.49 σ)."""
    tiny = 1 - largest                                                # the uniforms' spacing
    values = np.array([0.0, tiny, 0.25, 0.5, 0.75, largest])
    u0, u1 = (a.ravel() for a in np.meshgrid(values, values, indexing="ij"))       # [36]
    z = draw.run(name, **{name.replace("bm", "u"): np.stack([u0, u1]).astype(dtype)})
    assert z.dtype == dtype and np.isfinite(z).all()
    cos, sin = np.split(z.astype(np.float64), 2)
    r_max = math.sqrt(-2 * math.log(tiny))
    assert r_max == pytest.approx(5.6467 if dtype == np.float32 else 8.4904, abs=1e-4)
    np.testing.assert_array_equal(cos[u0 == 0], 0.0)
    np.testing.assert_array_equal(sin[u0 == 0], 0.0)
    top = u0 == largest
    np.testing.assert_allclose(np.hypot(cos[top], sin[top]), r_max, rtol=1e-6)
    np.testing.assert_allclose(cos[top & (u1 == 0)], r_max, rtol=1e-6)
    assert np.abs(z).max() <= r_max * (1 + 1e-6)


def test_the_uniforms_are_philox_words_in_0_1(draw):
    """The uniforms the transform gets are multiples of 2^-23 in [0, 1 - 2^-23] (one
    32-bit word each, its 23 high bits), with the mean and variance of U(0, 1)."""
    u = draw.run("u", key=[4, 4], n=N).astype(np.float64)
    assert u.shape == (2, N // 2)
    words = u * 2.0 ** 23
    np.testing.assert_array_equal(words, np.round(words))
    assert u.min() >= 0 and u.max() <= U32_MAX
    assert abs(u.mean() - 0.5) < 6 * math.sqrt(1 / 12 / u.size)
    assert abs(u.var() - 1 / 12) < 6 * math.sqrt(1 / 180 / u.size)


def test_the_same_key_gives_the_same_draws_and_other_keys_independent_ones(draw):
    n = 2 ** 14
    draws = {tuple(k): draw.run("z", key=k, n=n).astype(np.float64) for k in KEYS}
    for k in KEYS:                          # the same key: the same draws, run again
        np.testing.assert_array_equal(draw.run("z", key=k, n=n), draws[tuple(k)])
    # and in a graph of its own
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        again = sess.run(noise_lib.normal_pairs(n, tf.constant(KEYS[4], tf.int64)))
    np.testing.assert_array_equal(again, draws[tuple(KEYS[4])])
    bound = 6 / math.sqrt(n)
    for i, a in enumerate(KEYS):
        for b in KEYS[i + 1:]:
            x, y = draws[tuple(a)], draws[tuple(b)]
            assert np.mean(x == y) < 1e-3, (a, b)
            assert abs(np.corrcoef(x, y)[0, 1]) < bound, (a, b)
            assert abs(np.corrcoef(x ** 2, y ** 2)[0, 1]) < bound, (a, b)


def test_float64_draws_are_computed_in_float64(draw):
    z = draw.run("z64", key=[9, 1], n=2 ** 14)
    assert z.dtype == np.float64
    # float64 draws are not float32 numbers widened
    assert np.mean(z == z.astype(np.float32).astype(np.float64)) < 0.01
    _check_normal(z, bins=16)


@pytest.mark.heavy
@pytest.mark.parametrize("key", [[1, 2], [2 ** 40, 77]])
def test_many_draws_are_standard_normal(draw, key):
    """2^22 draws per key: moments, 256 equiprobable bins, the tails beyond 2σ and 3σ,
    and Kolmogorov–Smirnov; and the count beyond 4σ (expected 266) within 6 standard
    errors."""
    z = draw.run("z", key=key, n=2 ** 22).astype(np.float64)
    _check_normal(z, bins=256)
    assert scipy.stats.kstest(z, "norm").pvalue > 1e-6
    p = 2 * scipy.stats.norm.sf(4.0)
    assert abs(np.sum(np.abs(z) > 4) - z.size * p) < 6 * math.sqrt(z.size * p)
    z64 = draw.run("z64", key=key, n=2 ** 20)
    _check_normal(z64, bins=128)
    assert scipy.stats.kstest(z64, "norm").pvalue > 1e-6


# -- the same draws whatever the thread pools, and the pairs' statistics -----------------

# large enough that TensorFlow shards the Philox op and the elementwise ops over its
# intra-op threads: the draws must not depend on how the work was cut
P = 300_001


@pytest.fixture(scope="module")
def draws_by_config():
    """{(intra, inter): [2h] draws of key [7, 2]} and the draws of key [8, 2] (two threads)."""
    results, other = {}, None
    for intra, inter in [(1, 1), (2, 2), (0, 0)]:
        config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=intra,
                                          inter_op_parallelism_threads=inter)
        with tf.Graph().as_default(), tf.compat.v1.Session(config=config) as sess:
            key = tf.compat.v1.placeholder(tf.int64, [2])
            draws = noise_lib.normal_pairs(P, key)                         # [2h]
            results[(intra, inter)] = sess.run(draws, {key: [7, 2]})
            if intra == 2:
                other = sess.run(draws, {key: [8, 2]})
    return results, other


def test_the_draw_is_the_same_on_one_thread_and_on_a_pool(draws_by_config):
    results, other = draws_by_config
    single = results[(1, 1)]
    assert single.shape == (2 * 150_016,) and single.dtype == np.float32
    for config, draws in results.items():
        np.testing.assert_array_equal(draws, single, err_msg=str(config))
    assert np.mean(other == single) < 1e-3   # another key: other draws


def test_the_draw_s_pairs_are_independent_normals(draws_by_config):
    """The two halves are z0 = r cos(θ), z1 = r sin(θ) of the same pairs: each half is
    N(0, 1), the halves are uncorrelated, and z0² + z1² is χ² with 2 degrees of freedom
    (what a wrong radius or a half paired with the wrong angle would break)."""
    draws = draws_by_config[0][(1, 1)].astype(np.float64)
    z0, z1 = np.split(draws, 2)                                            # [h] each
    for half in (z0, z1):
        assert scipy.stats.kstest(half, "norm").pvalue > 1e-6
    assert abs(np.corrcoef(z0, z1)[0, 1]) < 6 / np.sqrt(z0.size)
    assert abs(np.corrcoef(z0 ** 2, z1 ** 2)[0, 1]) < 6 / np.sqrt(z0.size)
    assert scipy.stats.kstest(z0 ** 2 + z1 ** 2, "chi2", args=(2,)).pvalue > 1e-6

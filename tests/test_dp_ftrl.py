"""DP-FTRL (`pertower.DPFTRLOptimizer`, `pertower._dp.tree`,
`pertower.keras.DPFTRLTreeAggregationOptimizer`): with σ = 0 the FTRL update on the
one-example loop's clipped sums; the tree's noise against the variances it promises;
the optimizer's noise against the tree's stream; a session restored from a checkpoint
continuing an uninterrupted run bit for bit; one worker of DPSyncReplicasOptimizer;
TensorFlow Privacy 0.9.0's DP-FTRL Keras tests that use only its public API, ported.
"""

import os

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import pertower
from pertower import oracle
from pertower._dp import tree as tree_lib
from tests import common

B, LR, CLIP = 4, 0.5, 1.0


def _session(graph):
    sess = tf.compat.v1.Session(graph=graph)
    with graph.as_default():
        sess.run(tf.compat.v1.global_variables_initializer())
    return sess


def _mlp(dtype=tf.float64):
    """x [B, 3] -> softplus(x W0) W1 -> softmax cross-entropy [B]: (graph, x, y, loss, xs)."""
    rng = np.random.RandomState(11)
    weights = [rng.randn(3, 4) * 0.8, rng.randn(4, 2) * 0.8]
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(dtype, [None, 3])
        y = tf.compat.v1.placeholder(tf.int32, [None])
        xs = [tf.compat.v1.get_variable(f"w{k}", initializer=tf.constant(w, dtype))
              for k, w in enumerate(weights)]
        logits = tf.matmul(tf.nn.softplus(tf.matmul(x, xs[0])), xs[1])          # [B, 2]
        loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
    return graph, x, y, loss, xs


def _batches(steps, dtype=np.float64):
    """A fixed order of `steps` batches of B examples (no sampling)."""
    rng = np.random.RandomState(5)
    return [(rng.randn(B, 3).astype(dtype) * 1.5, rng.randint(2, size=B)) for _ in range(steps)]


def _clipped_sum(per_example, clip):
    norms = np.sqrt(sum((g.reshape(len(g), -1) ** 2).sum(1) for g in per_example))
    factors = clip / np.maximum(norms, clip)
    return [np.tensordot(factors, g, axes=1) for g in per_example], norms


@pytest.mark.parametrize("momentum,restart,efficient", [
    (0.0, None, False), (0.75, (2, 1), False), (0.75, (3, None), True)])
def test_noiseless_steps_are_ftrl_on_the_loop_s_clipped_sums(momentum, restart, efficient):
    """σ = 0, 4 steps: θ_t = θ_0 - η m_t / B, m_t = μ m_(t-1) + S_t, S_t the prefix sum of
    the loop's clipped sums (with σ = 0 a restart leaves the path as it is). μ = 0.75 is
    exact in float32, which tf.compat.v1.train.MomentumOptimizer holds it in."""
    graph, x, y, loss, xs = _mlp()
    period, warmup = restart or (None, None)
    with graph.as_default():
        ftrl = pertower.DPFTRLOptimizer(CLIP, 0.0, LR, momentum=momentum,
                                        restart_period=period, restart_warmup=warmup,
                                        efficient_tree=efficient, seed=1)
        train_op = ftrl.minimize(loss, var_list=xs)
        loop = oracle.SliceLoop(loss, xs)
    sess = _session(graph)
    theta0 = sess.run(xs)
    prefix, m, clipped_some = [0, 0], [0, 0], False
    for t, (xb, yb) in enumerate(_batches(4), 1):
        feed = {x: xb, y: yb}
        sums, norms = _clipped_sum(loop.run(sess, feed, B), CLIP)
        clipped_some |= bool((norms > CLIP).any())
        sess.run(train_op, feed)
        prefix = [p + s for p, s in zip(prefix, sums)]
        m = [momentum * a + p for a, p in zip(m, prefix)]
        common.assert_all_close(sess.run(xs), [w - LR * a / B for w, a in zip(theta0, m)],
                                what=f"step {t}", kind="tight")
    assert clipped_some


def _tree_streams(steps, shape, seed, configs, dtype=tf.float64):
    """Per config (TreeNoise's keyword arguments), the residuals (N_t - N_(t-1)) / s of a
    `TreeNoise` on zeros, [steps, *shape]; one graph and session for all."""
    graph = tf.Graph()
    with graph.as_default():
        released = [tree_lib.TreeNoise(seed, **config).add([tf.zeros(shape, dtype)], [1.0])[0]
                    for config in configs]
    sess = _session(graph)
    return list(np.stack([sess.run(released) for _ in range(steps)], axis=1))


def _segments(c, period, warmup):
    """The lengths of the trees that releases 1..c fill (restarts after r = w', w' + p...)."""
    starts = [0] + [r for r in range(1, c) if period and r % period == (warmup or 0)]
    return [end - start for start, end in zip(starts, starts[1:] + [c])]


def test_each_prefix_sum_s_noise_has_the_tree_s_variance():
    """P = 20000 entries, 12 releases, plain and efficient trees, with and without
    restarts: Var(N_c) = sum over the trees so far of popcount (or Honaker's sum of
    1 / (2 - 2^-l)); with the plain tree Cov(N_s, N_t) = the nodes s and t share.
    Seeded, so it cannot flake; the band is 6 standard errors (a sample variance of P
    normals has relative sd sqrt(2 / P))."""
    P, steps = 20000, 12
    configs = [dict(efficient=False), dict(efficient=True),
               dict(efficient=False, restart_period=4, restart_warmup=2),
               dict(efficient=True, restart_period=5)]
    band = 6 * np.sqrt(2.0 / P)
    prefixes = [np.cumsum(r, axis=0) for r in _tree_streams(steps, [P], 3, configs)]
    for config, prefix in zip(configs, prefixes):                             # [steps, P]
        for c in range(1, steps + 1):
            want = sum(tree_lib.prefix_variance(n, config["efficient"]) for n in _segments(
                c, config.get("restart_period"), config.get("restart_warmup")))
            got = prefix[c - 1].var()
            assert abs(got / want - 1) < band, (config, c, got, want)
        assert abs(prefix.mean()) < 6 / np.sqrt(P * steps), config
    prefix = prefixes[0]
    for s, t in [(3, 7), (4, 6), (6, 7), (8, 12), (5, 9)]:
        shared = len(set(tree_lib.prefix_nodes(s)) & set(tree_lib.prefix_nodes(t)))
        got = np.mean(prefix[s - 1] * prefix[t - 1])
        sd = np.sqrt(tree_lib.prefix_variance(s) * tree_lib.prefix_variance(t) / P)
        assert abs(got - shared) < 6 * sd, (s, t, got, shared)


def test_a_restart_starts_fresh_nodes_and_keeps_the_first_tree_s_stream():
    """Releases before the first restart equal the unrestarted tree's (same seed), the
    ones after differ, plain and efficient; the nodes are what `prefix_nodes` says
    (t = 6: levels 2 and 1)."""
    configs = [dict(efficient=e, restart_period=p) for e in (False, True) for p in (None, 3)]
    plain, restarted, efficient, efficient_restarted = _tree_streams(8, [64], 9, configs)
    for a, b in [(plain, restarted), (efficient, efficient_restarted)]:
        np.testing.assert_array_equal(b[:3], a[:3])
        assert not np.isclose(b[3:], a[3:]).any()
    assert tree_lib.prefix_nodes(6) == [(2, 0), (1, 2)]
    assert tree_lib.node_id(0, 3) == 6 and tree_lib.node_id(2, 1) == 11


class _Probe:
    """loss_i = <a_i, v>, v [P]: example i's gradient is a_i whatever v is, so the
    clipped sum is known and each step moves v by it plus the tree's noise."""

    def __init__(self, P=50):
        rng = np.random.RandomState(4)
        self.a = rng.randn(B, P).astype(np.float32) * 0.3      # norms ~2.1 > C
        self.graph = tf.Graph()
        with self.graph.as_default():
            self.placeholder = tf.compat.v1.placeholder(tf.float32, [None, P])
            self.v = tf.compat.v1.get_variable("v", initializer=tf.zeros([P]))
            self.loss = tf.linalg.matvec(self.placeholder, self.v)              # [B]
        self.feed = {self.placeholder: self.a}

    def clipped_sum(self, clip):
        norms = np.linalg.norm(self.a.astype(np.float64), axis=1)
        return (self.a * (clip / np.maximum(norms, clip))[:, None]).sum(axis=0)

    def expected(self, steps, sigma, momentum, seed, **options):
        """v after each step: u_t = μ u_(t-1) + g + σ C r_t, v_t = v_(t-1) - η u_t / B."""
        (residuals,) = _tree_streams(steps, [self.a.shape[1]], seed, [options], tf.float32)
        v, u, path = 0.0, 0.0, []
        for r in residuals:
            u = momentum * u + self.clipped_sum(CLIP) + sigma * CLIP * r
            v = v - LR * u / B
            path.append(v)
        return path


@pytest.mark.parametrize("momentum,efficient,period", [
    pytest.param(0.0, False, None, marks=pytest.mark.heavy), (0.9, True, 3)])
def test_the_optimizer_applies_the_tree_s_noise_once_per_step(momentum, efficient, period):
    """σ = 1.3: each step's update is the clipped sum plus σ C times the tree's residual
    for that step (the stream of a TreeNoise with the same seed), divided by B."""
    probe, steps = _Probe(), 6
    with probe.graph.as_default():
        ftrl = pertower.DPFTRLOptimizer(CLIP, 1.3, LR, momentum=momentum, seed=21,
                                        efficient_tree=efficient, restart_period=period)
        train_op = ftrl.minimize(probe.loss, var_list=[probe.v])
    sess = _session(probe.graph)
    path = []
    for _ in range(steps):
        sess.run(train_op, probe.feed)
        path.append(sess.run(probe.v))
    want = probe.expected(steps, 1.3, momentum, 21, efficient=efficient, restart_period=period)
    common.assert_all_close(path, want, rtol=1e-5, atol=1e-6, what="the noised steps")
    assert sess.run(ftrl.tree.releases) == steps


def _train(efficient, steps, restore=None, save_at=None, directory=None):
    """An MLP trained on the fixed batches with σ = 1, μ = 0.9, restart every 3, seed
    None; restored from `restore` first, or saved after step `save_at`. -> weights."""
    graph, x, y, loss, xs = _mlp(tf.float32)
    with graph.as_default():
        ftrl = pertower.DPFTRLOptimizer(CLIP, 1.0, LR, momentum=0.9, restart_period=3,
                                        efficient_tree=efficient)
        train_op = ftrl.minimize(loss, var_list=xs)
        saver = tf.compat.v1.train.Saver()
    sess = _session(graph)
    batches = _batches(9, np.float32)
    done = 0
    if restore is not None:
        saver.restore(sess, restore)
        done = int(sess.run(ftrl.tree.releases))
    for t in range(done, steps):
        sess.run(train_op, {x: batches[t][0], y: batches[t][1]})
        if t + 1 == save_at:
            path = saver.save(sess, os.path.join(directory, "ftrl"))
    return sess.run(xs), (path if save_at else None)


@pytest.mark.parametrize("efficient", [pytest.param(False, marks=pytest.mark.heavy), True])
def test_a_session_restored_from_a_checkpoint_continues_bit_for_bit(efficient, tmp_path):
    """Saved after step 5 (a restart behind it, the efficient tree's buffer filled),
    restored in a new graph and session, 4 more steps: the same weights, bit for bit,
    as the run that went on (the seed drawn at initialization is in the checkpoint).
    The default run restores the efficient tree (its buffer too); the plain one is heavy."""
    straight, checkpoint = _train(efficient, 9, save_at=5, directory=str(tmp_path))
    resumed, _ = _train(efficient, 9, restore=checkpoint)
    for a, b in zip(straight, resumed):
        np.testing.assert_array_equal(a, b)


def test_an_efficient_tree_whose_buffer_was_not_restored_fails_before_releasing():
    """The release counter restored without the efficient tree's buffer (as a Keras
    weight cannot grow, pertower.keras saves the counter and the seed only): the first
    release that reads a missing level fails, naming the fix, and the weights stay."""
    graph, x, y, loss, xs = _mlp(tf.float32)
    with graph.as_default():
        ftrl = pertower.DPFTRLOptimizer(CLIP, 1.0, LR, efficient_tree=True, seed=3)
        train_op = ftrl.minimize(loss, var_list=xs)
        lost = ftrl.tree.buffer.assign(tf.zeros([0, ftrl.tree.buffer.shape[1]]),
                                       read_value=False)
    sess = _session(graph)
    batches = _batches(4, np.float32)
    for t in range(3):
        sess.run(train_op, {x: batches[t][0], y: batches[t][1]})
    sess.run(lost)                                        # release 4 needs levels 0 and 1
    before = sess.run(xs)
    with pytest.raises(tf.errors.InvalidArgumentError, match="efficient_tree=False"):
        sess.run(train_op, {x: batches[3][0], y: batches[3][1]})
    for a, b in zip(before, sess.run(xs)):
        np.testing.assert_array_equal(a, b)


def _keras_ftrl_model():
    """Dense(2) on [B, 3] with seeded weights, compiled with the efficient tree restarting
    every 4 releases (a buffer of bit_length(4) = 3 rows), σ = 1, a seed."""
    model = keras.Sequential([keras.Input([3]), keras.layers.Dense(
        2, kernel_initializer=keras.initializers.GlorotUniform(seed=7))])
    model.compile(optimizer=pertower.keras.DPFTRLTreeAggregationOptimizer(
        CLIP, 1.0, model, restart_period=4, efficient_tree=True, noise_seed=9,
        learning_rate=LR, momentum=0.9), loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=keras.losses.Reduction.NONE))
    return model


@pytest.mark.parametrize("how", ["save_weights", "h5"])
def test_a_keras_efficient_tree_with_restarts_saved_mid_tree_resumes_bit_for_bit(
        how, tmp_path):
    """restart_period=4 bounds the tree to 3 levels: the buffer is a fixed [3, 2h]
    Keras weight. Saved after step 3 (rows 0 and 1 filled, read by release 4),
    restored in a fresh graph (model.load_weights of a TensorFlow checkpoint, or HDF5
    load_model), 3 more steps: the weights of 6 uninterrupted steps, bit for bit."""
    data = np.random.RandomState(2).randn(6 * B, 3).astype(np.float32) * 1.5
    labels = np.random.RandomState(3).randint(2, size=6 * B)
    fit = dict(batch_size=B, epochs=1, shuffle=False, verbose=0)
    with tf.Graph().as_default():
        model = _keras_ftrl_model()
        model.fit(data, labels, **fit)
        want = model.get_weights()
        buffer = model.optimizer._dp._noise.buffer
        assert buffer.shape.as_list()[0] == 3
        assert any(w is buffer for w in model.optimizer.weights)
    path = str(tmp_path / "model")
    with tf.Graph().as_default():
        model = _keras_ftrl_model()
        model.fit(data[:3 * B], labels[:3 * B], **fit)
        if how == "h5":
            model.save(path + ".h5")
        else:
            model.save_weights(path, save_format="tf")
    with tf.Graph().as_default():
        if how == "h5":
            cls = pertower.keras.DPFTRLTreeAggregationOptimizer
            model = keras.models.load_model(path + ".h5", custom_objects={cls.__name__: cls})
        else:
            model = _keras_ftrl_model()
            model.load_weights(path)
        model.fit(data[3 * B:], labels[3 * B:], **fit)
        sess = tf.compat.v1.keras.backend.get_session()
        assert sess.run(model.optimizer._dp._noise.releases) == 6
        got = model.get_weights()
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a, b)


def test_one_worker_of_sync_replicas_applies_the_tree_s_noise_once_per_global_step():
    """DPSyncReplicasOptimizer around a DPFTRLOptimizer (R = W = 1, a local chief): the
    chief's steps are the single-process DP-FTRL steps."""
    probe, steps = _Probe(), 4
    with probe.graph.as_default():
        ftrl = pertower.DPFTRLOptimizer(CLIP, 1.3, LR, momentum=0.9, seed=21)
        sync = pertower.DPSyncReplicasOptimizer(ftrl, l2_norm_clip=CLIP, noise_multiplier=1.3,
                                                replicas_to_aggregate=1)
        global_step = tf.compat.v1.train.get_or_create_global_step()
        train_op = sync.minimize(probe.loss, var_list=[probe.v], global_step=global_step)
        sess = tf.compat.v1.train.MonitoredSession(
            tf.compat.v1.train.ChiefSessionCreator(),
            hooks=[sync.make_session_run_hook(True)], stop_grace_period_secs=1)
        path = []
        for _ in range(steps):
            sess.run(train_op, probe.feed)
            path.append(sess.run(probe.v))
        releases = sess.run(ftrl.tree.releases)
        sess.close()
    common.assert_all_close(path, probe.expected(steps, 1.3, 0.9, 21), rtol=1e-5, atol=1e-6,
                            what="the chief's steps")
    assert releases == steps
    with probe.graph.as_default(), pytest.raises(ValueError, match=r"noise=\"chief\""):
        pertower.DPSyncReplicasOptimizer(ftrl, CLIP, 1.0, replicas_to_aggregate=1)


@pytest.mark.heavy
@pytest.mark.parametrize("mode", [None, "legacy"])
def test_two_workers_add_the_tree_s_noise_once_per_global_step(mode):
    """tests/scripts/dp_ftrl_cluster.py: a parameter server and two workers, 5 global
    steps against the single-process arithmetic (graph mode, and disable_v2_behavior())."""
    out = common.run_python("tests/scripts/dp_ftrl_cluster.py", *([mode] if mode else []))
    assert "1 passed, 0 failed" in out.stdout, out.stdout


@pytest.mark.parametrize("kwargs,error,words", [
    (dict(restart_warmup=2), ValueError, r"`restart_warmup` \(2\) needs `restart_period`"),
    (dict(restart_period=3, restart_warmup=3), ValueError, r"in \[1, restart_period - 1 = 2\]"),
    (dict(restart_period=0), ValueError, r"`restart_period` must be a positive integer"),
    (dict(momentum=1.0), ValueError, r"`momentum` must be a number in \[0, 1\)"),
    (dict(learning_rate=0.0), ValueError, r"`learning_rate` must be a positive number"),
    (dict(efficient_tree="yes"), TypeError, r"`efficient_tree` must be True or False"),
])
def test_bad_arguments_are_refused_naming_them(kwargs, error, words):
    arguments = dict(l2_norm_clip=1.0, noise_multiplier=1.0, learning_rate=0.1)
    arguments.update(kwargs)
    with pytest.raises(error, match=r"^pertower.DPFTRLOptimizer: .*" + words):
        pertower.DPFTRLOptimizer(**arguments)


def test_public_surface_and_repr():
    ftrl = pertower.DPFTRLOptimizer(1.0, 1.1, 0.1, momentum=0.5, restart_period=4,
                                    restart_warmup=1, seed=3)
    assert "DPFTRLOptimizer" in pertower.__all__
    assert (ftrl.restart_period, ftrl.restart_warmup, ftrl.efficient_tree) == (4, 1, False)
    assert isinstance(ftrl.optimizer, tf.compat.v1.train.MomentumOptimizer)
    assert repr(ftrl).startswith("DPFTRLOptimizer(l2_norm_clip=1.0, noise_multiplier=1.1, "
                                 "learning_rate=0.1, momentum=0.5, restart_period=4")
    assert isinstance(pertower.DPFTRLOptimizer(1.0, 1.0, 0.1).optimizer,
                      tf.compat.v1.train.GradientDescentOptimizer)


# TensorFlow Privacy 0.9.0, privacy/optimizers/dp_optimizer_keras_test.py, its
# DPFTRLTreeAggregationOptimizer tests on the public API, in graph mode.

def _tfp_loss(data0, data1, var0, var1):
    """0.5 ||d0_i - var0||² + 0.5 ||d1_i - var1||², [4]: mean gradients var - mean(d)."""
    return (0.5 * tf.reduce_sum(tf.math.squared_difference(data0, var0), axis=1)
            + 0.5 * tf.reduce_sum(tf.math.squared_difference(data1, var1), axis=1))


@pytest.mark.parametrize("num_microbatches,restart_period,restart_warmup", [
    (1, None, None), pytest.param(2, 2, 1, marks=pytest.mark.heavy),
    pytest.param(4, 1, None, marks=pytest.mark.heavy), (4, 4, 2)])
def test_tfp_baseline_with_tensor_loss_no_noise(num_microbatches, restart_period,
                                                restart_warmup):
    """TFP's testBaselineWithTensorLossNoNoise: the gradients are [-2.5, -2.5], [-0.5]."""
    with tf.Graph().as_default():
        var0, var1 = tf.Variable([1.0, 2.0]), tf.Variable([3.0])
        data0 = tf.compat.v1.placeholder(tf.float32, [None, 2])
        data1 = tf.compat.v1.placeholder(tf.float32, [None, 1])
        feed = {data0: [[3.0, 4.0], [5.0, 6.0], [7.0, 8.0], [-1.0, 0.0]],
                data1: [[8.0], [2.0], [3.0], [1.0]]}
        opt = pertower.keras.DPFTRLTreeAggregationOptimizer(
            l2_norm_clip=100.0, noise_multiplier=0.0, var_list_or_model=[var0, var1],
            num_microbatches=num_microbatches, restart_period=restart_period,
            restart_warmup=restart_warmup, learning_rate=2.0)
        grads = opt.get_gradients(_tfp_loss(data0, data1, var0, var1), [var0, var1])
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            got = sess.run(grads, feed)
    common.assert_all_close(got, [np.array([-2.5, -2.5]), np.array([-0.5])], kind="tight")


def test_tfp_large_batch_emulation_no_noise():
    """TFP's testLargeBatchEmulationNoNoise: with gradient_accumulation_steps=2 the
    weights move on every second step, by the mean of the two batches' gradients."""
    with tf.Graph().as_default():
        var0 = tf.Variable([[1.0, 2.0]])
        var1 = tf.Variable([3.0])
        x = tf.compat.v1.placeholder(tf.float32, [None, 2])
        loss = tf.reduce_sum(x * var0, axis=1) + var1           # [B], var0 x_i^T + var1
        x1, x2 = [[2.0, 0.0], [0.0, 1.0]], [[4.0, 2.0], [2.0, 1.0]]
        opt = pertower.keras.DPFTRLTreeAggregationOptimizer(
            l2_norm_clip=100.0, noise_multiplier=0.0, gradient_accumulation_steps=2,
            var_list_or_model=[var0, var1], learning_rate=1.0)
        sess = tf.compat.v1.keras.backend.get_session()
        sess.run(tf.compat.v1.global_variables_initializer())
        train_op = opt.minimize(loss, [var0, var1])
        for fed, want0, want1 in [(x1, [[1.0, 2.0]], [3.0]), (x2, [[-1.0, 1.0]], [2.0]),
                                  (x2, [[-1.0, 1.0]], [2.0]), (x2, [[-4.0, -0.5]], [1.0])]:
            sess.run(train_op, {x: fed})
            common.assert_all_close(sess.run([var0, var1]), [np.array(want0), np.array(want1)],
                                    kind="tight")


@pytest.mark.parametrize("num_microbatches,restart_period,restart_warmup", [
    pytest.param(1, None, None, marks=pytest.mark.heavy), (4, 4, 2)])
def test_tfp_linear_regression_fit_no_noise(num_microbatches, restart_period, restart_warmup):
    """TFP's testBaselineNoNoise (an Estimator there, model.fit here): 125 steps of 8
    examples at learning rate 0.05 on 0.5 (y - p)² (0.025 on Keras' (y - p)²) find the
    weights and bias within 0.05."""
    rng = np.random.RandomState(0)
    true_weights = np.array([[-5], [4], [3], [2]], np.float32)
    data = rng.normal(scale=3.0, size=(1000, 4)).astype(np.float32)
    labels = data @ true_weights + 6.0
    with tf.Graph().as_default():
        layer = keras.layers.Dense(1, kernel_initializer="zeros", bias_initializer="zeros")
        model = keras.Sequential([keras.Input([4]), layer])
        opt = pertower.keras.DPFTRLTreeAggregationOptimizer(
            l2_norm_clip=100.0, noise_multiplier=0.0, var_list_or_model=model,
            num_microbatches=num_microbatches, restart_period=restart_period,
            restart_warmup=restart_warmup, learning_rate=0.025)
        model.compile(optimizer=opt, loss=keras.losses.MeanSquaredError(
            reduction=keras.losses.Reduction.NONE))
        model.fit(data, labels, batch_size=8, epochs=1, shuffle=False, verbose=0)
        kernel, bias = layer.get_weights()
    common.assert_all_close([kernel, bias], [true_weights, np.array([6.0])], rtol=0, atol=0.05)


def test_keras_fit_with_noise_counts_one_release_per_step_and_round_trips_its_config():
    """σ = 1 and restarts: fit makes and initializes the tree's variables, one release
    per step; get_config holds TensorFlow Privacy's arguments."""
    rng = np.random.RandomState(1)
    data = rng.randn(32, 3).astype(np.float32)
    labels = rng.randint(2, size=32)
    with tf.Graph().as_default():
        model = keras.Sequential([keras.Input([3]), keras.layers.Dense(2)])
        opt = pertower.keras.DPFTRLTreeAggregationOptimizer(
            1.0, 1.0, model, restart_period=3, restart_warmup=1, noise_seed=4,
            learning_rate=0.1, momentum=0.9)
        model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=keras.losses.Reduction.NONE))
        before = model.get_weights()
        model.fit(data, labels, batch_size=8, epochs=2, shuffle=False, verbose=0)
        releases = tf.compat.v1.keras.backend.get_session().run(opt._dp._noise.releases)
        config = opt.get_config()
        again = pertower.keras.DPFTRLTreeAggregationOptimizer.from_config(config)
    assert releases == 8
    assert not np.allclose(model.get_weights()[0], before[0])
    assert (config["noise_seed"], config["restart_period"], config["restart_warmup"],
            config["efficient_tree"], config["momentum"]) == (4, 3, 1, True, 0.9)
    assert again.get_config() == config


def test_keras_gradient_accumulation_with_noise_releases_once_per_logical_step():
    """gradient_accumulation_steps=2, σ = 1: the weights move on every second run and
    the tree counts one release per move (the noise is drawn in the k-th run's branch)."""
    with tf.Graph().as_default():
        var0, var1 = tf.Variable([[1.0, 2.0]]), tf.Variable([3.0])
        x = tf.compat.v1.placeholder(tf.float32, [None, 2])
        loss = tf.reduce_sum(x * var0, axis=1) + var1                             # [B]
        opt = pertower.keras.DPFTRLTreeAggregationOptimizer(
            1.0, 1.0, None, gradient_accumulation_steps=2, noise_seed=3, learning_rate=1.0)
        sess = tf.compat.v1.keras.backend.get_session()
        sess.run(tf.compat.v1.global_variables_initializer())
        train_op = opt.minimize(loss, [var0, var1])
        seen = []
        for _ in range(4):
            sess.run(train_op, {x: [[2.0, 0.0], [0.0, 1.0]]})
            seen.append((sess.run(var0).copy(), int(sess.run(opt._dp._noise.releases))))
    assert [r for _, r in seen] == [0, 1, 1, 2]
    np.testing.assert_array_equal(seen[0][0], [[1.0, 2.0]])
    np.testing.assert_array_equal(seen[2][0], seen[1][0])
    assert not np.array_equal(seen[1][0], seen[0][0]) and not np.array_equal(seen[3][0],
                                                                             seen[2][0])

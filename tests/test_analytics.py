"""Gradient analytics against NumPy formulas applied to the oracle loop's gradients.

One module-scoped graph: two "checkpoints" (two Keras MLPs of the same shape, or one
MLP saved, changed and saved again), each applied to a training batch (x_a, y_a) of
5 examples and a test batch (x_b, y_b) of 3. pertower's analytics run on pertower's
per-example gradients; the references are NumPy formulas on the one-example loop's.
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import pertower
from pertower import oracle
from tests import common

B_A, B_B, K = 5, 3, 3


class Model:
    """One checkpoint: an MLP, its per-example losses and outputs on both batches."""

    def __init__(self, graph_inputs, seed):
        x_a, y_a, x_b, y_b = graph_inputs
        common.seed_weights(seed)
        self.net = keras.Sequential([keras.layers.Dense(4, activation="tanh"),
                                     keras.layers.Dense(K)])
        self.out_a, self.out_b = self.net(x_a), self.net(x_b)             # [B, K]
        self.loss_a = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y_a,
                                                                     logits=self.out_a)
        self.loss_b = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y_b,
                                                                     logits=self.out_b)
        self.xs = list(self.net.trainable_weights)
        self.grads_a = pertower.per_example_gradients(self.loss_a, self.xs, batch_size=B_A)
        self.grads_b = pertower.per_example_gradients(self.loss_b, self.xs, batch_size=B_B)
        self.jac_a = pertower.per_example_jacobians(self.out_a, self.xs, batch_size=B_A)
        self.jac_b = pertower.per_example_jacobians(self.out_b, self.xs, batch_size=B_B)
        # the loop's values at the weights the model was built with, each computed once
        self.oracles = common.OracleCache()


@pytest.fixture(scope="module")
def setup():
    graph = tf.Graph()
    with graph.as_default():
        x_a = tf.compat.v1.placeholder(tf.float32, [None, 4], name="x_a")
        y_a = tf.compat.v1.placeholder(tf.int32, [None], name="y_a")
        x_b = tf.compat.v1.placeholder(tf.float32, [None, 4], name="x_b")
        y_b = tf.compat.v1.placeholder(tf.int32, [None], name="y_b")
        inputs = (x_a, y_a, x_b, y_b)
        models = [Model(inputs, seed) for seed in (11, 12)]
        sess = tf.compat.v1.Session(graph=graph)
        sess.run(tf.compat.v1.global_variables_initializer())
    rng = np.random.RandomState(7)
    feed_a = {x_a: rng.randn(B_A, 4).astype(np.float32), y_a: rng.randint(0, K, B_A)}
    feed_b = {x_b: rng.randn(B_B, 4).astype(np.float32), y_b: rng.randint(0, K, B_B)}
    yield graph, sess, models, feed_a, feed_b
    sess.close()


def _oracle(sess, model, feed_a, feed_b, initial_weights=True):
    """The one-example loop's per-example gradients [B, *x.shape] and Jacobians, flattened
    to [B, P] and [B, K, P]. With `initial_weights` (the model's weights as initialized)
    the loops run once per model (`model.oracles`); pass False after changing them."""
    loop = model.oracles.run if initial_weights else common.run_oracle
    ga = loop(oracle.loop_per_example_gradients, sess, model.loss_a, model.xs, feed_a)
    gb = loop(oracle.loop_per_example_gradients, sess, model.loss_b, model.xs, feed_b)
    ja = loop(oracle.loop_per_example_jacobians, sess, model.out_a, model.xs, feed_a)
    jb = loop(oracle.loop_per_example_jacobians, sess, model.out_b, model.xs, feed_b)
    flat = lambda g, lead: np.concatenate([x.reshape(lead + [-1]) for x in g], axis=-1)
    return dict(ga=ga, gb=gb, Ga=flat(ga, [B_A]), Gb=flat(gb, [B_B]),
                Ja=flat(ja, [B_A, K]), Jb=flat(jb, [B_B, K]))


def _run(setup, fetches):
    graph, sess, _, feed_a, feed_b = setup
    with graph.as_default():
        return sess.run(fetches, {**feed_a, **feed_b})


def test_tracin_sums_learning_rate_times_dot_products_over_checkpoints(setup):
    graph, sess, models, feed_a, feed_b = setup
    with graph.as_default():
        refs = [_oracle(sess, m, feed_a, feed_b) for m in models]
        one = pertower.tracin(models[0].grads_a, models[0].grads_b, learning_rates=0.3)
        both = pertower.tracin([m.grads_a for m in models], [m.grads_b for m in models],
                               learning_rates=[0.3, 0.05])
    got_one, got_both = _run(setup, [one, both])
    want_one = 0.3 * refs[0]["Ga"] @ refs[0]["Gb"].T                   # [B_A, B_B]
    want_both = want_one + 0.05 * refs[1]["Ga"] @ refs[1]["Gb"].T
    common.assert_all_close([got_one, got_both], [want_one, want_both], kind="tight", what="tracin")
    assert got_both.shape == (B_A, B_B)


def test_tracin_over_saved_checkpoints(setup, tmp_path):
    graph, sess, models, feed_a, feed_b = setup
    model = models[0]
    with graph.as_default():
        saver = tf.compat.v1.train.Saver(model.xs)
        original = sess.run(model.xs)
        paths, wants = [], []
        for c, rate in enumerate([0.2, 0.1]):
            if c:
                for v, value in zip(model.xs, original):
                    v.load(value * 1.5 + 0.1, sess)
            paths.append(saver.save(sess, str(tmp_path / f"ckpt_{c}")))
            ref = _oracle(sess, model, feed_a, feed_b, initial_weights=not c)
            wants.append(rate * ref["Ga"] @ ref["Gb"].T)
        scores = pertower.tracin(model.grads_a, model.grads_b)
        got = pertower.tracin_over_checkpoints(sess, scores, paths, [0.2, 0.1], saver,
                                               {**feed_a, **feed_b})
        # a list of feeds: each checkpoint restored once, one result per feed
        restored = []
        listed = pertower.tracin_over_checkpoints(
            sess, scores, paths, [0.2, 0.1],
            lambda s, path: (restored.append(path), saver.restore(s, path)),
            [{**feed_a, **feed_b}, {**feed_a, **feed_b}])
        for v, value in zip(model.xs, original):
            v.load(value, sess)
    common.assert_all_close([got] + listed, [wants[0] + wants[1]] * 3, kind="tight",
                            what="tracin checkpoints")
    assert restored == paths


def test_similarity_matrices(setup):
    graph, sess, models, feed_a, feed_b = setup
    model = models[0]
    with graph.as_default():
        ref = _oracle(sess, model, feed_a, feed_b)
        fetches = [pertower.similarity_matrix(model.grads_a, model.grads_b, metric="dot"),
                   pertower.similarity_matrix(model.grads_a, model.grads_b),
                   pertower.similarity_matrix(model.grads_a)]
    Ga, Gb = ref["Ga"], ref["Gb"]
    na, nb = np.linalg.norm(Ga, axis=1), np.linalg.norm(Gb, axis=1)
    want = [Ga @ Gb.T, Ga @ Gb.T / np.outer(na, nb), Ga @ Ga.T / np.outer(na, na)]
    common.assert_all_close(_run(setup, fetches), want, kind="tight", what="similarity")


def test_class_similarity_averages_class_blocks():
    rng = np.random.RandomState(3)
    S = rng.randn(7, 6)
    S_square = rng.randn(7, 7)
    labels_a, labels_b = np.array([0, 1, 1, 2, 0, 2, 2]), np.array([2, 0, 1, 1, 0, 2])
    with tf.Graph().as_default():
        cross = pertower.class_similarity(tf.constant(S), labels_a, 3, labels_b=labels_b)
        within = pertower.class_similarity(tf.constant(S_square), labels_a, 3)
        with tf.compat.v1.Session() as sess:
            got = sess.run([cross, within])
    want_cross = np.array([[S[np.ix_(labels_a == c, labels_b == d)].mean() for d in range(3)]
                           for c in range(3)])
    want_within = np.zeros((3, 3))
    for c in range(3):
        for d in range(3):
            pairs = [S_square[i, j] for i in range(7) for j in range(7)
                     if i != j and labels_a[i] == c and labels_a[j] == d]
            want_within[c, d] = np.mean(pairs)
    common.assert_all_close(got, [want_cross, want_within], 1e-12, 1e-12, "class similarity")


def test_fisher_diagonal_and_gradient_variance(setup):
    graph, sess, models, feed_a, feed_b = setup
    model = models[0]
    with graph.as_default():
        ref = _oracle(sess, model, feed_a, feed_b)
        fisher = pertower.fisher_diagonal(model.grads_a)
        variance = pertower.gradient_variance(model.grads_a)
    got_fisher, got_variance = _run(setup, [fisher, variance])
    common.assert_all_close(got_fisher, [np.mean(g ** 2, axis=0) for g in ref["ga"]],
                            kind="tight", what="Fisher diagonal")
    common.assert_all_close(got_variance, [np.var(g, axis=0, ddof=1) for g in ref["ga"]],
                            kind="tight", what="gradient variance")


def test_gradient_noise_scale_matches_the_two_batch_estimators(setup):
    graph, sess, models, feed_a, feed_b = setup
    model = models[0]
    with graph.as_default():
        ref = _oracle(sess, model, feed_a, feed_b)
        scale = pertower.gradient_noise_scale(model.grads_a)
    got = _run(setup, [scale.trace_covariance, scale.squared_norm, scale.simple_noise_scale])
    # McCandlish et al. 2018, Appendix A.1, with B_small = 1 (each example) and B_big = B
    G = ref["Ga"].astype(np.float64)
    small = np.mean(np.sum(G ** 2, axis=1))            # mean |g_i|^2
    big = np.sum(G.mean(axis=0) ** 2)                  # |ḡ|^2
    squared_norm = (B_A * big - small) / (B_A - 1)
    trace = (small - big) / (1 - 1 / B_A)
    common.assert_all_close(got, [trace, squared_norm, trace / squared_norm], 1e-4, 1e-6,
                            "noise scale")
    np.testing.assert_allclose(got[0], np.sum(np.var(G, axis=0, ddof=1)), rtol=1e-4)


def test_gradient_noise_scale_estimates_are_unbiased_on_known_gaussians():
    # per-example gradients drawn from N(G, diag(s^2)): E[estimates] = |G|^2 and tr(Σ)
    rng = np.random.RandomState(0)
    G, s = np.array([1.0, -2.0, 0.5]), np.array([3.0, 1.0, 2.0])
    draws = G + s * rng.randn(400, 4, 3)                  # 400 batches of B = 4
    with tf.Graph().as_default():
        g = tf.compat.v1.placeholder(tf.float64, [4, 3])
        scale = pertower.gradient_noise_scale([g])
        with tf.compat.v1.Session() as sess:
            values = np.array([sess.run([scale.trace_covariance, scale.squared_norm],
                                        {g: batch}) for batch in draws])
    # 400 batches: standard errors from the sample; 5 of them bound the mean's distance
    means, errors = values.mean(axis=0), values.std(axis=0, ddof=1) / np.sqrt(len(values))
    assert abs(means[0] - np.sum(s ** 2)) < 5 * errors[0], (means, errors)
    assert abs(means[1] - np.sum(G ** 2)) < 5 * errors[1], (means, errors)


def test_empirical_ntk_is_the_gram_of_flattened_jacobians(setup):
    graph, sess, models, feed_a, feed_b = setup
    model = models[0]
    with graph.as_default():
        ref = _oracle(sess, model, feed_a, feed_b)
        fetches = [pertower.empirical_ntk(model.jac_a), pertower.empirical_ntk(model.jac_a,
                                                                               model.jac_b),
                   pertower.empirical_ntk(model.grads_a, model.grads_b, output_rank=0)]
    Ja, Jb = ref["Ja"], ref["Jb"]
    want = [np.einsum("akp,blp->akbl", Ja, Ja), np.einsum("akp,blp->akbl", Ja, Jb),
            ref["Ga"] @ ref["Gb"].T]
    got = _run(setup, fetches)
    common.assert_all_close(got, want, kind="tight", what="empirical NTK")
    assert got[1].shape == (B_A, K, B_B, K)


def test_analytics_errors_name_the_argument(setup):
    graph, _, models, _, _ = setup
    model = models[0]
    with graph.as_default():
        with pytest.raises(ValueError, match="`metric` must be 'cosine' or 'dot'"):
            pertower.similarity_matrix(model.grads_a, metric="l2")
        with pytest.raises(ValueError, match="`learning_rates` is a sequence"):
            pertower.tracin(model.grads_a, model.grads_b, learning_rates=[0.1, 0.2])
        with pytest.raises(ValueError, match="`learning_rates` must be a sequence of 2"):
            pertower.tracin([model.grads_a] * 2, [model.grads_b] * 2, learning_rates=0.1)
        with pytest.raises(ValueError, match="one of `train_gradients` and `test_gradients`"):
            pertower.tracin([model.grads_a], model.grads_b, learning_rates=[0.1])
        with pytest.raises(ValueError, match="has 2 checkpoints but `test_gradients` has 1"):
            pertower.tracin([model.grads_a] * 2, [model.grads_b], learning_rates=[0.1, 0.2])
        with pytest.raises(ValueError, match="`output_rank` must be a non-negative integer"):
            pertower.empirical_ntk(model.jac_a, output_rank=-1)
        with pytest.raises(ValueError, match="with output_rank=3"):
            pertower.empirical_ntk(model.grads_a[1:], output_rank=3)
        with pytest.raises(ValueError, match="`similarity` must be a \\[B_a, B_b\\] matrix"):
            pertower.class_similarity(tf.zeros([3]), [0, 1, 2], 3)
        with pytest.raises(ValueError, match="`num_classes` must be a positive integer"):
            pertower.class_similarity(tf.zeros([3, 3]), [0, 1, 2], 0)
        with pytest.raises(ValueError, match="need at least 2 examples"):
            pertower.gradient_noise_scale([tf.zeros([1, 3])])
        with pytest.raises(ValueError, match="per_example_gradients\\[0\\]` is a scalar"):
            pertower.fisher_diagonal([tf.zeros([])])
        with pytest.raises(ValueError, match="2 checkpoints but 1 learning rates"):
            pertower.tracin_over_checkpoints(None, None, ["a", "b"], [0.1], lambda s, c: None)

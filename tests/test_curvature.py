"""Curvature: `pertower.sum_grad_squared` and `pertower.diag_ggn` against loops of plain
tf.gradients over examples and columns, against tf.hessians where the GGN equals the
Hessian, and the Monte-Carlo estimate against the exact value within a statistical bound.

Notation: B examples, K logits, M columns, S [M, B, K] a factor of the loss Hessian H.

The reference GGN diagonal of example n is sum_c (J_n^T s_c)^2 with s_c the columns of
a square root of H_n computed here in NumPy from its eigendecomposition (so it shares
nothing with `pertower._curvature.loss_hessian`), each J_n^T s_c one `tf.gradients` of
the logits with grad_ys = s_c, run on example n alone.
"""

import numpy as np
import pytest
import tensorflow as tf

import pertower
from pertower import oracle
from pertower._curvature import columns as columns_lib
from pertower._curvature import loss_hessian
from tests import common

LOSSES = ("softmax_cross_entropy", "sigmoid_cross_entropy", "mse")
B = 4


numpy_hessian = common.numpy_hessian


def numpy_columns(H):
    """[K, K] whose columns s_c satisfy sum_c s_c s_c^T = H (symmetric square root)."""
    w, V = np.linalg.eigh(H)
    return V * np.sqrt(np.clip(w, 0, None))


class Model:
    """A graph with an MLP (a shared weight, a weight read by ClipByValue: no rule) and a conv net,
    its session and batch, and the loop references (built once per logits)."""

    def __init__(self):
        rng = np.random.RandomState(0)
        self.graph = tf.Graph()
        with self.graph.as_default():
            v = lambda shape, name: tf.Variable(rng.randn(*shape) * 0.5, name=name)
            self.x = tf.compat.v1.placeholder(tf.float64, [None, 5], name="x")
            self.labels = tf.compat.v1.placeholder(tf.int32, [None], name="labels")
            self.W1, self.b1 = v([5, 6], "W1"), v([6], "b1")
            self.Wsh = v([6, 6], "Wsh")
            self.W2, self.b2 = v([6, 3], "W2"), v([3], "b2")
            self.V = tf.Variable(np.float64(rng.randn() * 0.5), name="V")
            bound = 0.5 + tf.square(tf.sin(self.V))                          # []
            h = tf.nn.relu(tf.nn.bias_add(self.x @ self.W1, self.b1))        # [B, 6]
            # piecewise linear in each of W1, b1, W2, b2 taken alone: GGN = Hessian there
            self.relu_logits = tf.nn.bias_add(h @ self.W2, self.b2)          # [B, 3]
            shared = tf.nn.relu(h @ self.Wsh) @ self.Wsh                     # two uses
            self.logits = (self.relu_logits + shared @ self.W2 * 0.5 + tf.reduce_sum(
                tf.raw_ops.ClipByValue(t=self.x, clip_value_min=-bound, clip_value_max=bound),
                axis=1, keepdims=True))                                      # [B, 3]
            self.xs = [self.W1, self.b1, self.Wsh, self.W2, self.b2, self.V]
            self.loss = tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=self.labels, logits=self.logits)                     # [B]
            self.image = tf.compat.v1.placeholder(tf.float64, [None, 5, 5, 2], name="image")
            self.kernel, self.conv_bias = v([3, 3, 2, 3], "kernel"), v([3], "conv_bias")
            self.dense = v([75, 4], "dense")
            c = tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(self.image, self.kernel, 1, "SAME"),
                                          self.conv_bias))                  # [B, 5, 5, 3]
            self.conv_logits = tf.reshape(c, [-1, 75]) @ self.dense        # [B, 4]
            self.conv_xs = [self.kernel, self.conv_bias, self.dense]
            self.conv_loss = tf.reduce_sum(tf.square(self.conv_logits), axis=1)  # [B]
            # a dense layer on sequences (Tensordot: Reshape + MatMul, k = 3 rows per
            # example) and one whose kernel is stored transposed
            self.seq = tf.compat.v1.placeholder(tf.float64, [None, 3, 2], name="seq")
            self.Ws, self.Wt = v([2, 4], "Ws"), v([3, 4], "Wt")
            rows = tf.reshape(tf.reshape(self.seq, [-1, 2]) @ self.Ws, [-1, 3, 4])
            self.seq_logits = tf.matmul(tf.reduce_mean(tf.tanh(rows), axis=1), self.Wt,
                                        transpose_b=True)                   # [B, 3]
            self.seq_xs = [self.Ws, self.Wt]
            self.seq_loss = tf.reduce_sum(tf.sin(self.seq_logits), axis=1)  # [B]
            self.sess = tf.compat.v1.Session(graph=self.graph)
            self.sess.run(tf.compat.v1.global_variables_initializer())
        self.feed = {self.x: rng.randn(B, 5), self.labels: np.array([0, 2, 1, 2]),
                     self.image: rng.randn(B, 5, 5, 2), self.seq: rng.randn(B, 3, 2)}
        self._loops = {}

    def run(self, tensors):
        return self.sess.run(tensors, self.feed)

    def loop_ggn(self, logits, xs, loss):
        """[B, *x.shape] per x: each example's sum_c (J_n^T s_c)^2, one tf.gradients run
        per example and column."""
        key = (logits.name, tuple(x.name for x in xs))
        if key not in self._loops:
            with self.graph.as_default():
                grad_ys = tf.compat.v1.placeholder(logits.dtype, [1, logits.shape[1]])
                grads = tf.gradients(logits, xs, grad_ys=grad_ys)
                grads = [tf.zeros_like(x) if g is None else tf.convert_to_tensor(g)
                         for g, x in zip(grads, xs)]
            self._loops[key] = grad_ys, grads
        grad_ys, grads = self._loops[key]
        per_example = []
        for feed in oracle.slice_feeds(self.feed, None, B):
            f = self.sess.run(logits, feed)[0]                              # [K]
            S = numpy_columns(numpy_hessian(loss, f))                       # [K, K]
            total = [np.zeros(x.shape.as_list()) for x in xs]
            for c in range(S.shape[1]):
                values = self.sess.run(grads, {**feed, grad_ys: S[:, c][None]})
                total = [t + g ** 2 for t, g in zip(total, values)]
            per_example.append(total)
        return [np.stack([e[j] for e in per_example]) for j in range(len(xs))]

    def mc_moments(self, logits, xs, loss):
        """(mean, variance) per x, [*x.shape], of the one-column Monte-Carlo estimate
        sum_n (J_n^T s_n)^2 with s_n drawn independently per example: softmax s = p - e_y,
        y ~ Cat(p) (K outcomes); sigmoid s = p - y, y_k ~ Bernoulli(p_k) (2^K outcomes),
        enumerated; mse s = sqrt(2) eps, eps ~ N(0, I): (a . s)^2 = 2 |a|^2 chi^2_1, mean
        2 |a|^2, variance 8 |a|^4 with a_k = J_n[k] entry by entry."""
        self.loop_ggn(logits, xs, loss)   # builds the gradient ops
        grad_ys, grads = self._loops[(logits.name, tuple(x.name for x in xs))]
        K = logits.shape[1]
        mean = [np.zeros(x.shape.as_list()) for x in xs]
        variance = [np.zeros(x.shape.as_list()) for x in xs]
        for feed in oracle.slice_feeds(self.feed, None, B):
            f = self.sess.run(logits, feed)[0]
            if loss == "mse":
                rows = [self.sess.run(grads, {**feed, grad_ys: np.eye(K)[k][None]})
                        for k in range(K)]                                  # J_n[k]
                for j in range(len(xs)):
                    a2 = sum(r[j] ** 2 for r in rows)                       # |a|^2
                    mean[j] += 2 * a2
                    variance[j] += 8 * a2 ** 2
                continue
            if loss == "softmax_cross_entropy":
                p = np.exp(f - f.max())
                p /= p.sum()
                outcomes = [(p[y], p - np.eye(K)[y]) for y in range(K)]
            else:
                p = 1 / (1 + np.exp(-f))
                labels = np.array(np.meshgrid(*[[0, 1]] * K)).reshape(K, -1).T   # [2^K, K]
                outcomes = [(np.prod(np.where(y, p, 1 - p)), p - y) for y in labels]
            first = [np.zeros(x.shape.as_list()) for x in xs]
            second = [np.zeros(x.shape.as_list()) for x in xs]
            for probability, column in outcomes:
                values = self.sess.run(grads, {**feed, grad_ys: column[None]})
                for j, g in enumerate(values):
                    first[j] += probability * g ** 2
                    second[j] += probability * g ** 4
            for j in range(len(xs)):
                mean[j] += first[j]
                variance[j] += second[j] - first[j] ** 2
        return mean, variance


@pytest.fixture(scope="module")
def model():
    m = Model()
    yield m
    m.sess.close()


def _build(model, function, *args, **kwargs):
    with model.graph.as_default():
        return function(*args, **kwargs)


@pytest.mark.parametrize("loss", [
    "softmax_cross_entropy", pytest.param("sigmoid_cross_entropy", marks=pytest.mark.heavy),
    pytest.param("mse", marks=pytest.mark.heavy)])
def test_diag_ggn_exact_matches_loop_over_examples_and_columns(model, loss):
    result = _build(model, pertower.diag_ggn, model.logits, model.xs, loss=loss,
                    batch_size=B)
    want = model.loop_ggn(model.logits, model.xs, loss)
    common.assert_all_close(model.run(list(result)), [w.sum(0) for w in want],
                            what=f"diag_ggn({loss})")
    assert result.routes[0].startswith("rules, cheap form")        # W1: dense
    assert result.routes[2].startswith("rules, per column")        # Wsh: two uses
    assert result.routes[5].startswith("towers: per-example Jacobians")   # V: ClipByValue
    assert result.columns_vectorized is True


def test_diag_ggn_per_example_matches_loop(model):
    result = _build(model, pertower.diag_ggn, model.logits, model.xs, per_example=True,
                    batch_size=B)
    want = model.loop_ggn(model.logits, model.xs, "softmax_cross_entropy")
    common.assert_all_close(model.run(list(result)), want, what="diag_ggn(per_example)")


def test_diag_ggn_conv_net_matches_loop(model):
    # per example (the summed value is the same contraction, reduced over examples)
    result = _build(model, pertower.diag_ggn, model.conv_logits, model.conv_xs,
                    per_example=True, batch_size=B)
    want = model.loop_ggn(model.conv_logits, model.conv_xs, "softmax_cross_entropy")
    common.assert_all_close(model.run(list(result)), want, kind="deep",
                            what="conv diag_ggn(per_example=True)")
    assert result.routes[0].startswith("rules, cheap form")   # Conv2D: columns in one call


@pytest.mark.parametrize("loss", [
    pytest.param("softmax_cross_entropy", marks=pytest.mark.heavy), "sigmoid_cross_entropy",
    pytest.param("mse", marks=pytest.mark.heavy)])
def test_diag_ggn_equals_hessian_where_the_network_is_piecewise_linear(model, loss):
    # logits are piecewise linear in each of W1, b1, W2, b2 alone, so d^2 f / dw^2 = 0 and
    # the Hessian of sum_n l(f_n) restricted to one weight is exactly its GGN block
    xs = [model.W1, model.b1, model.W2, model.b2]
    with model.graph.as_default():
        f = model.relu_logits
        targets = tf.constant(np.random.RandomState(1).rand(B, 3))   # any labels: H ignores them
        if loss == "softmax_cross_entropy":
            total = tf.reduce_sum(tf.nn.softmax_cross_entropy_with_logits(
                tf.one_hot(model.labels, 3, dtype=tf.float64), f))
        elif loss == "sigmoid_cross_entropy":
            total = tf.reduce_sum(tf.nn.sigmoid_cross_entropy_with_logits(targets, f))
        else:
            total = tf.reduce_sum(tf.square(f - targets))
        hessians = [tf.reshape(tf.linalg.diag_part(tf.reshape(
            h, [x.shape.num_elements()] * 2)), x.shape) for h, x in zip(
                tf.hessians(total, xs), xs)]
        result = pertower.diag_ggn(f, xs, loss=loss, batch_size=B)
    got, want = model.run([list(result), hessians])
    common.assert_all_close(got, want, what=f"diag_ggn vs tf.hessians ({loss})")


def test_diag_ggn_sequence_and_transposed_dense_match_loop(model):
    result = _build(model, pertower.diag_ggn, model.seq_logits, model.seq_xs,
                    loss="mse", batch_size=B)
    want = model.loop_ggn(model.seq_logits, model.seq_xs, "mse")
    common.assert_all_close(model.run(list(result)), [w.sum(0) for w in want],
                            what="sequence diag_ggn")
    assert [r.split(":")[0] for r in result.routes] == ["rules, per column",  # k = 3
                                                        "rules, cheap form"]  # transpose_b


# the conv net heavy: sum_grad_squared on convolutions (and a dense layer's cheap form:
# the mlp's routes) is checked against the loop by tests/test_curvature_convs.py
@pytest.mark.parametrize("net", ["mlp", "seq", pytest.param("conv", marks=pytest.mark.heavy)])
def test_sum_grad_squared_matches_loop(model, net):
    ys, xs = {"mlp": (model.loss, model.xs), "seq": (model.seq_loss, model.seq_xs),
              "conv": (model.conv_loss, model.conv_xs)}[net]
    result = _build(model, pertower.sum_grad_squared, ys, xs, batch_size=B)
    with model.graph.as_default():
        per_example = oracle.loop_per_example_gradients(model.sess, ys, xs, model.feed)
    common.assert_all_close(model.run(list(result)),
                            [np.square(g).sum(0) for g in per_example], kind="deep",
                            what=f"sum_grad_squared({ys.name})")
    if net == "mlp":   # the routes of its weights
        assert [r.split(":")[0] for r in result.routes] == [
            "rules, cheap form", "rules, cheap form", "rules, per column",
            "rules, per column", "rules, cheap form", "towers"]
        assert "ClipByValue" in result.routes[5] and "W1" in result.explain()
    if net == "conv":
        assert result.routes[2].startswith("rules, cheap form")    # the dense layer


def test_monte_carlo_is_unbiased_within_a_stated_bound(model):
    # each run draws new labels (seed=None); the mean of R runs against the exact value
    R = 30
    result = _build(model, pertower.diag_ggn, model.logits, model.xs[:3], mc_samples=2,
                    batch_size=B)
    draws = [model.run(list(result)) for _ in range(R)]
    _check_unbiased(model, model.logits, model.xs[:3], "softmax_cross_entropy", draws, 2)


def _check_unbiased(model, logits, xs, loss, draws, M):
    """Per entry, |mean of the R draws - exact| <= 6 sqrt(Var / (M R)) (+ a float floor),
    with Var the exact variance of the one-column estimator (`Model.mc_moments`): a
    6-sigma bound of the central limit theorem, not a variance estimated from the draws
    (which misses rare labels and is too small for skewed draws). The exact mean from the
    enumeration must also equal the loop's exact GGN diagonal."""
    R = len(draws)
    mean, variance = model.mc_moments(logits, xs, loss)
    exact = [w.sum(0) for w in model.loop_ggn(logits, xs, loss)]
    common.assert_all_close(mean, exact, what=f"E[one-column estimate] ({loss})")
    for j, want in enumerate(exact):
        samples = np.stack([d[j] for d in draws])                           # [R, *x]
        bound = 6 * np.sqrt(variance[j] / (M * R)) + 1e-9 * (1 + np.abs(want))
        off = np.abs(samples.mean(0) - want)
        assert (off <= bound).all(), (f"weight {j}: {(off > bound).sum()} entries off by "
                                      f"more than 6 sigma; worst {(off - bound).max():.3g}")
        assert (samples.std(0) > 0).any()   # the draws do vary (not the exact value)


@pytest.mark.heavy
@pytest.mark.parametrize("loss", LOSSES)
def test_monte_carlo_many_seeds_heavy(model, loss):
    R = 400
    for logits, xs in ((model.logits, model.xs), (model.conv_logits, model.conv_xs)):
        result = _build(model, pertower.diag_ggn, logits, xs, loss=loss, mc_samples=1,
                        batch_size=B)
        draws = [model.run(list(result)) for _ in range(R)]
        _check_unbiased(model, logits, xs, loss, draws, 1)


def test_monte_carlo_seed_is_reproducible(model):
    a = _build(model, pertower.diag_ggn, model.logits, model.xs[:1], mc_samples=3, seed=7,
               batch_size=B)
    c = _build(model, pertower.diag_ggn, model.logits, model.xs[:1], mc_samples=3, seed=8,
               batch_size=B)
    va, vc = model.run([a[0], c[0]])
    vb = model.run(a[0])   # stateless draws: the same seed, the same labels in every run
    np.testing.assert_array_equal(va, vb)
    assert not np.array_equal(va, vc)


@pytest.mark.parametrize("loss", LOSSES)
def test_hessian_factor_squares_to_the_loss_hessian(model, loss):
    with model.graph.as_default():
        S = loss_hessian.hessian_factor(model.logits, loss)
        S_mc = loss_hessian.hessian_factor(model.logits, loss, mc_samples=4, seed=1)
    S_value, f, S_mc_value = model.run([S, model.logits, S_mc])
    # the softmax Hessian has rank K - 1: K - 1 exact columns
    M = 2 if loss == "softmax_cross_entropy" else 3
    assert S_value.shape == (M, B, 3) and S_mc_value.shape == (4, B, 3)
    assert S.shape.as_list() == [M, None, 3]
    for n in range(B):
        np.testing.assert_allclose(S_value[:, n].T @ S_value[:, n],
                                   numpy_hessian(loss, f[n]), atol=1e-12)


def test_columns_fall_back_to_a_loop_when_pfor_cannot_convert(model):
    with model.graph.as_default():
        @tf.custom_gradient
        def python_sin(z):
            y = tf.numpy_function(np.sin, [z], tf.float64)
            y.set_shape(z.shape)

            def grad(dy):
                g = tf.numpy_function(lambda a, b: np.cos(a) * b, [z, dy], tf.float64)
                g.set_shape(z.shape)
                return g
            return y, grad

        Z = model.x @ model.W1[:, :3]                                      # [B, 3]
        logits = python_sin(Z)
        S = loss_hessian.hessian_factor(logits, "mse", mc_samples=2, seed=0)
        found = columns_lib.output_gradient_columns(logits, [Z, model.image], S)
    assert found.vectorized is False and "PyFunc" in found.reason
    dZ, unreached, Z_value, S_value = model.run([found[0], found[1], Z, S])
    np.testing.assert_allclose(dZ, np.cos(Z_value)[None] * S_value, atol=1e-12)
    assert unreached.shape == (2, B, 5, 5, 2) and not unreached.any()


@pytest.mark.parametrize("kwargs, error, text", [
    (dict(loss="cross_entropy"), ValueError, "`loss` must be one of"),
    (dict(mc_samples=0), ValueError, "`mc_samples` must be None"),
    (dict(mc_samples=1.5), ValueError, "`mc_samples` must be None"),
    (dict(mc_samples=True), ValueError, "`mc_samples` must be None"),
    (dict(per_example="yes"), TypeError, "`per_example` must be True or False"),
    (dict(mc_samples=1, seed="7"), TypeError, "`seed` must be an int"),
])
def test_diag_ggn_argument_errors(model, kwargs, error, text):
    with pytest.raises(error, match=f"pertower.diag_ggn: {text}"):
        _build(model, pertower.diag_ggn, model.logits, model.xs[:1], batch_size=B, **kwargs)


def test_diag_ggn_refuses_logits_that_are_not_b_by_k(model):
    with pytest.raises(ValueError, match=r"pertower.diag_ggn: `logits` must be a \[B, K\]"):
        _build(model, pertower.diag_ggn, model.loss, model.xs[:1], batch_size=B)
    with pytest.raises(TypeError, match="pertower.diag_ggn: `logits` must be a tf.Tensor"):
        _build(model, pertower.diag_ggn, [[1.0]], model.xs[:1], batch_size=B)
    with pytest.raises(ValueError, match="pertower.sum_grad_squared: `xs` is empty"):
        _build(model, pertower.sum_grad_squared, model.loss, [], batch_size=B)


def test_curvature_functions_are_public():
    assert {"sum_grad_squared", "diag_ggn"} <= set(pertower.__all__)
    assert pertower.diag_ggn.__module__ == "pertower._api.curvature"
    assert pertower.sum_grad_squared.__module__ == "pertower._api.curvature"

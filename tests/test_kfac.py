"""pertower.kfac_factors against loops of plain tf.gradients over examples and classes.

The reference never uses pertower's columns: it takes the Jacobian of every logit with
respect to the layer's weight or output, one `tf.gradients` call per (example, class),
and the loss Hessian H_n = diag(p_n) - p_n p_n^T in numpy, so that
    exact GGN block of W at B = 1   = J_W^T H J_W               (KFLR must equal it)
    G  = (1/|T|) sum_{n, positions} J_Z^T H_n J_Z                 (any factor S S^T = H)
    A  = (1/B) sum_{n, positions} a a^T                          (numpy, patches by hand)
"""

import warnings

import numpy as np
import pytest
import tensorflow as tf

import pertower
from tests.common import assert_all_close

B = 3          # examples of the batch checks
K = 4          # classes of the MLP


def _softmax_hessians(logits):
    """[B, K, K]: diag(p) - p p^T per example."""
    z = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    return np.stack([np.diag(q) - np.outer(q, q) for q in p]), p


def _jacobian_rows(logits, target, batch):
    """[[B, K, *target.shape[1:]] tensors]: d logits[n, c] / d target[n], a loop of
    tf.gradients over examples and classes."""
    rows = []
    for n in range(batch):
        per_class = [tf.gradients(logits[n, c], target)[0][n] for c in range(logits.shape[1])]
        rows.append(tf.stack(per_class))
    return tf.stack(rows)


class Graphs:
    """The module's graph: an MLP, a linear model and a small CNN, float64."""

    def __init__(self):
        rng = np.random.RandomState(7)
        self.graph = tf.Graph()
        with self.graph.as_default():
            var = lambda *shape: tf.Variable(rng.randn(*shape) * 0.7)   # noqa: E731
            self.x = tf.compat.v1.placeholder(tf.float64, [None, 5])
            self.W1, self.b1, self.W2, self.b2 = var(5, 6), var(6), var(6, K), var(K)
            self.Z1 = tf.matmul(self.x, self.W1)
            self.h = tf.tanh(self.Z1 + self.b1)
            self.Z2 = tf.matmul(self.h, self.W2)
            self.logits = self.Z2 + self.b2                               # [B, 4]
            self.W0 = var(5, 3)
            self.linear = tf.matmul(self.x, self.W0)                      # [B, 3]
            self.Wt = var(3, 5)                                           # stored [d_out, d_in]
            self.transposed = tf.matmul(self.x, self.Wt, transpose_b=True)  # [B, 3]
            self.xs = tf.compat.v1.placeholder(tf.float64, [B, 2, 5])     # k = 2 rows
            self.Ws = var(5, 3)
            self.Zs = tf.matmul(tf.reshape(self.xs, [-1, 5]), self.Ws)    # [B*2, 3]
            self.sequence = tf.reduce_sum(tf.tanh(tf.reshape(self.Zs, [B, 2, 3])), axis=1)
            self.xc = tf.compat.v1.placeholder(tf.float64, [None, 5, 5, 2])
            self.F = var(3, 3, 2, 3)
            self.Zc = tf.nn.conv2d(self.xc, self.F, strides=2, padding="SAME")   # [B, 3, 3, 3]
            self.Wc = var(27, 3)
            self.conv_logits = tf.matmul(tf.reshape(tf.nn.relu(self.Zc), [-1, 27]), self.Wc)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                self.mlp = pertower.kfac_factors(self.logits, [self.W1, self.b1, self.W2,
                                                               self.b2])
            self.mlp_warnings = [str(w.message) for w in caught]
            self.lin = pertower.kfac_factors(self.linear, self.W0)
            self.tr = pertower.kfac_factors(self.transposed, self.Wt)
            self.seq = pertower.kfac_factors(self.sequence, self.Ws)
            self.jac_tr = tf.stack([tf.reshape(tf.gradients(self.transposed[0, c], self.Wt)[0],
                                               [-1]) for c in range(3)])
            self.jac_Zs = tf.stack([tf.stack([tf.gradients(self.sequence[n, c], self.Zs)[0]
                                              [2 * n:2 * n + 2] for c in range(3)])
                                    for n in range(B)])                  # [B, K, 2, 3]
            self.conv = pertower.kfac_factors(self.conv_logits, [self.F, self.Wc])
            self.mc = pertower.kfac_factors(self.logits, [self.W1, self.W2], mc_samples=400,
                                            seed=3)
            # the loop's references
            self.jac_W = [tf.stack([tf.reshape(tf.gradients(self.logits[0, c], W)[0], [-1])
                                    for c in range(K)]) for W in (self.W1, self.W2)]
            self.jac_lin = tf.stack([tf.reshape(tf.gradients(self.linear[0, c], self.W0)[0],
                                                [-1]) for c in range(3)])
            self.jac_Z = [_jacobian_rows(self.logits, Z, B) for Z in (self.Z1, self.Z2)]
            self.jac_Zc = _jacobian_rows(self.conv_logits, self.Zc, B)   # [B, 3, 3, 3, 3]
            self.sess = tf.compat.v1.Session(graph=self.graph)
            self.sess.run(tf.compat.v1.global_variables_initializer())
        self.X = rng.randn(B, 5)
        self.XC = rng.randn(B, 5, 5, 2)
        self.XS = rng.randn(B, 2, 5)


@pytest.fixture(scope="module")
def graphs():
    built = Graphs()
    yield built
    built.sess.close()


def _ggn_from_jacobians(jacobians, hessians):
    """sum_n J_n^T H_n J_n for J [B, K, d] (rows of positions folded into n)."""
    return np.einsum("nci,ncd,ndj->ij", jacobians, hessians, jacobians)


def test_kflr_equals_the_exact_ggn_block_at_one_example(graphs):
    """B = 1: kron(A, G) is the GGN block J^T H J of every dense kernel (both MLP
    layers, the linear model with its own loss over 3 logits)."""
    g = graphs
    feed = {g.x: g.X[:1]}
    (mlp, lin, jac_W, jac_lin, logits, linear) = g.sess.run(
        ([g.mlp[0], g.mlp[2]], g.lin, g.jac_W, g.jac_lin, g.logits, g.linear),
        feed)
    H, _ = _softmax_hessians(logits)
    H_lin, _ = _softmax_hessians(linear)
    got = [np.kron(*mlp[0]), np.kron(*mlp[1]), np.kron(*lin[0])]
    want = [J.T @ H[0] @ J for J in jac_W] + [jac_lin.T @ H_lin[0] @ jac_lin]
    assert [w.shape for w in got] == [(30, 30), (24, 24), (15, 15)]
    assert np.abs(want[1]).max() > 1e-3   # a block that is not trivially zero
    assert_all_close(got, want, what="kron(A, G) at B = 1 vs the exact GGN block")


def test_factors_of_a_batch_match_the_loop(graphs):
    """B = 3: A = (1/B) sum_n a a^T over the inputs, G = sum_n J_n^T H_n J_n over the
    output gradients, for both MLP layers; the biases get None."""
    g = graphs
    feed = {g.x: g.X}
    assert g.mlp[1] is None and g.mlp[3] is None
    mlp, h, logits, jac_Z = g.sess.run(([g.mlp[0], g.mlp[2]], g.h, g.logits, g.jac_Z), feed)
    H, _ = _softmax_hessians(logits)
    got = [mlp[0].A, mlp[0].G, mlp[1].A, mlp[1].G]
    want = [g.X.T @ g.X / B, _ggn_from_jacobians(jac_Z[0], H),
            h.T @ h / B, _ggn_from_jacobians(jac_Z[1], H)]
    assert_all_close(got, want, what="A and G at B = 3 vs the loop")


def test_transposed_kernel_and_rows_per_example(graphs):
    """MatMul with transpose_b (kernel stored [d_out, d_in]): kron(G, A) is the exact
    GGN block of the stored kernel at B = 1. A dense layer read with k = 2 rows per
    example: A = (1/B) sum over the rows, G = (1/k) sum over examples and rows of
    J^T H J (KFAC-expand)."""
    g = graphs
    tr, jac, logits = g.sess.run((g.tr[0], g.jac_tr, g.transposed), {g.x: g.X[:1]})
    H, _ = _softmax_hessians(logits)
    seq, jac_s, seq_logits = g.sess.run((g.seq[0], g.jac_Zs, g.sequence), {g.xs: g.XS})
    H_s, _ = _softmax_hessians(seq_logits)
    rows = g.XS.reshape(-1, 5)
    G = np.einsum("nctp,ncd,ndtq->pq", jac_s, H_s, jac_s) / 2
    assert_all_close([np.kron(tr.G, tr.A), seq.A, seq.G],
                     [jac.T @ H[0] @ jac, rows.T @ rows / B, G],
                     what="transposed kernel at B = 1; k = 2 rows per example")


def _patches(images, k, stride):
    """[B, Ho*Wo, k*k*C] SAME patches in the filter's order (u, v, c), by hand."""
    n, size, _, c = images.shape
    out = -(-size // stride)
    pad = max((out - 1) * stride + k - size, 0)
    padded = np.pad(images, [(0, 0), (pad // 2, pad - pad // 2), (pad // 2, pad - pad // 2),
                             (0, 0)])
    rows = [padded[:, i * stride:i * stride + k, j * stride:j * stride + k, :].reshape(n, -1)
            for i in range(out) for j in range(out)]
    return np.stack(rows, axis=1)


def test_convolution_factors_are_kfc(graphs):
    """Conv2D (3x3, stride 2, SAME, 2 -> 3 channels): A over the patches extracted in
    numpy, G = (1/|T|) sum over examples and positions of J^T H J; the dense layer after
    it, read once, gets its own KFLR factors."""
    g = graphs
    conv, logits, jac, Zc = g.sess.run((g.conv, g.conv_logits, g.jac_Zc, g.Zc), {g.xc: g.XC})
    H, _ = _softmax_hessians(logits)
    P = _patches(g.XC, 3, 2)                                    # [B, 9, 18]
    positions = P.shape[1]
    A = np.einsum("npi,npj->ij", P, P) / B
    jac = jac.reshape(B, 3, positions, 3)                       # [B, K, |T|, Cout]
    G = np.einsum("ncpi,ncd,ndpj->ij", jac, H, jac) / positions
    relu = np.maximum(Zc, 0).reshape(B, -1)
    assert_all_close([conv[0].A, conv[0].G, conv[1].A], [A, G, relu.T @ relu / B],
                     what="KFC factors vs numpy patches and the loop", kind="deep")


def _mc_bound(jacobians, probabilities, samples):
    """(mean, standard deviation) of G from `samples` sampled columns per example:
    each column (p - e_y)/sqrt(M), y ~ p, gives J^T (p - e_y)(p - e_y)^T J / M; the
    mean over y is J^T H J, the variance is summed over the independent examples."""
    mean, variance = 0.0, 0.0
    for J, p in zip(jacobians, probabilities):
        outcomes = [J.T @ np.outer(p - e, p - e) @ J for e in np.eye(len(p))]
        m = sum(q * o for q, o in zip(p, outcomes))
        mean = mean + m
        variance = variance + sum(q * (o - m) ** 2 for q, o in zip(p, outcomes))
    return mean, np.sqrt(variance / samples)


def test_monte_carlo_factors_within_five_standard_deviations(graphs):
    """mc_samples=400 (KFAC): A is exact, G within 5 standard deviations (computed
    from the exact distribution of the sampled labels) of the exact G, per entry."""
    g = graphs
    mc, logits, jac_Z = g.sess.run((g.mc, g.logits, g.jac_Z), {g.x: g.X})
    _, p = _softmax_hessians(logits)
    for layer, jac, A in zip(mc, jac_Z, (g.X.T @ g.X / B, None)):
        mean, sd = _mc_bound(jac, p, 400)
        assert np.all(np.abs(layer.G - mean) <= 5 * sd + 1e-12), (layer.G, mean, sd)
        assert np.abs(layer.G - mean).max() > 0   # sampled, not the exact value
        if A is not None:
            assert_all_close([layer.A], [A], what="A of the Monte-Carlo factors")


@pytest.mark.heavy
def test_one_sample_kfac_is_unbiased_over_many_draws(graphs):
    """mc_samples=1 with fresh labels each run: the mean of 400 runs of G is within 5
    standard deviations of the exact G (the 400 runs as 400 samples)."""
    g = graphs
    with g.graph.as_default():
        one = pertower.kfac_factors(g.logits, [g.W2], mc_samples=1)[0].G
    runs = [g.sess.run(one, {g.x: g.X}) for _ in range(400)]
    logits, jac_Z = g.sess.run((g.logits, g.jac_Z), {g.x: g.X})
    _, p = _softmax_hessians(logits)
    mean, sd = _mc_bound(jac_Z[1], p, 400)
    assert np.all(np.abs(np.mean(runs, axis=0) - mean) <= 5 * sd + 1e-12)


def test_bias_gets_none_with_a_warning_naming_it(graphs):
    """The biases get None, and one warning names each with why and what to use."""
    g = graphs
    assert len(graphs.mlp_warnings) == 1, graphs.mlp_warnings
    text = graphs.mlp_warnings[0]
    assert text.startswith("pertower.kfac_factors: no Kronecker factors (None)")
    for bias in (g.b1, g.b2):
        assert bias.name in text
    assert text.count("not a kernel") == 2 and "pertower.diag_ggn" in text


def test_grouped_and_depthwise_filters_get_none_with_their_reasons():
    """A grouped Conv2D filter (the conv rule's `kfac_rows` says why) and a depthwise
    filter (no Kronecker rows) get None, each named in the warning with its reason."""
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 5, 5, 4])
        grouped = tf.Variable(tf.ones([3, 3, 2, 4]), name="grouped")
        depthwise = tf.Variable(tf.ones([3, 3, 4, 1]), name="depthwise")
        z = tf.nn.conv2d(x, grouped, strides=1, padding="SAME")          # 2 groups
        z = tf.nn.depthwise_conv2d(z, depthwise, [1, 1, 1, 1], "SAME")
        logits = tf.reduce_sum(z, axis=[1, 2])                          # [B, 4]
        with pytest.warns(UserWarning) as caught:
            factors = pertower.kfac_factors(logits, [grouped, depthwise])
    assert factors == [None, None]
    text = " ".join(str(w.message) for w in caught)
    assert "is a grouped convolution (2 groups)" in text
    assert "(DepthwiseConv2dNative); Kronecker factors are built for" in text


def test_keras_layers_and_bad_arguments():
    """tf_keras Dense: the kernel gets factors of its shapes, the BiasAdd bias None with a
    warning; a bad `loss` or `mc_samples` is refused naming the argument."""
    import tf_keras  # pylint: disable=import-outside-toplevel
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 4])
        layer = tf_keras.layers.Dense(3)
        logits = layer(x)
        with pytest.warns(UserWarning, match="BiasAdd"):
            kernel, bias = pertower.kfac_factors(logits, layer.trainable_weights)
        assert bias is None
        assert kernel.A.shape == (4, 4) and kernel.G.shape == (3, 3)
        with pytest.raises(ValueError, match="`loss` must be one of"):
            pertower.kfac_factors(logits, layer.kernel, loss="hinge")
        with pytest.raises(ValueError, match="`mc_samples` must be None"):
            pertower.kfac_factors(logits, layer.kernel, mc_samples=0)


def test_digits_laplace_example_writes_its_plot(tmp_path, capsys):
    """examples/digits_laplace.py --quick (run in this process through its `main`, like
    tests/test_digits_examples.py): its own check against the loop passes, it prints
    one line per predictor and writes the PNG."""
    import importlib.util  # pylint: disable=import-outside-toplevel
    import pathlib  # pylint: disable=import-outside-toplevel
    import re  # pylint: disable=import-outside-toplevel
    script = pathlib.Path(__file__).resolve().parents[1] / "examples" / "digits_laplace.py"
    spec = importlib.util.spec_from_file_location("digits_laplace", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    output = tmp_path / "laplace.png"
    capsys.readouterr()
    assert module.main(["--quick", "--samples", "20", "--output", str(output)]) == 0
    out = capsys.readouterr().out
    assert "OK: KFLR at one image equals the exact GGN block of the loop" in out, out
    for label in ("trained network (MAP)", "Laplace, diagonal (diag_ggn)",
                  "Laplace, Kronecker (kfac_factors)"):
        assert re.search(re.escape(label) + r" +test accuracy 0\.\d+  test NLL \d", out), out
    assert f"saved {output}" in out and output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_curvature_options_and_table(monkeypatch):
    """`python -m benchmarks --curvature --peers-python P` parses; the peers' Python is the
    option, else $PERTOWER_PEERS_PYTHON, else this interpreter; the table divides by
    TensorFlow's batch gradient of the same model and B. No torch needed."""
    import sys  # pylint: disable=import-outside-toplevel
    from benchmarks import command  # pylint: disable=import-outside-toplevel
    from benchmarks import peers_curvature  # pylint: disable=import-outside-toplevel
    args = command.build_parser().parse_args(["--curvature", "--peers-python", "/v/python"])
    assert args.curvature and args.peers_python == "/v/python"
    monkeypatch.delenv("PERTOWER_PEERS_PYTHON", raising=False)
    assert peers_curvature.peers_python() == sys.executable
    monkeypatch.setenv("PERTOWER_PEERS_PYTHON", "/env/python")
    assert peers_curvature.peers_python() == "/env/python"
    assert peers_curvature.peers_python("/v/python") == "/v/python"
    table = peers_curvature.format_rows([
        ("mlp", 8, "tf batch gradient", 2.0, None, None, ""),
        ("mlp", 8, "pertower diag_ggn exact", 5.0, None, None, ""),
        ("mlp", 8, "backpack DiagGGNExact", 9.0, 3e-6, 30.0, "vs pertower")])
    lines = table.splitlines()
    assert "2.50" in lines[2] and "4.50" in lines[3] and "3.0e-06" in lines[3], table


@pytest.mark.heavy
def test_backpack_child_agrees_with_pertower(tmp_path):
    """With torch and BackPACK in $PERTOWER_PEERS_PYTHON's environment: the mlp and
    cifar rows of `run_curvature` at small B agree (DiagGGNExact, KFLR)."""
    import os  # pylint: disable=import-outside-toplevel
    import subprocess  # pylint: disable=import-outside-toplevel
    from benchmarks import peers_curvature  # pylint: disable=import-outside-toplevel
    from benchmarks import records  # pylint: disable=import-outside-toplevel
    python = os.environ.get("PERTOWER_PEERS_PYTHON")
    if not python or subprocess.run([python, "-c", "import backpack"],
                                    check=False).returncode != 0:
        pytest.skip("no Python with torch and BackPACK in $PERTOWER_PEERS_PYTHON")
    rows, versions = peers_curvature.run_curvature([("mlp", 4), ("cifar", 2)], 1,
                                                   report=lambda line: None, python=python)
    assert "backpack" in versions, versions
    checked = [row for row in rows if row[4] is not None]
    assert len(checked) == 4, rows
    assert all(records.agrees(diff, scale) for _, _, _, _, diff, scale, _ in checked), rows

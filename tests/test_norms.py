"""per_example_norms against the norms of the oracle's per-example gradients, for every
method, and the check that the cheap forms never form the dense per-example gradients."""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import pertower
from pertower import _batch_axis
from pertower import oracle
from pertower import rules as rules_lib
from pertower.rules import conv2d
from tests import cases
from tests import common


def _oracle_norms(case):
    ys, _, feed = case.oracle()
    with case.graph.as_default():
        grads = common.run_oracle(oracle.loop_per_example_gradients, case.sess, ys, case.xs,
                                  feed)
    return np.sqrt(sum(np.sum(g.reshape(case.B, -1).astype(np.float64) ** 2, axis=1)
                       for g in grads))


def _rules_case(name, B=4):
    build, shapes, options, _ = cases.RULE_MODELS[name]
    options = dict(options, B=options.get("B", B))
    return cases.build_case(name, build, shapes, **options)


def _wide_sequence(x):               # Dense(32) on [B, 3, 16]: the ghost norm is cheaper
    layer = keras.layers.Dense(32, activation="tanh")
    return tf.reduce_sum(layer(x) ** 2, axis=[1, 2]), layer.trainable_weights


def _few_positions_conv(x):          # 3x3 VALID on 4x4: 4 positions, ghost norm cheaper
    layer = keras.layers.Conv2D(16, 3)
    return tf.reduce_sum(tf.sin(layer(x)), axis=[1, 2, 3]), layer.trainable_weights


GHOST = {"wide_sequence": (_wide_sequence, [(3, 16)]),
         "few_positions_conv": (_few_positions_conv, [(4, 4, 8)])}


def _ghost_case(name):
    build, shapes = GHOST[name]
    return cases.build_case(name, build, shapes, B=4)


CASES = {
    "wide_sequence": lambda: _ghost_case("wide_sequence"),
    "few_positions_conv": lambda: _ghost_case("few_positions_conv"),
    "mlp": lambda: cases.build_mlp(B=4),                      # k = 1 dense: ||a||^2 ||dz||^2
    "mlp_float64": lambda: cases.build_mlp(B=4, dtype=tf.float64),
    "shared_layer": lambda: cases.build_shared_layer(B=4),   # several uses: formed
    "embedding": lambda: cases.build_embedding(B=4),          # ghost norm with [id_t = id_s]
    "cnn": lambda: cases.build_cnn(B=2),                      # conv formed, dense cheap
    "dense_sequence": lambda: _rules_case("dense_sequence"),   # ghost norm over T
    "batch_matmul": lambda: _rules_case("batch_matmul"),
    "conv_valid_dilated": lambda: _rules_case("conv_valid_dilated"),   # conv formed
    "mixed_fallback": lambda: _rules_case("mixed_fallback"),   # towers for one weight
    "subclassed": lambda: cases.build_subclassed(B=3),        # Conv1D, LayerNorm, Dropout cond
    "cifar": lambda: cases.build_cifar_case(B=3),        # convs formed (grouped, patches)
}


# The same ways as the other cases', on slower or duplicate models: with -m heavy (the
# norms of the subclassed model's LayerNorm and convolution are checked by the DP sums
# of tests/test_rules.py on layer_norm and conv_same_strided, `mlp`'s dense norm here on
# mlp_float64; the CIFAR net's formed convolution norms by
# test_formed_conv_norms_match_the_oracle_for_every_strategy, every way, and its towers
# norms' mechanism on every other case).
HEAVY_CASES = ("subclassed", "mlp", "cifar")


@pytest.fixture(scope="module", params=[
    pytest.param(name, marks=pytest.mark.heavy) if name in HEAVY_CASES else name
    for name in sorted(CASES)])
def case(request):
    built = CASES[request.param]()
    yield built
    built.sess.close()


# The towers' norms (the norms of the towers' formed gradients: one mechanism whatever
# the model) by default on the cases where a towers gradient goes through ops of its own
# (one weight on towers under "auto", a Gather, a convolution); on the others with -m heavy
# (test_towers_norms_match_the_oracle_heavy).
TOWERS_CASES = ("mixed_fallback", "embedding", "cnn")


def _check_norms(case, methods):
    with case.graph.as_default():
        norms = {method: pertower.per_example_norms(case.ys, case.xs, batch_size=case.B,
                                                    method=method)
                 for method in methods}
        for value in norms.values():
            assert value.shape.as_list() == [case.B] and value.dtype == case.ys.dtype
    want = _oracle_norms(case)     # first: skips if TensorFlow cannot compute it here
    got = case.sess.run(norms, case.feed)
    for method, value in got.items():
        np.testing.assert_allclose(value, want, rtol=case.rtol * 10, atol=case.atol * 10,
                                   err_msg=f"{case.name} norms, method={method}")


def test_norms_match_the_norms_of_the_oracle_gradients(case):
    _check_norms(case, ("auto", "towers") if case.name in TOWERS_CASES else ("auto",))


@pytest.mark.heavy
def test_towers_norms_match_the_oracle_heavy(case):
    if case.name in TOWERS_CASES:
        pytest.skip("checked by test_norms_match_the_norms_of_the_oracle_gradients")
    _check_norms(case, ("towers",))


@pytest.mark.parametrize("name", sorted(GHOST))
def test_ghost_norms_do_not_form_the_kernel_gradients(name):
    case = _ghost_case(name)
    kernel = case.xs[0]
    with case.graph.as_default():
        before = set(case.graph.get_operations())
        pertower.per_example_norms(case.ys, case.xs, batch_size=4)
        shapes = {tuple(t.shape.as_list()) for op in case.graph.get_operations()
                  if op not in before for t in op.outputs
                  if t.shape.rank is not None and t.shape.is_fully_defined()}
    case.sess.close()
    assert tuple([4] + kernel.shape.as_list()) not in shapes


@pytest.mark.parametrize("layer, chosen", [
    # (H = W, Cin, Cout, k) of a SAME convolution -> ghost norm or formed gradient:
    # ghost ~ 2 P^2 (k^2 Cin + Cout), formed ~ 2 P k^2 Cin Cout per example (P = H*W)
    ((32, 3, 32, 3), "formed"),      # CIFAR layer 1: 1024 * 59 > 27 * 32
    ((8, 64, 64, 3), "formed"),      # CIFAR layer 3: 64 * 640 > 576 * 64
    ((4, 64, 64, 3), "ghost"),       # 16 * 640 <= 576 * 64
    ((2, 256, 256, 3), "ghost"),
])
def test_conv_norms_take_the_cheaper_of_ghost_and_formed(layer, chosen):
    H, c_in, c_out, k = layer
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, H, H, c_in])
        w = tf.compat.v1.get_variable("w", [k, k, c_in, c_out])
        z = tf.nn.conv2d(x, w, 1, "SAME")
        use = rules_lib.Use(z.op, 1, None, x, z, w.shape, _batch_axis.Rows(0, 1, None))
        assert conv2d.Conv2DRule().norm_strategy(use) == chosen


@pytest.fixture(scope="module")
def cifar():
    """The CIFAR net at B = 2 (one graph and session for the strategies' checks) and the
    norms of the oracle's gradients on it (computed once)."""
    case = cases.build_cifar_case(B=2)
    yield case, _oracle_norms(case)
    case.sess.close()


@pytest.mark.parametrize("strategy", ["patches", "grouped", "depthwise", "shifts"])
def test_formed_conv_norms_match_the_oracle_for_every_strategy(cifar, strategy):
    """The CIFAR net's norms (its convolutions formed, not ghost) with each way forced."""
    case, want = cifar
    registry = rules_lib.default_registry()
    conv2d.register(registry, conv2d.ConvOptions(strategy=strategy))
    with case.graph.as_default():
        try:
            norms = pertower.per_example_norms(case.ys, case.xs, batch_size=case.B,
                                               method="rules", rules=registry)
        except ValueError as refusal:
            assert not conv2d.onednn_enabled(), refusal
            return
    np.testing.assert_allclose(case.sess.run(norms, case.feed), want,
                               rtol=1e-4, atol=1e-6, err_msg=strategy)


def test_rules_norms_on_a_none_batch_axis():
    case = _rules_case("dense_sequence")
    with case.graph.as_default():
        norms = pertower.per_example_norms(case.ys, case.xs, method="rules")
        for size in (2, 4):
            feed = {k: v[:size] for k, v in case.feed.items()}
            grads = oracle.loop_per_example_gradients(case.sess, case.ys, case.xs, feed)
            want = np.sqrt(sum(np.sum(g.reshape(size, -1) ** 2, axis=1) for g in grads))
            np.testing.assert_allclose(case.sess.run(norms, feed), want, rtol=1e-4)
    case.sess.close()


def test_unreached_weights_add_nothing():
    case = cases.build_mlp(B=4)
    with case.graph.as_default():
        unused = tf.compat.v1.get_variable("unused", [3, 2])
        case.sess.run(unused.initializer)
        with pytest.warns(UserWarning, match=r"1 of the 7 weights .*so they add 0"):
            norms = pertower.per_example_norms(case.ys, case.xs + [unused], batch_size=4)
        with pytest.warns(UserWarning, match=r"1 of the 1 weights"):
            only_unused = pertower.per_example_norms(case.ys, [unused], batch_size=4)
    got, zero = case.sess.run([norms, only_unused], case.feed)
    np.testing.assert_allclose(got, _oracle_norms(case), rtol=1e-5)
    np.testing.assert_array_equal(zero, np.zeros(4))
    case.sess.close()


def test_dense_norms_never_form_the_per_example_gradients():
    """The issue's MLP 100-256-256-1 at B = 512: no tensor that per_example_norms adds
    has the shape [B, *kernel.shape] of a dense layer's per-example gradients (they
    would hold 512 x 92k numbers); the towers form them, as the check shows."""
    B = 512
    with tf.Graph().as_default() as graph:
        x = tf.compat.v1.placeholder(tf.float32, [None, 100])
        y = tf.compat.v1.placeholder(tf.float32, [None, 1])
        net = keras.Sequential([keras.layers.Dense(256, activation="relu"),
                                keras.layers.Dense(256, activation="relu"),
                                keras.layers.Dense(1)])
        cost = tf.reduce_sum((net(x) - y) ** 2, axis=1)
        kernels = [w for w in net.trainable_weights if w.shape.rank == 2]

        def added_shapes(build):
            before = set(graph.get_operations())
            build()
            return {tuple(t.shape.as_list()) for op in graph.get_operations()
                    if op not in before for t in op.outputs if t.shape.rank is not None
                    and t.shape.is_fully_defined()}

        per_example = {tuple([B] + k.shape.as_list()) for k in kernels}
        cheap = added_shapes(lambda: pertower.per_example_norms(cost, net.trainable_weights,
                                                                batch_size=B))
        formed = added_shapes(lambda: pertower.per_example_gradients(
            cost, net.trainable_weights, batch_size=B, method="rules"))
    assert not cheap & per_example
    assert per_example <= formed

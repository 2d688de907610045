"""Curvature on convolutions: the cheap `sum_squared` of Conv2D and DepthwiseConv2dNative
(`pertower._convolution.squares`, the C columns folded into one contraction, "formed" or
"ghost") against the one-example loop, and the memory guard's count per route.

Notation: B examples, K logits, C columns (K exact), H_n the loss Hessian of example n.

The reference GGN diagonal of example n is diag(J_n^T H_n J_n), J_n [K, *x] from
`pertower.oracle.loop_per_example_jacobians` (one tf.gradients per example and logit)
and H_n computed in NumPy; the reference sum of squares squares the one-example
gradients of `pertower.oracle.loop_per_example_gradients`. The same checks run under
tf.compat.v1.disable_v2_behavior() in tests/legacy/test_curvature_convs.py.
"""

import numpy as np
import pytest
import tensorflow as tf

import pertower
from pertower import oracle
from pertower._convolution import squares as conv2d_squares
from tests import common

B, K = 3, 4
# xs of `conv_case`, and how diag_ggn computes each
ROUTES = {"dilated": "rules, cheap form", "dilated_bias": "rules, cheap form",
          "strided": "rules, cheap form", "depthwise": "rules, cheap form",
          "pointwise": "rules, cheap form", "last": "rules, cheap form",
          "dense": "rules, cheap form"}
WAYS = {"dilated": "formed", "strided": "formed", "depthwise": "formed",
        "pointwise": "formed", "last": "ghost"}


def conv_case(seed=0):
    """(logits [B, K], per-example loss [B], xs, feed, names): a small conv net in float64
    with a dilated (SpaceToBatchND), a strided, a depthwise (multiplier 2, stride 2), a
    1x1 and a last convolution with one output position (where the ghost way is cheaper)."""
    rng = np.random.RandomState(seed)
    v = lambda shape, name: tf.compat.v1.get_variable(
        name, initializer=rng.randn(*shape) * 0.5, use_resource=True)
    image = tf.compat.v1.placeholder(tf.float64, [None, 6, 6, 2], name="image")
    labels = tf.compat.v1.placeholder(tf.int32, [None], name="labels")
    xs = dict(dilated=v([3, 3, 2, 4], "dilated"), dilated_bias=v([4], "dilated_bias"),
              strided=v([3, 3, 2, 4], "strided"), depthwise=v([3, 3, 4, 2], "depthwise"),
              pointwise=v([1, 1, 12, 4], "pointwise"), last=v([3, 3, 4, 5], "last"),
              dense=v([5, K], "dense"))
    # dilated as TensorFlow builds it without oneDNN: SpaceToBatchND, Conv2D, BatchToSpaceND
    h = tf.nn.with_space_to_batch(
        image, dilation_rate=[2, 2], padding="SAME", filter_shape=[3, 3],
        op=lambda x, num_spatial_dims, padding: tf.nn.conv2d(x, xs["dilated"], 1, padding))
    h = tf.tanh(tf.nn.bias_add(h, xs["dilated_bias"]))
    h = tf.nn.depthwise_conv2d(h, xs["depthwise"], [1, 2, 2, 1], "SAME")     # [B, 3, 3, 8]
    s = tf.nn.conv2d(image, xs["strided"], 2, "SAME")                      # [B, 3, 3, 4]
    h = tf.tanh(tf.concat([h, s], axis=3))                                 # [B, 3, 3, 12]
    h = tf.tanh(tf.nn.conv2d(h, xs["pointwise"], 1, "VALID"))              # [B, 3, 3, 4]
    h = tf.nn.conv2d(h, xs["last"], 1, "VALID")                            # [B, 1, 1, 5]
    logits = tf.reshape(tf.tanh(h), [-1, 5]) @ xs["dense"]                 # [B, K]
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
    feed = {image: rng.randn(B, 6, 6, 2), labels: rng.randint(0, K, B)}
    return logits, loss, list(xs.values()), feed, list(xs)


class ConvReference:
    """`conv_case` in a graph and session of its own, with the one-example loop's values
    on it (the GGN diagonals per loss, the gradients), each computed once: the checks of
    several ways share them."""

    def __init__(self):
        self.graph = tf.Graph()
        with self.graph.as_default():
            self.logits, self.loss, self.xs, self.feed, self.names = conv_case()
            self.sess = tf.compat.v1.Session(graph=self.graph)
            self.sess.run(tf.compat.v1.global_variables_initializer())
        self._ggn = {}
        self._gradients = None

    def ggn(self, loss):
        """[B, *x.shape] per x: the reference GGN diagonal of each example."""
        if loss not in self._ggn:
            with self.graph.as_default():
                self._ggn[loss] = common.reference_ggn(self.sess, self.logits, self.xs,
                                                       self.feed, loss)
        return self._ggn[loss]

    def gradients(self):
        """[B, *x.shape] per x: the one-example gradients of the per-example loss."""
        if self._gradients is None:
            with self.graph.as_default():
                self._gradients = oracle.loop_per_example_gradients(
                    self.sess, self.loss, self.xs, self.feed)
        return self._gradients

    def close(self):
        self.sess.close()


def check_case(way=None, loss="softmax_cross_entropy", reference=None):
    """Runs diag_ggn (per example and summed) and sum_grad_squared on `conv_case` and
    compares them with the loops; `way` forces conv2d_squares' way for every Conv2D
    ("formed" or "ghost"). `reference`: a `ConvReference` whose graph, session and loop
    values to use (else a new one, closed at the end). Returns the summed result's
    routes."""
    own = reference is None
    reference = ConvReference() if own else reference
    chosen = conv2d_squares.choose
    if way is not None:
        conv2d_squares.choose = lambda use, C: (None if chosen(use, C) is None else
                                                way if use.op.type == "Conv2D" else
                                                "formed")
    try:
        xs, names = reference.xs, reference.names
        with reference.graph.as_default():
            per_example = pertower.diag_ggn(reference.logits, xs, loss=loss, per_example=True,
                                            batch_size=B)
            summed = pertower.diag_ggn(reference.logits, xs, loss=loss, batch_size=B)
            squares = pertower.sum_grad_squared(reference.loss, xs, batch_size=B)
            ways = {name: chosen(use[0], K) if len(use) == 1 else None
                    for name, use in zip(names, summed.plan.uses) if name in WAYS}
        got = reference.sess.run([list(per_example), list(summed), list(squares)],
                                 reference.feed)
        want, grads = reference.ggn(loss), reference.gradients()
    finally:
        conv2d_squares.choose = chosen
        if own:
            reference.close()
    common.assert_all_close(got[0], want, kind="deep", what=f"diag_ggn per example ({way})")
    common.assert_all_close(got[1], [w.sum(0) for w in want], kind="deep",
                            what=f"diag_ggn ({way})")
    common.assert_all_close(got[2], [np.square(g).sum(0) for g in grads], kind="deep",
                            what=f"sum_grad_squared ({way})")
    assert ways == WAYS, ways
    return dict(zip(names, (r.split(":")[0] for r in summed.routes)))


@pytest.fixture(scope="module")
def conv_reference():
    """One `ConvReference` for the module's checks."""
    reference = ConvReference()
    yield reference
    reference.close()


@pytest.mark.parametrize("way", [None, "ghost", pytest.param("formed", marks=pytest.mark.heavy)])
def test_conv_squares_match_the_loop(conv_reference, way):
    # None: conv2d_squares' choice ("formed" everywhere but the last convolution)
    assert check_case(way, reference=conv_reference) == ROUTES


@pytest.mark.heavy
def test_conv_squares_mse_match_the_loop_heavy(conv_reference):
    assert check_case(None, "mse", reference=conv_reference) == ROUTES


def _guarded(build_logits, memory_limit, per_example=False):
    with tf.Graph().as_default():
        logits, xs = build_logits()
        return pertower.diag_ggn(logits, xs, per_example=per_example, batch_size=64,
                                 memory_limit=memory_limit)


def _mlp():
    x = tf.compat.v1.placeholder(tf.float32, [64, 100])
    kernel, head = tf.Variable(tf.zeros([100, 100])), tf.Variable(tf.zeros([100, 10]))
    return tf.tanh(x @ kernel) @ head, [kernel, head]


def _convolution():
    x = tf.compat.v1.placeholder(tf.float32, [64, 4, 4, 16])
    kernel, head = tf.Variable(tf.zeros([3, 3, 16, 16])), tf.Variable(tf.zeros([256, 10]))
    h = tf.reshape(tf.nn.conv2d(x, kernel, 1, "SAME"), [64, 256])
    return h @ head, [kernel, head]


def test_memory_guard_counts_what_each_route_holds():
    # a dense layer's cheap form holds no per-example gradient: 64 x 10 columns x 11000
    # weights x 4 bytes (28 MB, what the general guard counts) is not held, only the
    # columns' output gradients (64 x 10 x 110 x 4 = 0.28 MB) and, per example, the
    # result 64 x 11000 x 4 = 2.8 MB
    summed = _guarded(_mlp, 1e6)
    assert summed.plan.estimate.total_bytes < 1e6, summed.plan.estimate.describe()
    per_example = _guarded(_mlp, 4e6, per_example=True)
    assert 2.8e6 < per_example.plan.estimate.total_bytes < 4e6
    # the convolution's cheap form holds its 10 wide per-example gradients:
    # 64 x 10 x 2304 x 4 = 5.9 MB (its 16 positions per example exceed the 10 columns)
    with pytest.raises(ValueError, match=r"pertower.diag_ggn: the per-example result "
                                         r"would need about 6\.\d+ MB: what the routes hold"):
        _guarded(_convolution, 6e6)
    assert _guarded(_convolution, 7e6).plan.estimate.total_bytes < 7e6


def test_bench_prints_the_targets_as_rows():
    from benchmarks import peers_curvature  # pylint: disable=import-outside-toplevel
    rows = [("cifar", 8, name, ms, None, None, "") for name, ms in (
        ("tf batch gradient", 10.0), ("pertower per_example_gradients", 20.0),
        ("pertower diag_ggn exact", 120.0), ("pertower diag_ggn mc=1", 25.0),
        ("backpack DiagGGNExact", 240.0))]
    lines = peers_curvature.target_rows(rows)
    assert [line.split("  (")[0].split()[-1] for line in lines] == ["12.00", "1.25", "0.50"]
    assert [line.endswith("NOT met)") for line in lines] == [True, False, False], lines
    assert lines[-1] in peers_curvature.format_rows(rows)

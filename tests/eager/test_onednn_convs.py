"""The convolution rules with TensorFlow's oneDNN kernels on (tests/eager/conftest.py
sets TF_ENABLE_ONEDNN_OPTS=1, so they run on every CPU): the checks of
tests/test_rules_convs.py (`CHECKS["onednn"]`) and tests/test_conv_ways_at_zoo_shapes.py
(`CHECKS`), and oneDNN's filter gradients.

`test_onednn_filter_gradients`: with oneDNN forced on (on a CPU without AVX-512)
TensorFlow's own Conv2DBackpropFilter and DepthwiseConv2dNativeBackpropFilter of a 1x1
stride-2 VALID convolution on 8x8 with thin channels are wrong against float64 numpy;
the test compares the rules (every way, and the clipped sums) with float64 numpy over
20 runs and prints TensorFlow's own error beside them.
"""

import numpy as np
import pytest
import tensorflow as tf

import pertower
from pertower import _batch_axis
from pertower import _graph_walk
from pertower.rules import conv2d
from pertower.rules import depthwise_conv2d
from tests import test_rules_convs as convs
from tests import test_conv_ways_at_zoo_shapes as zoo_speed

RUNS = 20


@pytest.fixture(autouse=True)
def _onednn_on():
    assert conv2d.onednn_enabled(), "expected TensorFlow's oneDNN kernels (TF_ENABLE_ONEDNN_OPTS=1)"


@pytest.mark.parametrize("check", [name for name in convs.CHECKS["onednn"]
                                   if name != "check_onednn_filter_gradients"])
def test_convolution_rules(check):
    getattr(convs, check)()


@pytest.mark.heavy   # (as in graph mode, where they run in the default run)
@pytest.mark.parametrize("check", zoo_speed.CHECKS)
def test_zoo_convolution_ways(check):
    getattr(zoo_speed, check)()


# op type -> (input channels, filter [1, 1, C, O or M], rule class, ways it takes)
_KINDS = {
    "Conv2D": (3, [1, 1, 3, 4], conv2d.Conv2DRule, conv2d.STRATEGIES),
    "DepthwiseConv2dNative": (1, [1, 1, 1, 2], depthwise_conv2d.DepthwiseConv2DRule,
                              ("auto", "grouped", "patches", "shifts")),
}


def _filter_gradient_errors(op_type, batch):
    """{what: worst relative error over RUNS runs} of a 1x1 stride-2 VALID `op_type` on
    8x8 with ys_i = sum(y_i^2) against float64 numpy."""
    channels, shape, rule_class, strategies = _KINDS[op_type]
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 8, 8, channels])
        w = tf.compat.v1.placeholder(tf.float32, shape)
        if op_type == "Conv2D":
            y = tf.nn.conv2d(x, w, strides=2, padding="VALID")             # [B, 4, 4, O]
        else:
            y = tf.nn.depthwise_conv2d(x, w, [1, 2, 2, 1], "VALID")        # [B, 4, 4, C*M]
        ys = tf.reduce_sum(y ** 2, axis=[1, 2, 3])                         # [B]
        outs = {"tf.gradients (sum)": tf.gradients(tf.reduce_sum(ys), w)[0][None]}
        for strategy in strategies:
            registry = pertower.rules.default_registry()
            registry.register(op_type, rule_class(conv2d.ConvOptions(strategy)))
            outs[strategy] = pertower.per_example_gradients(
                ys, [w], batch=x, method="rules", rules=registry)[0]       # [B, 1, 1, C, O]
        rule = rule_class()
        use = rule.match(y.op, 1, _batch_axis.analyze(ys, [x], _graph_walk.upstream_ops([ys])))
        factors = tf.compat.v1.placeholder(tf.float32, [None])
        outs["clipped sum"] = rule.clipped_sum(use, tf.gradients(tf.reduce_sum(ys), y)[0],
                                               factors)[None]              # [1, 1, 1, C, O]
        worst = dict.fromkeys(outs, 0.0)
        rng = np.random.RandomState(batch)
        with tf.compat.v1.Session() as sess:
            for _ in range(RUNS):
                x_value, w_value = rng.randn(batch, 8, 8, channels), rng.randn(*shape)
                f_value = rng.uniform(0.1, 1.0, batch)
                got = sess.run(outs, {x: x_value.astype(np.float32), factors: f_value,
                                      w: w_value.astype(np.float32)})
                rows = x_value[:, ::2, ::2, :].reshape(batch, -1, channels)   # [B, 16, C]
                if op_type == "Conv2D":
                    want = np.einsum("bpc,bpo->bco", rows, 2 * rows @ w_value[0, 0])
                else:   # y[b, p, c, m] = x[b, p, c] w[c, m]
                    want = np.einsum("bpc,bpcm->bcm", rows,
                                     2 * rows[..., None] * w_value[0, 0])
                want = want[:, None, None]                                 # [B, 1, 1, C, O]
                for key, value in got.items():
                    ref = (want.sum(0, keepdims=True) if key.startswith("tf.") else
                           np.tensordot(f_value, want, 1)[None] if key == "clipped sum"
                           else want)
                    error = float(np.abs(value - ref).max() / np.abs(ref).max())
                    worst[key] = max(worst[key], error)
    return worst


def test_onednn_filter_gradients():
    """A 1x1 stride-2 VALID Conv2D (3 -> 4 channels) and DepthwiseConv2dNative (1
    channel, multiplier 2) on 8x8, ys_i = sum(y_i^2), B = 1 and 4: per-example
    gradients of every way of the rule ("auto" and forced), its clipped sum
    sum_i f_i grad_i(W) and TensorFlow's tf.gradients, each against float64 numpy over
    20 runs of fresh inputs. Fails if the rule is off by more than 1e-4 (relative) on
    any run; reports TensorFlow's own error beside it."""
    lines, failures = [], []
    for op_type in _KINDS:
        for batch in (1, 4):
            for key, error in _filter_gradient_errors(op_type, batch).items():
                lines.append(f"{op_type} B={batch} {key}: worst relative error {error:.2g} "
                             f"over {RUNS} runs")
                if not key.startswith("tf.") and error > 1e-4:
                    failures.append(lines[-1])
    print("\n".join(lines))
    assert not failures, "the rule is wrong with oneDNN on: " + "; ".join(failures)

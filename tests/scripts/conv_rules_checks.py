"""Run in a process of its own: the checks of tests/test_rules_convs.py in another mode.

    python tests/scripts/conv_rules_checks.py legacy   # tf.compat.v1.disable_v2_behavior()
    python tests/scripts/conv_rules_checks.py legacy heavy   # its heavy-run checks
    python tests/scripts/conv_rules_checks.py onednn   # TF_ENABLE_ONEDNN_OPTS=1

"onednn" also runs `check_onednn_filter_gradients`: with oneDNN forced on (on a CPU
without AVX-512) TensorFlow's own Conv2DBackpropFilter and
DepthwiseConv2dNativeBackpropFilter of a 1x1 stride-2 VALID convolution on 8x8 with
thin channels are wrong against float64 numpy; the check compares the rules (every way,
and the clipped sums) with float64 numpy over 20 runs and reports TensorFlow's own
error beside them.

Started once per test session by tests/process_checks.py ("convs_legacy",
"convs_onednn"); prints one `pertower-check` line per check and a summary; exits 1 on
failure.
"""

import os
import sys

MODE = sys.argv[1] if len(sys.argv) > 1 else "legacy"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
if MODE == "onednn":
    os.environ["TF_ENABLE_ONEDNN_OPTS"] = "1"

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

if MODE == "legacy":
    tf.compat.v1.disable_v2_behavior()

import pertower  # noqa: E402
from pertower import _batch_axis  # noqa: E402
from pertower import _graph_walk  # noqa: E402
from pertower.rules import conv2d  # noqa: E402
from pertower.rules import depthwise_conv2d  # noqa: E402
from tests import process_checks  # noqa: E402
from tests import test_rules_convs as convs  # noqa: E402

RUNS = 20


def _require_mode():
    if MODE == "legacy":
        process_checks.require_legacy_mode()
    if MODE == "onednn" and not conv2d.onednn_enabled():
        raise AssertionError("expected TensorFlow's oneDNN kernels (TF_ENABLE_ONEDNN_OPTS=1)")


def _wrapped(name):
    def check():
        _require_mode()
        return getattr(convs, name)()
    check.__name__ = name
    return check


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


def check_onednn_filter_gradients():
    """A 1x1 stride-2 VALID Conv2D (3 -> 4 channels) and DepthwiseConv2dNative (1
    channel, multiplier 2) on 8x8, ys_i = sum(y_i^2), B = 1 and 4: per-example
    gradients of every way of the rule ("auto" and forced), its clipped sum
    sum_i f_i grad_i(W) and TensorFlow's tf.gradients, each against float64 numpy over
    20 runs of fresh inputs. Fails if the rule is off by more than 1e-4 (relative) on
    any run; reports TensorFlow's own error beside it."""
    _require_mode()
    lines, failures = [], []
    for op_type in _KINDS:
        for batch in (1, 4):
            for key, error in _filter_gradient_errors(op_type, batch).items():
                lines.append(f"{op_type} B={batch} {key}: worst relative error {error:.2g} "
                             f"over {RUNS} runs")
                if not key.startswith("tf.") and error > 1e-4:
                    failures.append(lines[-1])
    if failures:
        raise AssertionError("the rule is wrong with oneDNN on: " + "; ".join(failures))
    return "\n".join(lines)


CHECKS = {"legacy": [_wrapped(n) for n in convs.CHECKS["legacy"]],
          "onednn": [_wrapped(n) for n in convs.CHECKS["onednn"][:-1]]
                    + [check_onednn_filter_gradients]}

if __name__ == "__main__":
    # with the argument `heavy` after the mode (process "convs_legacy_heavy"): the
    # dilated convolutions under disable_v2_behavior() (the default run checks them in
    # graph mode and with oneDNN, and the legacy shape mode on the transposed and 3-D
    # convolutions' rules)
    sys.exit(process_checks.run_checks(CHECKS[MODE], f"conv rules checks ({MODE})",
                                       heavy={"check_dilated"} if MODE == "legacy" else ()))

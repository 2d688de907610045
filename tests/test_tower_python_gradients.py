"""Python-defined gradients (issue 17 item 4) and transposed convolutions (item 14)
under the towers, against the one-example loop (`pertower.oracle`).

- A `tf.custom_gradient` closure (tf_keras' swish, a closure over a forward tensor off
  the way to `ys`, one with `variables`) or a `gradient_override_map` function reads
  the original graph's tensors; each tower's copy replays it on the tower's own
  (`pertower._towers.python_gradients`). A backward that centres dy over the batch
  mixes the examples: the rules leave its weights to the towers (explain says why),
  where each tower mixes only its own example, as the loop does.
- A backward the batch-axis analysis proves row-wise (swish) lets the rules serve the
  weights behind it (`pertower._overrides`).
- A transposed convolution's output shape [B, h, w, c] is a shape: each tower's replay
  runs on its own size, with oneDNN on (it aborted TensorFlow) and off.

The same models run under disable_v2_behavior() in tests/legacy/test_tower_python_gradients.py
with the environment's oneDNN setting and, in the heavy run (`-m heavy`), in a fresh
interpreter for each oneDNN setting in each shape mode.
"""

import re
import sys

import pytest
import tensorflow as tf

import pertower
from pertower import _dispatch
from tests import common
from tests import python_gradient_cases as checks

B = checks.B


@pytest.mark.parametrize("name", sorted(checks.PYTHON_GRADIENT_MODELS))
def test_python_gradients_match_the_loop(name):
    body, shape = checks.PYTHON_GRADIENT_MODELS[name]
    checks.compare_with_loop(checks.build(body, shape))


@pytest.mark.parametrize("name", sorted(checks.TRANSPOSED_CONV_MODELS))
def test_transposed_convolutions_match_the_loop(name):
    body, shape = checks.TRANSPOSED_CONV_MODELS[name]
    checks.compare_with_loop(checks.build(body, shape), kind="deep")


def test_transposed_convolution_cost_over_the_batch_size_keeps_the_whole_batch():
    """cost / tf.shape(x)[0] next to an output shape built from the same size: the
    shape takes the tower's size, the division the whole batch's B (the rows of the
    whole batch)."""
    body, shape = checks.WHOLE_BATCH_MODELS["nn_conv2d_transpose_mean"]
    checks.compare_with_loop(checks.build(body, shape), kind="deep", whole_batch=True)


@pytest.mark.heavy
@pytest.mark.parametrize("onednn", ["0", "1"])
@pytest.mark.parametrize("path", ["tests/test_tower_python_gradients.py",
                                  "tests/legacy/test_tower_python_gradients.py"])
def test_each_onednn_setting_and_shape_mode(onednn, path):
    """The models of `checks.CHECKS` in a fresh interpreter with TF_ENABLE_ONEDNN_OPTS
    (read when TensorFlow is imported) set, in each shape mode's session."""
    common.run_python("-m", "pytest", "-q", "-p", "no:cacheprovider", path, "-k",
                      "match_the_loop or keeps_the_whole_batch or python_gradients_and_transposed",
                      env={"TF_ENABLE_ONEDNN_OPTS": onednn})


def _plan(body, shape=(5,)):
    model = checks.build(body, list(shape))
    with model.graph.as_default():
        return model, _dispatch.make_plan(model.ys, model.xs, None, B, refuse=False,
                                          validate=False)


def test_a_row_wise_override_lets_the_rules_serve_its_weights():
    """swish's backward is elementwise in dy and its input: the rules serve every
    weight of the swish MLP, and explain says so."""
    model, plan = _plan(checks.keras_swish_mlp)
    assert plan.fallback == [], plan.reasons
    with model.graph.as_default():
        text = str(pertower.explain(model.ys, model.xs, batch_size=B))
    assert "overridden" not in text, text
    assert len(re.findall(r"\brules\b", text)) >= len(model.xs), text


@pytest.mark.parametrize("body", [checks.centring_custom_gradient,
                                  checks.centring_override_map])
def test_a_mixing_override_sends_its_weights_to_the_towers_naming_the_op(body):
    """A backward that centres dy over the batch is not row-wise: the weight behind it
    (W) goes to the towers with the op named and why; the weight after it (V) keeps its
    rule; method="rules" refuses."""
    model, plan = _plan(body)
    assert plan.fallback == [0], plan.reasons
    reason = plan.reasons[0]
    assert re.search(r"'(IdentityN|Tanh)' \((IdentityN|Tanh)\), whose gradient is "
                     r"overridden", reason), reason
    assert "its backward pass mixes the examples" in reason, reason
    with model.graph.as_default():
        text = str(pertower.explain(model.ys, model.xs, batch_size=B))
        # the probe's dy placeholder is named anew by each plan
        said = reason[:reason.index("mixes the examples")]
        assert said in text and "reduces (Mean) over axis 0" in text, text
        with pytest.raises(ValueError, match="method='rules' is strict"):
            pertower.per_example_gradients(model.ys, model.xs, batch_size=B,
                                           method="rules")


def _unregistered_override(x):
    W = checks._weight([5, 2], "W")  # pylint: disable=protected-access
    with tf.compat.v1.get_default_graph().gradient_override_map(
            {"Tanh": "PertowerTestNeverRegistered"}):
        h = tf.tanh(tf.matmul(x, W))
    return tf.reduce_sum(h ** 2, axis=1), [W]


def _broken_tanh():
    """tanh with a tf.custom_gradient whose backward raises when it is built."""
    @tf.custom_gradient
    def broken(h):
        def grad(dy):
            raise NotImplementedError("no gradient here")
        return tf.tanh(h), grad
    return broken


def _failing_override(x):
    W = checks._weight([5, 2], "W")  # pylint: disable=protected-access
    return tf.reduce_sum(_broken_tanh()(tf.matmul(x, W)) ** 2, axis=1), [W]


def _failing_override_before_the_weights(x):
    W = checks._weight([5, 2], "W")  # pylint: disable=protected-access
    return tf.reduce_sum(tf.tanh(tf.matmul(_broken_tanh()(x), W)) ** 2, axis=1), [W]


def test_an_override_no_weight_is_behind_is_left_alone():
    """No gradient of a weight flows through an override on the input: the towers do
    not build it (it would raise) and match the loop."""
    checks.compare_with_loop(checks.build(_failing_override_before_the_weights, [5]))


@pytest.mark.parametrize("body, why", [
    (_unregistered_override, "by a function that is not registered"),
    (_failing_override, r"building it on its own failed \(NotImplementedError: no "
                        r"gradient here\)"),
])
def test_an_override_the_towers_cannot_build_is_refused_naming_the_op(body, why):
    model = checks.build(body, [5])
    with model.graph.as_default():
        with pytest.raises(ValueError, match=r"pertower.per_example_gradients: the "
                           r"gradient of op '(Tanh|IdentityN)' \((Tanh|IdentityN)\) is "
                           r"overridden .*" + why):
            pertower.per_example_gradients(model.ys, model.xs, batch_size=B,
                                           method="towers")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))

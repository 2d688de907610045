"""The rules' public surface: the `method` and `rules` arguments, the errors shared by
every method, user registries and rules (a replaced rule, a declining one, one that
declares its op's row layout), `grad_ys`, microbatches and Jacobians on a None batch
axis, Dropout's draws, and the refusal of an op that mixes examples; each result
against the one-example oracle."""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import pertower
from pertower._api import gradients as gradients_lib
from pertower import _dispatch
from pertower import _engine
from pertower import oracle
from pertower import rules as rules_lib
from tests import cases
from tests import common


@pytest.mark.parametrize("method", ["rules", "towers"])
def test_an_op_that_mixes_examples_is_refused_by_every_method(method):
    """x W minus its mean over the batch: example i's value depends on the others, so
    neither the batched dZ (rules) nor one-example towers give "the gradient of example
    i" of `ys`; both methods refuse, naming the op (pertower._batch_axis)."""
    def build(x):
        w = cases.random_normal_variable([4, 3], "w_centered")
        z = tf.matmul(x, w)
        return tf.reduce_sum(tf.sin(z - tf.reduce_mean(z, axis=0, keepdims=True)), axis=1), [w]
    case = cases.build_case("batch_mean", build, [(4,)], B=4)
    with case.graph.as_default(), pytest.raises(ValueError, match=r"Mean.*batch axis"):
        pertower.per_example_gradients(case.ys, case.xs, batch_size=4, method=method)
    case.sess.close()


def test_grad_ys_weights_the_outputs_for_rules_and_towers_alike():
    """gradients(grad_ys=w): per example, the Jacobian contracted with w; the mixed
    model has weights on both sides (rules and towers)."""
    def build(x):
        ys, xs = cases.mixed(x)
        return tf.stack([ys, tf.cos(ys)], axis=1), xs            # [B, 2]
    case = cases.build_case("grad_ys", build, [(4,)], B=4)
    weights = np.linspace(-1.0, 2.0, 8).reshape(4, 2).astype(np.float32)
    with case.graph.as_default():
        built = _dispatch.build(_dispatch.make_plan(case.ys, case.xs, None, 4))
        assert built.plan.fallback == [2]
        got = built.gradients(grad_ys=tf.constant(weights))
        jacobians = oracle.loop_per_example_jacobians(case.sess, case.ys, case.xs, case.feed)
        with pytest.raises(ValueError, match=r"`grad_ys` must have the shape of `ys`"):
            built.gradients(grad_ys=tf.ones([4, 3]))
    want = [np.einsum("bk,bk...->b...", weights, j) for j in jacobians]
    common.assert_all_close(case.sess.run(got, case.feed), want, 1e-5, 1e-5, "grad_ys")
    case.sess.close()


def test_microbatches_with_a_none_batch_axis_and_rules():
    case = cases.build_case("dense_sequence", cases.dense_sequence, [(5, 4)], B=4)
    with case.graph.as_default():
        got = pertower.microbatch_gradients(case.ys, case.xs, num_microbatches=2,
                                            method="rules")
        want = oracle.loop_microbatch_gradients(case.sess, case.ys, case.xs, case.feed, 2)
        common.assert_all_close(case.sess.run(got, case.feed), want, kind="deep",
                                what="2 microbatches of 4")
        six = {k: np.concatenate([v, v[:2]]) for k, v in case.feed.items()}
        want = oracle.loop_microbatch_gradients(case.sess, case.ys, case.xs, six, 2)
        common.assert_all_close(case.sess.run(got, six), want, kind="deep",
                                what="2 microbatches of 6")
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match=r"`num_microbatches` \(2\) must divide the batch size.*"
                                 r"has 3 examples\. Feed a multiple of 2"):
            case.sess.run(got, {k: v[:3] for k, v in case.feed.items()})
        outputs = tf.stack([case.ys, case.ys ** 2], axis=1)                 # [B, 2]
        jacobians = pertower.per_example_jacobians(outputs, case.xs, method="rules")
        three = {k: v[:3] for k, v in case.feed.items()}
        want = oracle.loop_per_example_jacobians(case.sess, outputs, case.xs, three)
        common.assert_all_close(case.sess.run(jacobians, three), want, 1e-4, 1e-4,
                                "Jacobians of 3 examples, no batch_size")
    case.sess.close()


@pytest.mark.parametrize("function", ["per_example_gradients", "microbatch_gradients",
                                      "per_example_jacobians", "per_example_norms"])
def test_method_and_rules_arguments_are_checked(mlp, function):
    call = getattr(pertower, function)
    ys = mlp.outputs if function == "per_example_jacobians" else mlp.ys
    with mlp.graph.as_default():
        with pytest.raises(ValueError, match=rf"pertower.{function}: `method` must be one of "
                                             r"\('auto', 'towers', 'rules'\), got 'rule'"):
            call(ys, mlp.xs, batch_size=4, method="rule")
        with pytest.raises(ValueError, match=r"`rules` is used by method='rules' or 'auto'"):
            call(ys, mlp.xs, batch_size=4, method="towers",
                 rules=rules_lib.default_registry())
        with pytest.raises(TypeError, match=r"`rules` must be a pertower.rules.RuleRegistry"):
            call(ys, mlp.xs, batch_size=4, rules={"MatMul": None})
        # the towers are built for a fixed batch size; the rules need none
        with pytest.raises(ValueError, match=r"batch axis is not static.*Pass batch_size=B"):
            call(ys, mlp.xs, method="towers")
        call(ys, mlp.xs, method="auto")
        call(ys, mlp.xs, method="rules")


def test_errors_are_the_same_for_every_method(mlp):
    for method in gradients_lib.METHODS:
        with mlp.graph.as_default():
            with pytest.raises(ValueError, match=r"`num_microbatches` \(3\) must divide the "
                                                 r"batch size \(4\)"):
                pertower.microbatch_gradients(mlp.ys, mlp.xs, num_microbatches=3,
                                              batch_size=4, method=method)
            with pytest.raises(ValueError, match=r"`batch_size` must be a positive integer"):
                pertower.per_example_gradients(mlp.ys, mlp.xs, batch_size=0, method=method)
            with pytest.raises(ValueError, match=r"`xs\[0\]` .* depends on the batch"):
                pertower.per_example_gradients(mlp.ys, [mlp.outputs * 2.0], batch_size=4,
                                               method=method)
            with pytest.raises(ValueError, match=r"`ys` .* is a scalar"):
                pertower.per_example_gradients(tf.reduce_sum(mlp.ys), mlp.xs, batch_size=4,
                                               method=method)


def test_ys_whose_rows_do_not_follow_the_batch_is_refused_with_auto_too():
    """concat([s1, s1 + s2]) along axis 0 (s1 read in both parts) has no row layout, so
    the weight goes to the towers, which refuse it as before."""
    with tf.Graph().as_default():
        s1 = tf.compat.v1.placeholder(tf.float32, [None, 3], name="s1")
        s2 = tf.compat.v1.placeholder(tf.float32, [None, 3], name="s2")
        w = tf.compat.v1.get_variable("w", [3, 1])
        ys = tf.matmul(tf.concat([s1, s1 + s2], axis=0), w)[:, 0]
        with pytest.raises(ValueError, match=r"axis 0 of `ys` .* does not follow the batch"):
            pertower.microbatch_gradients(ys, [w], num_microbatches=2, batch_size=2,
                                          method="auto")


class _CountingRule(rules_lib.Rule):
    """A user rule for MatMul that delegates to the built-in one and counts its uses."""

    def __init__(self):
        self.inner = rules_lib.matmul.MatMulRule()
        self.calls = 0

    def match(self, op, slot, analysis):
        return self.inner.match(op, slot, analysis)

    def per_group(self, use, dZ, G):
        self.calls += 1
        return self.inner.per_group(use, dZ, G)


class _SquareRule(rules_lib.Rule):
    """A user rule for the ClipByValue bounded by a squared weight (`cases.mixed`): it
    refuses with a reason (kept in the plan)."""

    def match(self, op, slot, analysis):
        return "a user rule that declines"

    def per_group(self, use, dZ, G):
        raise AssertionError("never called")


def test_a_user_registry_replaces_and_adds_rules(mlp):
    registry = rules_lib.default_registry()
    counting = _CountingRule()
    registry.register("MatMul", counting)
    registry.register("ClipByValue", _SquareRule())
    assert "MatMul" in registry.op_types() and "ClipByValue" in registry.op_types()
    assert rules_lib.default_registry().lookup("MatMul") is not counting   # a new one each call
    with mlp.graph.as_default():
        got = pertower.per_example_gradients(mlp.ys, mlp.xs, batch_size=4, rules=registry)
        want = oracle.loop_per_example_gradients(mlp.sess, mlp.ys, mlp.xs, mlp.feed)
    assert counting.calls == 3
    common.assert_all_close(mlp.sess.run(got, mlp.feed), want, mlp.rtol, mlp.atol,
                            "user registry")
    case = cases.build_case("mixed_fallback", cases.mixed, [(4,)])
    with case.graph.as_default():
        plan = _dispatch.make_plan(case.ys, case.xs, None, 3, rules=registry, validate=False)
    assert "a user rule that declines" in plan.reasons[2]
    case.sess.close()
    with pytest.raises(TypeError, match=r"`rule` must define `match` and `per_group`"):
        registry.register("Foo", object())
    with pytest.raises(TypeError, match=r"`op_type` must be an op type name"):
        registry.register(3, counting)


class _CrossOfRows(rules_lib.Rule):
    """Teaches the analysis that a Cross of two tensors with the same rows keeps them
    (it reads no weight, so `match` is never asked)."""

    def output_layouts(self, op, inputs):
        if not isinstance(inputs[0], rules_lib.Rows) or inputs[1] != inputs[0]:
            return None
        return [inputs[0]]

    def match(self, op, slot, analysis):
        return "Cross reads no weight"

    def per_group(self, use, dZ, G):
        raise AssertionError("never called")


def test_a_user_rule_can_declare_the_row_layout_of_its_op():
    case = cases.build_case("mixing_op", cases.mixing_op, [(4,)])
    registry = rules_lib.default_registry()
    registry.register("Cross", _CrossOfRows())
    with case.graph.as_default():
        plan = _dispatch.make_plan(case.ys, case.xs, None, 4, rules=registry, validate=False)
        assert plan.fallback == []
        got = pertower.per_example_gradients(case.ys, case.xs, batch_size=4, rules=registry)
        want = oracle.loop_per_example_gradients(case.sess, case.ys, case.xs, case.feed)
    common.assert_all_close(case.sess.run(got, case.feed), want, 1e-5, 1e-5, "user layout")
    case.sess.close()


class _DenseOnRows(rules_lib.Rule):
    """An extension rule for MatMul written against `pertower.rules`' public names only:
    grad_i(W) = sum_t a_it ⊗ dz_it (k rows t per example), its squared norm for k = 1
    ||a_i||^2 ||dz_i||^2, its clipped sum the batch gradient of the scaled dZ."""

    def __init__(self):
        self.asked = []

    def match(self, op, slot, analysis):
        if slot != 1 or op.get_attr("transpose_a") or op.get_attr("transpose_b"):
            return "the extension covers x W only"
        use = self.example_use(op, slot, analysis)
        if not isinstance(use, str):
            assert isinstance(use, rules_lib.Use) and isinstance(use.rows, rules_lib.Rows)
        return use

    def per_group(self, use, dZ, G):
        self.asked.append("per_group")
        d, n = use.weight_shape.as_list()
        A = tf.reshape(use.activation, [G, -1, d])                        # [G, T, d]
        return tf.einsum("gtd,gtn->gdn", A, tf.reshape(dZ, [G, -1, n]))   # [G, d, n]

    def squared_norms(self, use, dZ, B):
        self.asked.append("squared_norms")
        if use.rows.k != 1:
            return None
        return (tf.reduce_sum(tf.square(use.activation), axis=1)
                * tf.reduce_sum(tf.square(dZ), axis=1))                   # [B]

    clipped_sum = rules_lib.batch_gradient_clipped_sum


def test_an_extension_rule_on_the_public_names_matches_the_oracle(mlp):
    """`_DenseOnRows` replaces the built-in MatMul rule: its per-example gradients, its
    norms (its own cheap form, asked) and its clipped sums equal the one-example loop."""
    registry = rules_lib.default_registry()
    rule = _DenseOnRows()
    registry.register("MatMul", rule)
    factors_value = np.linspace(0.2, 1.3, 4).astype(np.float32)
    with mlp.graph.as_default():
        grads = pertower.per_example_gradients(mlp.ys, mlp.xs, batch_size=4, rules=registry,
                                               method="rules")
        norms = pertower.per_example_norms(mlp.ys, mlp.xs, batch_size=4, rules=registry,
                                           method="rules")
        plan = _dispatch.make_plan(mlp.ys, mlp.xs, None, 4, rules=registry, validate=False)
        d_outputs, _, _ = _engine.norm_parts(plan, plan.covered, 4)
        sums = _engine.clipped_sums(plan, plan.covered, d_outputs, {},
                                    tf.constant(factors_value))
        want = oracle.loop_per_example_gradients(mlp.sess, mlp.ys, mlp.xs, mlp.feed)
    assert {"per_group", "squared_norms"} <= set(rule.asked)
    assert any(use.rule is rule for uses in plan.uses for use in uses or ())
    got, got_norms, got_sums = mlp.sess.run(
        [grads, norms, [sums[k] for k in plan.covered]], mlp.feed)
    common.assert_all_close(got, want, mlp.rtol, mlp.atol, "extension rule")
    want_norms = np.sqrt(sum(np.sum(g.reshape(4, -1) ** 2, axis=1) for g in want))
    common.assert_all_close([got_norms], [want_norms], mlp.rtol, mlp.atol, "extension norms")
    common.assert_all_close(got_sums, [np.tensordot(factors_value, want[k], axes=1)
                                       for k in plan.covered], mlp.rtol, mlp.atol,
                            "extension clipped sums")


class _DuckDense:
    """A rule that does not derive from `Rule`: match and per_group only."""

    def __init__(self):
        self.inner = _DenseOnRows()

    def match(self, op, slot, analysis):
        return self.inner.match(op, slot, analysis)

    def per_group(self, use, dZ, G):
        return self.inner.per_group(use, dZ, G)


def test_the_registry_adapts_a_duck_typed_rule_and_refuses_a_bad_one(mlp):
    """An object with `match` and `per_group` is wrapped in a `Rule` (the defaults for
    the other quantities: no cheap norm, the clipped sum formed); one without them, or
    with them not callable, is refused naming what is missing."""
    registry = rules_lib.default_registry()
    duck = _DuckDense()
    registry.register("MatMul", duck)
    adapted = registry.lookup("MatMul")
    assert isinstance(adapted, rules_lib.Rule) and adapted.per_group == duck.per_group
    assert adapted.squared_norms(None, None, 4) is None
    assert adapted.output_layouts(None, []) is None
    with mlp.graph.as_default():
        norms = pertower.per_example_norms(mlp.ys, mlp.xs, batch_size=4, rules=registry,
                                           method="rules")
        want = oracle.loop_per_example_gradients(mlp.sess, mlp.ys, mlp.xs, mlp.feed)
    want_norms = np.sqrt(sum(np.sum(g.reshape(4, -1) ** 2, axis=1) for g in want))
    common.assert_all_close([mlp.sess.run(norms, mlp.feed)], [want_norms], mlp.rtol,
                            mlp.atol, "duck-typed rule's norms, formed")
    assert duck.inner.asked and "squared_norms" not in duck.inner.asked

    class _NoPerGroup:
        match = _DuckDense.match
        per_group = "not a method"

    with pytest.raises(TypeError, match=r"`rule` must define `match` and `per_group`.*"
                                        r"which has no `per_group`"):
        registry.register("MatMul", _NoPerGroup())
    with pytest.raises(TypeError, match=r"which has no `match` or `per_group`"):
        registry.register("MatMul", object())
    with pytest.raises(TypeError, match=r"received the class _DenseOnRows; pass an "
                                        r"instance, _DenseOnRows\(\)"):
        registry.register("MatMul", _DenseOnRows)
    assert registry.lookup("MatMul") is adapted   # a refused rule replaces nothing


def test_dropout_in_training_mode_uses_the_same_draws_as_ys():
    """Keras Dropout(training=True) inside its cond: the rules differentiate the very
    draws `ys` used in the same run (no warning, unlike the towers). By hand, for
    ys_i = sum(dropout(x_i W + b)): grad_i(b) = mask_i / (1 - rate), entries 0 or 2,
    grad_i(W) = x_i ⊗ grad_i(b), and ys_i = grad_i(b) · (x_i W + b)."""
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        x = tf.compat.v1.placeholder(tf.float32, [None, 3])
        dense = keras.layers.Dense(8)
        ys = tf.reduce_sum(keras.layers.Dropout(0.5)(dense(x), training=True), axis=1)
        import warnings  # pylint: disable=import-outside-toplevel
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            grads = pertower.per_example_gradients(ys, dense.trainable_weights, method="rules")
        sess.run(tf.compat.v1.global_variables_initializer())
        values = np.random.RandomState(0).randn(5, 3).astype(np.float32)
        (g_w, g_b), y, w, b = sess.run([grads, ys, dense.kernel, dense.bias], {x: values})
    assert set(np.unique(g_b)) <= {0.0, 2.0} and 0 < g_b.mean() < 2
    np.testing.assert_allclose(g_w, values[:, :, None] * g_b[:, None, :], rtol=1e-6)
    terms = g_b * (values @ w + b)   # [B, 8]; float32 sums of 8 terms may cancel, so the
    # tolerance is relative to the terms' sizes (float32 rounding), not to the sum's.
    np.testing.assert_allclose(y, np.sum(terms, axis=1), rtol=1e-5,
                               atol=1e-6 * float(np.abs(terms).sum(axis=1).max()))

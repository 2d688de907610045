"""method="rules" and "auto": every rule against the one-example oracle and the towers.

Each model of `cases.RULE_MODELS` (tests/cases.py) exercises one rule (or the
fallback); its last field lists the weights that must go to the towers, so a test also
fails when a rule silently stops applying (or starts applying where it must not). Every
model is checked on its rules in the default run; the towers, microbatches, a None
batch axis and the DP sums on one model per rule family (`FAST_MODELS`, the others
with -m heavy), the Jacobians on two; each way of the convolution rules on a few
models (`FAST_CONV_ROWS`, the whole matrix with -m heavy). The rules' arguments and user
registries are in tests/test_rules_api.py, XLA-compiled calls in
tests/test_rules_compiled.py.
"""

import numpy as np
import pytest
import tensorflow as tf

import pertower
from pertower import _dispatch
from pertower import oracle
from pertower import rules as rules_lib
from pertower.rules import conv2d
from pertower.rules import depthwise_conv2d
from pertower import _engine as rule_engine
from tests import cases
from tests import common

# one model per rule family (MatMul through Tensordot, BatchMatMul, Einsum, the
# broadcasting ops, LayerNorm, Conv2D, depthwise, gathers, rules and towers mixed): the
# rows of the tests below that check more than the per-example gradients
FAST_MODELS = ("dense_sequence", "batch_matmul", "einsum", "broadcast", "layer_norm",
               "conv_same_strided", "depthwise", "embedding_repeated_ids", "mixed_fallback")


def _rows(names, fast):
    """`model` parameters: the names in `fast` in the default run, the others heavy."""
    return [name if name in fast else pytest.param(name, marks=pytest.mark.heavy)
            for name in names]


ROWS = _rows(sorted(cases.RULE_MODELS), FAST_MODELS)

@pytest.fixture(scope="module", params=sorted(cases.RULE_MODELS))
def model(request):
    build, shapes, options, fallback = cases.RULE_MODELS[request.param]
    case = cases.build_case(request.param, build, shapes, **options)
    case.fallback = fallback
    yield case
    case.sess.close()


def _plan(case):
    with case.graph.as_default():
        return _dispatch.make_plan(case.ys, case.xs, None, case.B, validate=False)


def test_the_rules_cover_exactly_the_expected_weights(model):
    plan = _plan(model)
    fallback = sorted(model.xs[k].op.name for k in plan.fallback)
    assert fallback == sorted(model.fallback), plan.reasons
    for k in plan.fallback:
        assert isinstance(plan.reasons[k], str) and plan.reasons[k]


def test_rules_match_oracle(model):
    with model.graph.as_default():
        if model.fallback:
            # method="rules" is strict: it lists every weight no rule covers
            with pytest.raises(ValueError, match=r"method='rules' is strict, and no rule "
                                                 r"covers .*pertower.explain") as refusal:
                pertower.per_example_gradients(model.ys, model.xs, batch_size=model.B,
                                               method="rules")
            for name in model.fallback:
                assert name in str(refusal.value)
        rules = pertower.per_example_gradients(model.ys, model.xs, batch_size=model.B,
                                               method="auto" if model.fallback else "rules")
        for g, x in zip(rules, model.xs):
            assert g.dtype == x.dtype.base_dtype
            assert g.shape.as_list() == [model.B] + x.shape.as_list()
        want = model.oracles.run(oracle.loop_per_example_gradients, model.sess, model.ys,
                                 model.xs, model.feed)
    model.rules_values = model.sess.run(rules, model.feed)
    common.assert_all_close(model.rules_values, want, model.rtol, model.atol,
                            f"{model.name} rules")


@pytest.mark.parametrize("model", ROWS, indirect=True)
def test_towers_match_the_rules(model):
    """method="towers" on the rule models (one per rule family in the default run: the
    towers' own mechanism is checked on many more models elsewhere)."""
    with model.graph.as_default():
        towers = pertower.per_example_gradients(model.ys, model.xs, batch_size=model.B,
                                                method="towers")
        want = model.oracles.run(oracle.loop_per_example_gradients, model.sess, model.ys,
                                 model.xs, model.feed)
    got_towers = model.sess.run(towers, model.feed)
    common.assert_all_close(got_towers, want, model.rtol, model.atol,
                            f"{model.name} towers")
    if getattr(model, "rules_values", None) is not None:
        common.assert_all_close(model.rules_values, got_towers, model.rtol, model.atol,
                                f"{model.name} rules vs towers")


@pytest.mark.parametrize("model", ROWS, indirect=True)
def test_rules_on_a_none_batch_axis_work_for_any_fed_size(model):
    if model.fallback:
        with model.graph.as_default():
            with pytest.raises(ValueError, match=r"no `batch_size` was given.*fall back to "
                                                 r"towers.*Pass batch_size=B"):
                pertower.per_example_gradients(model.ys, model.xs)
        return
    with model.graph.as_default():
        rules = pertower.per_example_gradients(model.ys, model.xs, method="rules")
        assert all(g.shape[0] is None or g.shape.as_list()[0] is None for g in rules)
        for size in (1, 3):
            feed = {k: v[:size] for k, v in model.feed.items()}
            want = model.oracles.run(oracle.loop_per_example_gradients, model.sess, model.ys,
                                     model.xs, feed)
            common.assert_all_close(model.sess.run(rules, feed), want, model.rtol, model.atol,
                                    f"{model.name} rules, {size} examples")


@pytest.mark.parametrize("model", ROWS, indirect=True)
def test_microbatches_match_oracle(model):
    with model.graph.as_default():
        two = pertower.microbatch_gradients(model.ys, model.xs, num_microbatches=2,
                                            batch_size=model.B)
        want_two = model.oracles.run(oracle.loop_microbatch_gradients, model.sess, model.ys,
                                     model.xs, model.feed, 2)
    common.assert_all_close(model.sess.run(two, model.feed), want_two, model.rtol,
                            model.atol * 10, f"{model.name} two microbatches")


# The Jacobians ask each rule for per-example gradients (checked on every model above)
# once per output entry: one model on the rules and one mixing rules and towers in the
# default run, the others with -m heavy.
JACOBIAN_ROWS = _rows(sorted(cases.RULE_MODELS), ("dense_sequence", "mixed_fallback"))


@pytest.mark.parametrize("model", JACOBIAN_ROWS, indirect=True)
def test_jacobians_match_oracle(model):
    with model.graph.as_default():
        outputs = tf.stack([model.ys, tf.sin(model.ys)], axis=1)      # [B, 2]
        jacobians = pertower.per_example_jacobians(outputs, model.xs, batch_size=model.B,
                                                   method="auto")
        want_jacobians = model.oracles.run(oracle.loop_per_example_jacobians, model.sess,
                                           outputs, model.xs, model.feed)
    common.assert_all_close(model.sess.run(jacobians, model.feed), want_jacobians,
                            model.rtol, model.atol, f"{model.name} Jacobians")


@pytest.mark.parametrize("model", ROWS, indirect=True)
def test_every_rule_s_clipped_sum_is_the_reweighted_oracle(model):
    """The DP sums: sum_i f_i g_i through each rule's own clipped_sum (dZ scaled per
    example; no per-example gradient formed), and through Built.clipped_sum (norms,
    factors and sums of one backward pass; towers for the weights without a rule),
    against the one-example loop clipped in NumPy."""
    case = model
    factors_value = np.linspace(0.2, 1.3, case.B).astype(case.ys.dtype.as_numpy_dtype)
    clip = 0.7
    with case.graph.as_default():
        plan = _dispatch.make_plan(case.ys, case.xs, None, case.B, validate=False)
        factors = tf.constant(factors_value)
        d_outputs, _, _ = rule_engine.norm_parts(plan, plan.covered, case.B)
        by_rules = rule_engine.clipped_sums(plan, plan.covered, d_outputs, {}, factors)
        built = _dispatch.build(plan)
        norms, built_factors, sums = built.clipped_sum(
            lambda n: clip / tf.maximum(n, clip))
        per_example = case.oracles.run(oracle.loop_per_example_gradients, case.sess,
                                       case.ys, case.xs, case.feed)
    got_rules, got_built = case.sess.run(
        [[by_rules[k] for k in plan.covered], [norms, built_factors, sums]], case.feed)
    want = [np.tensordot(factors_value, per_example[k], axes=1) for k in plan.covered]
    common.assert_all_close(got_rules, want, case.rtol, case.atol, f"{case.name} rule clipped sums")
    flat = [g.reshape(case.B, -1) for g in per_example]
    want_norms = np.sqrt(sum(np.sum(g ** 2, axis=1) for g in flat))              # [B]
    want_factors = clip / np.maximum(want_norms, clip)
    want_sums = [np.tensordot(want_factors, g, axes=1) for g in per_example]
    common.assert_all_close([got_built[0], got_built[1]], [want_norms, want_factors],
                            case.rtol, case.atol, f"{case.name} norms and factors")
    common.assert_all_close(got_built[2], want_sums, case.rtol, case.atol,
                            f"{case.name} Built.clipped_sum")


CONV_MODELS = ("conv_same_strided", "conv_valid_dilated", "conv_explicit_float64",
               "conv_same_dilated_odd", "grouped_conv", "keras_conv1d", "depthwise",
               "time_distributed_conv")


def _forced_conv_registry(strategy, **options):
    """The default rules with every convolution computed the way `strategy` says."""
    registry = rules_lib.default_registry()
    forced = conv2d.ConvOptions(strategy=strategy, **options)
    conv2d.register(registry, forced)
    depthwise_conv2d.register(registry, forced)
    return registry


STRATEGIES = (
    ("patches", {}), ("grouped", {}), ("depthwise", {}),
    ("shifts", {}),                      # these models' thin channels: the taps stacked
    ("shifts", {"thin_channels": 0, "few_positions": 0}),    # a matmul per tap
)
# (model, index in STRATEGIES) in the default run: every way once, on the models whose
# geometry the tests above leave to "auto" (dilations, groups, explicit padding and
# float64, Conv1D, k images per example); the whole matrix with -m heavy
FAST_CONV_ROWS = {("conv_valid_dilated", 0), ("grouped_conv", 0),
                  ("conv_same_dilated_odd", 1), ("depthwise", 2),
                  ("conv_explicit_float64", 3), ("time_distributed_conv", 3),
                  ("keras_conv1d", 4)}


# (the `model` fixture's graphs and oracle values, shared with the tests above)
@pytest.mark.parametrize("model, strategy, options", [
    pytest.param(name, strategy, options, id=f"{name}-{strategy}-options{k}",
                 marks=() if (name, k) in FAST_CONV_ROWS else pytest.mark.heavy)
    for name in CONV_MODELS for k, (strategy, options) in enumerate(STRATEGIES)],
    indirect=["model"])
def test_every_conv_strategy_matches_the_oracle(model, strategy, options):
    """Each way of the convolution rules (rules/conv2d.py), forced on every convolution
    (strides, SAME/VALID/explicit padding, dilations, groups, Conv1D, depthwise, k = 3
    images per example): per-example gradients for a fixed B and for a None batch axis (G read
    at run time), and two microbatches (several images per group), against the oracle.
    Where the way cannot compute a convolution (float64; no oneDNN), method='rules'
    refuses and names the forced strategy."""
    case = model
    registry = _forced_conv_registry(strategy, **options)
    with case.graph.as_default():
        try:
            fixed = pertower.per_example_gradients(case.ys, case.xs, batch_size=case.B,
                                                   method="rules", rules=registry)
        except ValueError as refusal:
            if "does not take grouped convolutions" in str(refusal):
                assert case.name == "grouped_conv" and strategy in ("grouped", "depthwise")
                return
            assert f"the forced strategy {strategy!r} needs" in str(refusal)
            assert strategy in ("grouped", "depthwise"), refusal
            assert (case.ys.dtype != tf.float32 or not conv2d.onednn_enabled()), refusal
            return
        free = pertower.per_example_gradients(case.ys, case.xs, method="rules",
                                              rules=registry)
        two = pertower.microbatch_gradients(case.ys, case.xs, num_microbatches=2,
                                            batch_size=case.B, method="rules",
                                            rules=registry)
        want = case.oracles.run(oracle.loop_per_example_gradients, case.sess, case.ys,
                                case.xs, case.feed)
        want_two = case.oracles.run(oracle.loop_microbatch_gradients, case.sess, case.ys,
                                    case.xs, case.feed, 2)
        three = {k: v[:3] for k, v in case.feed.items()}
        want_three = case.oracles.run(oracle.loop_per_example_gradients, case.sess,
                                      case.ys, case.xs, three)
    got, got_two = case.sess.run([fixed, two], case.feed)
    what = f"{case.name}, strategy {strategy} {options}"
    common.assert_all_close(got, want, case.rtol, case.atol, what)
    common.assert_all_close(got_two, want_two, case.rtol, case.atol * 10,
                            f"{what}, two microbatches")
    common.assert_all_close(case.sess.run(free, three), want_three, case.rtol, case.atol,
                            f"{what}, 3 examples, no batch_size")


def test_a_forced_conv_strategy_that_cannot_run_falls_back_with_its_reason():
    """Without oneDNN's kernels (ConvOptions(onednn=False) says so) "grouped" cannot
    compute a Conv2D: the weight falls back to the towers with the reason, and "auto"
    uses the shifts. Bad options are refused, naming the argument."""
    build, shapes, options, _ = cases.RULE_MODELS["conv_same_strided"]
    case = cases.build_case("conv_same_strided", build, shapes, **options)
    with case.graph.as_default():
        registry = _forced_conv_registry("grouped", onednn=False)
        with pytest.raises(ValueError, match=r"the forced strategy 'grouped' needs "
                                             r"TensorFlow's oneDNN CPU kernels"):
            pertower.per_example_gradients(case.ys, case.xs, batch_size=case.B,
                                           method="rules", rules=registry)
        auto = _forced_conv_registry("auto", onednn=False)
        got = pertower.per_example_gradients(case.ys, case.xs, batch_size=case.B,
                                             method="rules", rules=auto)
        want = case.oracles.run(oracle.loop_per_example_gradients, case.sess, case.ys,
                                case.xs, case.feed)
    common.assert_all_close(case.sess.run(got, case.feed), want, case.rtol, case.atol,
                            "auto without oneDNN")
    with pytest.raises(ValueError, match=r"`strategy` must be one of auto, patches, grouped, "
                                         r"depthwise, shifts, examples, but received 'im2col'"):
        conv2d.ConvOptions(strategy="im2col")
    for name in ("thin_channels", "few_positions"):
        with pytest.raises(ValueError, match=rf"`{name}` must be an int >= 0, but "
                                             r"received -1"):
            conv2d.ConvOptions(**{name: -1})
    with pytest.raises(TypeError, match=r"`options` must be a ConvOptions"):
        conv2d.Conv2DRule("grouped")
    case.sess.close()
    with tf.Graph().as_default():      # heights and widths known only at run time
        x = tf.compat.v1.placeholder(tf.float32, [None, None, None, 2])
        w = tf.compat.v1.get_variable("w", [3, 3, 2, 3])
        ys = tf.reduce_sum(tf.nn.conv2d(x, w, 1, "SAME") ** 2, axis=[1, 2, 3])
        with pytest.raises(ValueError, match=r"the forced strategy 'shifts' needs static "
                                             r"input and output heights and widths"):
            pertower.per_example_gradients(ys, [w], batch_size=2, method="rules",
                                           rules=_forced_conv_registry("shifts"))


@pytest.mark.parametrize("layer, chosen, without", [
    # (H = W, Cin, Cout, k, stride) of a SAME convolution -> the way "auto" picks with
    # oneDNN, and without it ("examples" from P = 64 positions, Cin >= 8, k > 1)
    ((32, 3, 32, 3, 1), "shifts", "shifts"),        # the CIFAR net's first layer: Cin 3
    ((16, 32, 64, 3, 1), "grouped", "examples"),    # P = 256 >= Cout
    ((32, 1, 16, 5, 1), "shifts", "shifts"),        # the scenario-3 CNN: 1 input channel
    ((16, 8, 8, 3, 1), "grouped", "examples"),      # 256 >= 8
    ((8, 64, 64, 3, 1), "grouped", "examples"),     # 64 >= 64
    ((8, 64, 64, 3, 2), "shifts", "shifts"),        # 16 < 64
    ((4, 128, 128, 3, 1), "shifts", "shifts"),      # few positions, many channels
    ((16, 64, 64, 1, 1), "shifts", "shifts"),       # 1x1: one matmul
])
def test_the_conv_cost_model_picks_the_measured_faster_way(layer, chosen, without):
    H, c_in, c_out, k, stride = layer
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, H, H, c_in])
        w = tf.compat.v1.get_variable("w", [k, k, c_in, c_out])
        z = tf.nn.conv2d(x, w, stride, "SAME")
        use = rules_lib.Use(z.op, 1, None, x, z, w.shape, None)
        assert conv2d.Conv2DRule(conv2d.ConvOptions(onednn=True)).strategy(use) == chosen
        assert conv2d.Conv2DRule(conv2d.ConvOptions(onednn=False)).strategy(use) == without
        # heights and widths known only at run time: the patches
        free = tf.compat.v1.placeholder(tf.float32, [None, None, None, c_in])
        z = tf.nn.conv2d(free, w, stride, "SAME")
        use = rules_lib.Use(z.op, 1, None, free, z, w.shape, None)
        assert conv2d.Conv2DRule(conv2d.ConvOptions(onednn=True)).strategy(use) == "patches"


def test_the_cifar_conv_net_is_covered_by_rules_and_matches_the_oracle():
    """Every weight of the bench's CIFAR net has a rule; its second and third
    convolutions take the grouped way with oneDNN ("examples" without) and the first
    (3 input channels) the shifts, all exact."""
    case = cases.build_cifar_case()
    with case.graph.as_default():
        plan = _plan(case)
        assert not plan.fallback, plan.reasons
        convs = [use for uses in plan.uses for use in uses or () if use.op.type == "Conv2D"]
        chosen = [use.rule.strategy(use) for use in convs]
        if conv2d.onednn_enabled():
            assert chosen == ["shifts", "grouped", "grouped"], chosen
        else:
            assert chosen == ["shifts", "examples", "examples"], chosen
        got = pertower.per_example_gradients(case.ys, case.xs, batch_size=case.B,
                                             method="rules")
        want = case.oracles.run(oracle.loop_per_example_gradients, case.sess, case.ys,
                                case.xs, case.feed)
    common.assert_all_close(case.sess.run(got, case.feed), want, case.rtol, case.atol,
                            "cifar rules")
    case.sess.close()

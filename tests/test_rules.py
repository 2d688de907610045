"""method="rules" and "auto": every rule against the one-example oracle and the towers.

Each model of `cases.RULE_MODELS` (tests/cases.py) exercises one rule (or the
fallback); its last field lists the weights that must go to the towers, so a test also
fails when a rule silently stops applying (or starts applying where it must not).
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import pertower
from pertower._api import gradients as gradients_lib
from pertower import _dispatch
from pertower import oracle
from pertower import rules as rules_lib
from pertower.rules import conv2d
from pertower.rules import depthwise_conv2d
from pertower.rules import _engine as rule_engine
from tests import cases
from tests import common


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


def test_rules_match_oracle_and_towers(model):
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
        towers = pertower.per_example_gradients(model.ys, model.xs, batch_size=model.B,
                                                method="towers")
        for g, x in zip(rules, model.xs):
            assert g.dtype == x.dtype.base_dtype
            assert g.shape.as_list() == [model.B] + x.shape.as_list()
        want = model.oracles.run(oracle.loop_per_example_gradients, model.sess, model.ys,
                                 model.xs, model.feed)
    got_rules, got_towers = model.sess.run([rules, towers], model.feed)
    common.assert_all_close(got_rules, want, model.rtol, model.atol, f"{model.name} rules")
    common.assert_all_close(got_rules, got_towers, model.rtol, model.atol,
                            f"{model.name} rules vs towers")


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


def test_microbatches_and_jacobians_match_oracle(model):
    with model.graph.as_default():
        two = pertower.microbatch_gradients(model.ys, model.xs, num_microbatches=2,
                                            batch_size=model.B)
        outputs = tf.stack([model.ys, tf.sin(model.ys)], axis=1)      # [B, 2]
        jacobians = pertower.per_example_jacobians(outputs, model.xs, batch_size=model.B,
                                                   method="auto")
        want_two = model.oracles.run(oracle.loop_microbatch_gradients, model.sess, model.ys,
                                     model.xs, model.feed, 2)
        want_jacobians = model.oracles.run(oracle.loop_per_example_jacobians, model.sess,
                                           outputs, model.xs, model.feed)
    got_two, got_jacobians = model.sess.run([two, jacobians], model.feed)
    common.assert_all_close(got_two, want_two, model.rtol, model.atol * 10,
                            f"{model.name} two microbatches")
    common.assert_all_close(got_jacobians, want_jacobians, model.rtol, model.atol,
                            f"{model.name} Jacobians")


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


@pytest.mark.parametrize("strategy, options", [
    ("patches", {}), ("grouped", {}), ("depthwise", {}),
    ("shifts", {}),                      # these models' thin channels: the taps stacked
    ("shifts", {"thin_channels": 0, "few_positions": 0}),    # a matmul per tap
])
# (the `model` fixture's graphs and oracle values, shared with the tests above)
@pytest.mark.parametrize("model", CONV_MODELS, indirect=True)
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
    with pytest.raises(ValueError, match=r"`strategy` must be one of auto, patches, "
                                         r"grouped, depthwise, shifts, but received 'im2col'"):
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


def _compiled_calls(graph, scope):
    """The function-call ops under `scope` and whether each is XLA-compiled."""
    return [(op.type, op.get_attr("_XlaMustCompile") if "_XlaMustCompile" in op.node_def.attr
             else False)
            for op in graph.get_operations()
            if op.name.startswith(scope) and op.type in ("PartitionedCall",
                                                          "StatefulPartitionedCall")]


def test_keras_grouped_conv_under_the_towers_before_any_gradient():
    """Keras Conv2D(groups=2) when nothing differentiated its XLA-compiled call yet: the
    towers replay the call compiled (not as an If whose lowering would run the grouped
    convolution on CPU kernels, which have none without oneDNN) and differentiate it
    with a compiled call too; per-example gradients, norms and two microbatches match
    the loop, and the user's call op stays compiled."""
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(3)
        x = tf.compat.v1.placeholder(tf.float32, [None, 5, 4, 4])
        conv = keras.layers.Conv2D(6, (3, 2), groups=2, padding="same")
        ys = tf.reduce_sum(tf.sin(conv(x)), axis=[1, 2, 3])
        xs = conv.trainable_weights
        (call,) = [op for op in graph.get_operations() if op.type == "PartitionedCall"]
        outputs = len(call.outputs)
        grads = pertower.per_example_gradients(ys, xs, batch_size=3, method="towers")
        norms = pertower.per_example_norms(ys, xs, batch_size=3, method="towers")
        two = pertower.microbatch_gradients(ys, xs, num_microbatches=2, batch_size=4,
                                            method="towers")
        towers = _compiled_calls(graph, "per_example_gradients/")
        assert towers and all(compiled for _, compiled in towers), towers
        # the user's call keeps its output and its compilation; the towers may leave it
        # with the extra outputs a tf.gradients through it would add (so that a
        # gradient the user builds after the first run still works)
        assert len(call.outputs) >= outputs and call.get_attr("_XlaMustCompile"), call
        loop = oracle.SliceLoop(ys, xs)      # before the first run, see `cases.build_case`
        sess = tf.compat.v1.Session(graph=graph)
        sess.run(tf.compat.v1.global_variables_initializer())
    feed = {x: np.random.RandomState(3).randn(4, 5, 4, 4).astype(np.float32)}
    three = {x: feed[x][:3]}
    want = common.run_oracle(loop.run, sess, three, 3)
    want_two = common.run_oracle(loop.run, sess, feed, 2)
    got, got_norms = sess.run([grads, norms], three)
    got_two = sess.run(two, feed)
    common.assert_all_close(got, want, what="Keras grouped conv, towers")
    common.assert_all_close(
        [got_norms], [np.sqrt(sum(np.sum(w.reshape(3, -1) ** 2, axis=1) for w in want))],
        what="Keras grouped conv, norms")
    common.assert_all_close(got_two, want_two, atol=1e-5, what="two microbatches")
    sess.close()


def test_an_xla_compiled_function_reading_weights_is_replayed_compiled():
    """A tf.function(jit_compile=True) that reads variables itself (a grouped
    tf.nn.conv2d filter [3, 3, 4/2, 4] and a scale): the towers give the compiled call
    their copies as values (one copy of the function for all towers) and
    differentiate it compiled; the scale, read in the function but left out of `xs`,
    stays a variable. Against the loop; then a second derivative through the compiled
    gradient matches plain TensorFlow's."""
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(4)
        x = tf.compat.v1.placeholder(tf.float32, [None, 5, 5, 4])
        w = tf.compat.v1.get_variable("w_compiled", [3, 3, 2, 4])
        scale = tf.compat.v1.get_variable("scale_compiled", [],
                                          initializer=tf.compat.v1.constant_initializer(1.5))

        @tf.function(jit_compile=True)
        def grouped(images):
            return tf.nn.conv2d(images, w, 1, "VALID") * scale

        ys = tf.reduce_sum(tf.tanh(grouped(x)) ** 2, axis=[1, 2, 3])
        (both_w, both_scale) = pertower.per_example_gradients(ys, [w, scale], batch_size=2,
                                                              method="towers", validate=False)
        (only_w,) = pertower.per_example_gradients(ys, [w], batch_size=2, method="towers",
                                                   validate=False)
        # d/dx sum_i |g_i|^2 (a gradient penalty) through the compiled backward call
        penalty = tf.gradients(tf.reduce_sum(only_w ** 2), x)[0]
        loop = oracle.SliceLoop(ys, [w, scale])
        one = [tf.gradients(tf.reduce_sum(tf.tanh(tf.nn.conv2d(x[i:i + 1], w, 1, "VALID")
                                                      * scale) ** 2), w)[0]
               for i in range(2)]
        want_penalty = tf.gradients(sum(tf.reduce_sum(g ** 2) for g in one), x)[0]
        sess = tf.compat.v1.Session(graph=graph)
        sess.run(tf.compat.v1.global_variables_initializer())
    feed = {x: np.random.RandomState(4).randn(2, 5, 5, 4).astype(np.float32)}
    with sess:
        want = common.run_oracle(loop.run, sess, feed, 2)
        got = sess.run([both_w, both_scale, only_w, penalty], feed)
        common.assert_all_close(got[:3], want + want[:1], what="compiled function, towers")
        # plain TensorFlow's second derivative runs the grouped convolution uncompiled:
        # the plain CPU kernels (no oneDNN) have none, and run_oracle skips, saying so
        reference_penalty = common.run_oracle(sess.run, want_penalty, feed)
        common.assert_all_close([got[3]], [reference_penalty], rtol=1e-3, atol=1e-4,
                                what="second derivative")


def test_an_xla_compiled_function_that_draws_random_numbers_is_refused():
    """The compiled gradient runs the call again; random draws inside it would differ
    from the forward pass's, so the towers refuse at build time, naming the call."""
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 4])
        w = tf.compat.v1.get_variable("w_noisy", [4, 3])

        @tf.function(jit_compile=True)
        def noisy(rows, kernel):
            return tf.matmul(rows, kernel) * tf.random.uniform([3])

        ys = tf.reduce_sum(noisy(x, tf.convert_to_tensor(w)) ** 2, axis=1)
        with pytest.raises(NotImplementedError,
                           match=r"^pertower\.per_example_gradients: .*"
                                 r"cannot differentiate the XLA-compiled function call "
                                 r"'.*PartitionedCall'.*draws random numbers "
                                 r"\(RandomUniform\).*out of `xs`"):
            pertower.per_example_gradients(ys, [w], batch_size=2, method="towers")


@pytest.mark.parametrize("layer, chosen", [
    # (H = W, Cin, Cout, k, stride) of a SAME convolution -> the way "auto" picks with
    # oneDNN (without it: "shifts" for all)
    ((32, 3, 32, 3, 1), "shifts"),       # the CIFAR net's first layer: 3 input channels
    ((16, 32, 64, 3, 1), "grouped"),     # P k^2 / sqrt(Cin Cout) = 51
    ((32, 1, 16, 5, 1), "shifts"),       # the scenario-3 CNN: 1 input channel
    ((16, 8, 8, 3, 1), "grouped"),       # 288
    ((8, 64, 64, 3, 1), "shifts"),       # 9
    ((4, 128, 128, 3, 1), "shifts"),     # few positions, many channels
    ((16, 64, 64, 1, 1), "shifts"),      # 1x1: one matmul
])
def test_the_conv_cost_model_picks_the_measured_faster_way(layer, chosen):
    H, c_in, c_out, k, stride = layer
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, H, H, c_in])
        w = tf.compat.v1.get_variable("w", [k, k, c_in, c_out])
        z = tf.nn.conv2d(x, w, stride, "SAME")
        use = rules_lib.Use(z.op, 1, None, x, z, w.shape, None)
        assert conv2d.Conv2DRule(conv2d.ConvOptions(onednn=True)).strategy(use) == chosen
        assert conv2d.Conv2DRule(conv2d.ConvOptions(onednn=False)).strategy(use) == "shifts"
        # heights and widths known only at run time: the patches
        free = tf.compat.v1.placeholder(tf.float32, [None, None, None, c_in])
        z = tf.nn.conv2d(free, w, stride, "SAME")
        use = rules_lib.Use(z.op, 1, None, free, z, w.shape, None)
        assert conv2d.Conv2DRule(conv2d.ConvOptions(onednn=True)).strategy(use) == "patches"


def test_the_cifar_conv_net_is_covered_by_rules_and_matches_the_oracle():
    """Every weight of the bench's CIFAR net has a rule; its second convolution takes
    the grouped way with oneDNN and the others the shifts, all exact."""
    case = cases.build_cifar_case()
    with case.graph.as_default():
        plan = _plan(case)
        assert not plan.fallback, plan.reasons
        convs = [use for uses in plan.uses for use in uses or () if use.op.type == "Conv2D"]
        chosen = [use.rule.strategy(use) for use in convs]
        if conv2d.onednn_enabled():
            assert chosen == ["shifts", "grouped", "shifts"], chosen
        else:
            assert chosen == ["shifts"] * 3, chosen
        got = pertower.per_example_gradients(case.ys, case.xs, batch_size=case.B,
                                             method="rules")
        want = case.oracles.run(oracle.loop_per_example_gradients, case.sess, case.ys,
                                case.xs, case.feed)
    common.assert_all_close(case.sess.run(got, case.feed), want, case.rtol, case.atol,
                            "cifar rules")
    case.sess.close()


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
    """A user rule for the BroadcastTo that spreads a squared weight over the batch's
    shape: it refuses with a reason (kept in the plan)."""

    def match(self, op, slot, analysis):
        return "a user rule that declines"

    def per_group(self, use, dZ, G):
        raise AssertionError("never called")


def test_a_user_registry_replaces_and_adds_rules(mlp):
    registry = rules_lib.default_registry()
    counting = _CountingRule()
    registry.register("MatMul", counting)
    registry.register("BroadcastTo", _SquareRule())
    assert "MatMul" in registry.op_types() and "BroadcastTo" in registry.op_types()
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
        from pertower import _batch_axis  # pylint: disable=import-outside-toplevel
        if not isinstance(inputs[0], _batch_axis.Rows) or inputs[1] != inputs[0]:
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
    np.testing.assert_allclose(y, np.sum(g_b * (values @ w + b), axis=1), rtol=1e-5)

"""The DP step's faster paths against the one-example loop.

Conv2D's `formed_norms` (one batched matmul over the stacked taps, the per-example
gradients kept in [B, kh*kw, Cout, Cin] for the clipped sum): its norms and clipped
sums, and a DPOptimizer step with σ = 0, against the loop's per-example gradients
clipped in NumPy. The per-tap path is forced on small shapes with
`ConvOptions("shifts", thin_channels=1, few_positions=1)`; one model takes it with the
default options (with oneDNN on, the grouped way the cost model picks for it instead).
"""

import sys

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import pertower
from pertower import _dispatch
from pertower import oracle
from pertower.rules import conv2d
from pertower.rules import registry as registry_lib
from tests import cases
from tests import common

CLIP = 0.7
LEARNING_RATE = 0.5


def _tap_registry():
    """The default rules with Conv2D's per-tap "shifts" on any shape."""
    registry = pertower.rules.default_registry()
    registry.register("Conv2D", conv2d.Conv2DRule(conv2d.ConvOptions(
        "shifts", thin_channels=1, few_positions=1)))
    return registry


def _conv(strides, padding, dilations, channels=2, dtype=tf.float32):
    def build(x):                   # tf.nn.conv2d on [B, 7, 6, channels], filter 3x2
        w = cases.random_normal_variable([3, 2, channels, 3], "filter", dtype)
        b = cases.random_normal_variable([3], "bias", dtype)
        z = tf.nn.bias_add(tf.nn.conv2d(x, w, strides, padding, dilations=dilations), b)
        return tf.reduce_sum(tf.tanh(z) ** 2, axis=[1, 2, 3]), [w, b]
    return build


def _two_convs(x):                 # Keras Conv2D twice (the second on the first's output)
    first = keras.layers.Conv2D(4, 3, padding="same", activation="tanh")
    second = keras.layers.Conv2D(2, 2, strides=2, activation="tanh")
    z = second(first(x))
    return tf.reduce_sum(z ** 2, axis=[1, 2, 3]), (first.trainable_weights +
                                                    second.trainable_weights)


def _time_distributed(x):          # [B, 3, 6, 6, 2]: 3 images per example
    layer = keras.layers.TimeDistributed(keras.layers.Conv2D(3, 3, padding="same"))
    return tf.reduce_sum(tf.tanh(layer(x)) ** 2, axis=[1, 2, 3, 4]), layer.trainable_weights


def _conv1d(x):                     # Keras Conv1D: ExpandDims(W) is [1, 3, 2, 3]
    layer = keras.layers.Conv1D(3, 3, padding="same", activation="tanh")
    return tf.reduce_sum(layer(x) ** 2, axis=[1, 2]), layer.trainable_weights


MEMBERS = {
    "same": (_conv([1, 1, 1, 1], "SAME", [1, 1, 1, 1]), [(7, 6, 2)], {}),
    "strided_valid": (_conv([1, 2, 2, 1], "VALID", [1, 1, 1, 1]), [(7, 6, 2)], {}),
    "explicit": (_conv([1, 1, 2, 1], [[0, 0], [1, 2], [0, 1], [0, 0]], [1, 1, 1, 1]),
                 [(7, 6, 2)], {}),
    "float64": (_conv([1, 1, 1, 1], "SAME", [1, 1, 1, 1], dtype=tf.float64),
                [(7, 6, 2)], {"dtype": tf.float64}),
    "two_convs": (_two_convs, [(6, 6, 3)], {}),
    "time_distributed": (_time_distributed, [(3, 6, 6, 2)], {}),
    "conv1d": (_conv1d, [(9, 2)], {}),
}


def _reference(per_example, clip):
    """NumPy: (norms [B], sum_i min(1, C/n_i) g_i per weight) of the loop's gradients."""
    B = per_example[0].shape[0]
    norms = np.sqrt(sum(np.sum(g.reshape(B, -1) ** 2, axis=1) for g in per_example))
    factors = clip / np.maximum(norms, clip)
    return norms, [np.tensordot(factors, g, axes=1) for g in per_example]


def _formed_conv_uses(plan):
    """The Conv2D uses whose norms the rule forms itself (`Conv2DRule.formed_norms`)."""
    found = []
    with plan.request.graph.as_default():
        for uses in plan.uses:
            for use in uses or ():
                if isinstance(use.rule, conv2d.Conv2DRule):
                    dZ = tf.zeros_like(use.output)
                    if isinstance(use.rule.formed_norms(use, dZ, 3),
                                  registry_lib.FormedNorms):
                        found.append(use)
    return found


FAST = ("same", "time_distributed")   # the others are marked heavy


@pytest.mark.parametrize("name", [name if name in FAST else pytest.param(
    name, marks=pytest.mark.heavy) for name in sorted(MEMBERS)])
def test_formed_norms_and_clipped_sums_are_the_loop_s(name):
    build, shapes, options = MEMBERS[name]
    case = cases.build_case(name, build, shapes, B=3, **options)
    with case.graph.as_default():
        plan = _dispatch.make_plan(case.ys, case.xs, None, case.B, rules=_tap_registry(),
                                   validate=False)
        formed = _formed_conv_uses(plan)
        built = _dispatch.build(plan)
        norms, _, sums = built.clipped_sum(lambda n: CLIP / tf.maximum(n, CLIP))
        squares = built.squared_norms()
        per_example = common.run_oracle(oracle.loop_per_example_gradients, case.sess,
                                        case.ys, case.xs, case.feed)
        got_norms, got_squares, got_sums = case.sess.run([norms, squares, sums], case.feed)
    case.sess.close()
    assert formed, f"{name}: no Conv2D use took the formed-norms path"
    want_norms, want_sums = _reference(per_example, CLIP)
    assert np.all(want_norms > CLIP * 0.01)
    common.assert_all_close([got_norms, got_squares], [want_norms, want_norms ** 2],
                            case.rtol, case.atol, f"{name} norms")
    common.assert_all_close(got_sums, want_sums, case.rtol, case.atol,
                            f"{name} clipped sums")


def _wide_conv(x):                 # [B, 8, 8, 8]: Cin 8, 64 positions: the default path
    conv = keras.layers.Conv2D(4, 3, padding="same", activation="tanh")
    dense = keras.layers.Dense(1)
    h = tf.reduce_mean(conv(x), axis=[1, 2])
    return tf.reduce_sum(dense(h) ** 2, axis=1), conv.trainable_weights + dense.trainable_weights


def test_dp_optimizer_step_without_noise_is_the_loop_s_on_the_default_path():
    case = cases.build_case("wide_conv", _wide_conv, [(8, 8, 8)], B=3)
    with case.graph.as_default():
        plan = _dispatch.make_plan(case.ys, case.xs, None, case.B, validate=False)
        # the rule forms the norms itself unless its cost model picks oneDNN's grouped
        # kernel (oneDNN on: Cin 8, 64 positions), whose per-group gradients the engine
        # keeps
        convs = [use for uses in plan.uses for use in uses or ()
                 if isinstance(use.rule, conv2d.Conv2DRule)]
        grouped = [use for use in convs if use.rule.strategy(use) == "grouped"]
        assert len(convs) == 1 and bool(grouped) == conv2d.onednn_enabled(), convs
        assert bool(_formed_conv_uses(plan)) != bool(grouped), "not the default path"
        per_example = common.run_oracle(oracle.loop_per_example_gradients, case.sess,
                                        case.ys, case.xs, case.feed)
        before = case.sess.run(case.xs)
        norms = np.sqrt(sum(np.sum(g.reshape(case.B, -1) ** 2, axis=1)
                            for g in per_example))
        clip = float(np.median(norms))    # some examples clipped, some not
        dp = pertower.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer(LEARNING_RATE),
                                  l2_norm_clip=clip, noise_multiplier=0.0)
        step = dp.minimize(case.ys, var_list=case.xs, batch_size=case.B)
        case.sess.run(step, case.feed)
        after = case.sess.run(case.xs)
    case.sess.close()
    _, sums = _reference(per_example, clip)
    want = [w - LEARNING_RATE * s / case.B for w, s in zip(before, sums)]
    common.assert_all_close(after, want, case.rtol, case.atol, "DP step")


def test_add_noise_takes_the_weights_pieces_of_one_aligned_draw():
    # P = 7 + 12 = 19 (odd): the [2h] draws (h = 16) are split into [7], [12] and an
    # unused tail; a gradient of unknown shape gets its piece too
    from pertower._dp import noise as noise_lib  # pylint: disable=import-outside-toplevel
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        key = tf.constant([4, 9], tf.int64)
        dynamic = tf.compat.v1.placeholder(tf.float32, [None, 4])
        gradients = [tf.ones([7]), dynamic]
        noised = noise_lib.add_noise(gradients, [2.0, 0.5], key)
        pairs = noise_lib.normal_pairs(19, key)
        first = noise_lib.standard_normal(19, key)
        got, draws, head = sess.run([noised, pairs, first], {dynamic: np.zeros([3, 4])})
    assert draws.shape == (32,) and head.shape == (19,)
    np.testing.assert_array_equal(head, draws[:19])
    np.testing.assert_allclose(got[0], 1.0 + 2.0 * draws[:7], rtol=1e-6)
    np.testing.assert_allclose(got[1], 0.5 * draws[7:19].reshape(3, 4), rtol=1e-6)
    assert len(set(np.round(draws, 6))) == 32   # 32 distinct draws


# The bench's noise reference row, with a stand-in torch on the child's path ----------

_FAKE_TORCH = '''
__version__ = "0.fake"
float32 = "float32"


class _Tensor:
    def __init__(self, size):
        self.size = size
        self.filled = 0

    def normal_(self):
        self.filled += 1
        return self


def empty(size, dtype=None):
    return _Tensor(size)


def get_num_threads():
    return 1
'''


@pytest.fixture
def fake_torch(tmp_path, monkeypatch):
    """This interpreter, with a stand-in `torch` module first on the child's path."""
    (tmp_path / "torch.py").write_text(_FAKE_TORCH)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    return sys.executable


def test_the_torch_noise_child_times_each_size(fake_torch):
    from benchmarks import peers_noise  # pylint: disable=import-outside-toplevel
    runs = peers_noise.torch_normal_runs([5, 7], 3, fake_torch)
    assert sorted(runs) == [5, 7] and all(len(r) == 3 and min(r) >= 0 for r in runs.values())


def test_the_torch_noise_child_failure_names_its_cause(tmp_path, monkeypatch):
    from benchmarks import peers_noise  # pylint: disable=import-outside-toplevel
    (tmp_path / "torch.py").write_text("raise ImportError('no torch here')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with pytest.raises(RuntimeError, match="no torch here"):
        peers_noise.torch_normal_runs([5], 1, sys.executable)


@pytest.mark.heavy
def test_dp_bench_shows_the_torch_noise_row_beside_the_draw(fake_torch):
    from benchmarks import dp  # pylint: disable=import-outside-toplevel
    entries = dp.run_dp_bench(models=["mlp"], batch_sizes=[4], repeats=2,
                              report=lambda line: None, noise_python=fake_torch)
    assert [e.name for e in entries][-2:] == ["noise draw", dp.TORCH_NOISE]
    assert len(entries[-1].runs_ms) == 2 and entries[-1].median_ms >= 0
    table = dp.format_dp_table(entries)
    assert dp.TORCH_NOISE in table and "dp − plain − noise" in table


def test_a_failed_torch_noise_row_shows_no_figures():
    from benchmarks import dp  # pylint: disable=import-outside-toplevel
    rows = [dp.DPEntry("cnn", 8, "plain step", runs_ms=[10.0]),
            dp.DPEntry("cnn", 8, "dp step[auto]", runs_ms=[16.0]),
            dp.DPEntry("cnn", 8, "noise draw", runs_ms=[4.0]),
            dp.DPEntry("cnn", 8, dp.TORCH_NOISE)]
    lines = dp.format_dp_table(rows).splitlines()
    torch_line = [line for line in lines if dp.TORCH_NOISE in line]
    overhead = [line for line in lines if "dp − plain − noise" in line]
    assert len(torch_line) == 1 and torch_line[0].split()[-2:] == ["-", "-"], lines
    assert overhead[0].split()[-2:] == ["2.0", "0.20"], lines


def test_a_cluster_s_rows_are_against_its_own_plain_step():
    from benchmarks import dp  # pylint: disable=import-outside-toplevel
    rows = [dp.DPEntry("mlp", 8, "plain step", runs_ms=[10.0]),
            dp.DPEntry("mlp", 8, "dp step[auto]", runs_ms=[16.0]),
            dp.DPEntry("mlp", 8, "noise draw", runs_ms=[4.0]),
            dp.DPEntry("cnn", 8, "plain step", runs_ms=[1.0]),
            dp.DPEntry("mlp", 8, "2 workers: plain step", runs_ms=[40.0]),
            dp.DPEntry("mlp", 8, "2 workers: dp step", runs_ms=[50.0])]
    lines = dp.format_dp_table(rows).splitlines()
    cluster = [line.split()[-2:] for line in lines if "workers:" in line]
    assert cluster == [["40.0", "1.00"], ["50.0", "1.25"]], lines
    assert sum("dp − plain − noise" in line for line in lines) == 1, lines


def test_free_ports_are_distinct_and_bindable():
    import socket  # pylint: disable=import-outside-toplevel
    from benchmarks import dp_workers  # pylint: disable=import-outside-toplevel
    ports = dp_workers.free_ports(3)
    assert len(set(ports)) == 3
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


@pytest.mark.heavy
def test_the_two_worker_rows_time_every_worker_s_steps():
    from benchmarks import dp_workers  # pylint: disable=import-outside-toplevel
    lines = []
    entries = dp_workers.run_worker_bench(["mlp"], {"mlp": 4}, steps=4, report=lines.append)
    assert [e.name for e in entries] == ["2 workers: plain step", "2 workers: dp step",
                                         "2 workers CPU: plain step",
                                         "2 workers CPU: dp step"], lines
    # two workers, each timing its steps (wall and CPU) after the warm-up
    assert all(len(e.runs_ms) == 2 * (4 - dp_workers.WARM_UP_STEPS) for e in entries), lines
    assert all(t > 0 for e in entries for t in e.runs_ms)

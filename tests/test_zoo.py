"""The zoo (benchmarks/zoo.py) against the one-example loop: each network's
per-example gradients (and, for some, norms) as the loop's, their sum as tf.gradients',
and its plan counted by pertower/tools/plan_summary.py.

The default run checks the FAST networks (one graph and session per network, shared by
the module); every other network is `heavy` (`python -m pytest -q tests -m heavy`).
tests/legacy/test_rules_published.py runs `check_network` under
`tf.compat.v1.disable_v2_behavior()` (legacy shape mode), also heavy.
"""

import numpy as np
import pytest
import tensorflow as tf

import pertower
from pertower import oracle
from pertower.tools import plan_summary
from benchmarks import zoo
from tests import common

B = 2


class Built:
    """A zoo network in a graph and session of its own, its plan and one batch."""

    def __init__(self, name, batch_size=B, seed=0):
        self.name = name
        self.graph = tf.Graph()
        with self.graph.as_default():
            common.seed_weights(seed)
            self.network = zoo.build(name)
            self.plan = pertower.explain(self.network.loss, self.network.weights)
            # the batch gradient, built before the first run as a training op would be: a
            # session that ran a TF2 while loop before anything differentiated it cannot
            # run a gradient through it (README, "Limits")
            self.batch_gradients = [tf.convert_to_tensor(g) for g in tf.gradients(
                tf.reduce_sum(self.network.loss), self.network.weights)]
            self.sess = tf.compat.v1.Session(graph=self.graph)
            self.sess.run(tf.compat.v1.global_variables_initializer())
            zoo.randomize_batch_norm_statistics(self.sess, self.graph, seed + 1)
        self.feed = self.network.make_feed(batch_size, np.random.default_rng(seed + 2))

    @property
    def needs_batch_size(self):
        return any(w.method in ("towers", "passes") for w in self.plan.weights)

    def close(self):
        self.sess.close()


def check_network(built, with_norms=False):
    """Per-example gradients (method auto; batch_size only when the plan falls back)
    against the loop, their sum against tf.gradients, and (with_norms) the norms."""
    loss, _, _, weights = built.network
    B_fed = len(next(iter(built.feed.values())))
    batch_size = B_fed if built.needs_batch_size else None
    with built.graph.as_default():
        grads = pertower.per_example_gradients(loss, weights, batch_size=batch_size)
        norms = ([pertower.per_example_norms(loss, weights, batch_size=batch_size)]
                 if with_norms else [])
        batch_grads = built.batch_gradients
        got, got_norms, batch_values = built.sess.run([grads, norms, batch_grads],
                                                      built.feed)
        want = oracle.loop_per_example_gradients(built.sess, loss, weights, built.feed)
    what = f"zoo {built.name}"
    common.assert_all_close(got, want, what=f"{what}: per-example gradients", kind="network")
    common.assert_all_close([g.sum(axis=0) for g in got], batch_values,
                            what=f"{what}: sum over examples", kind="network")
    if with_norms:
        want_norms = np.sqrt(sum(np.sum(g.reshape(B_fed, -1).astype(np.float64) ** 2,
                                        axis=1) for g in want)).astype(np.float32)
        common.assert_all_close(got_norms, [want_norms], what=f"{what}: norms",
                                kind="network")
    nonzero = sum(bool(np.abs(g).max() > 0) for g in want)
    assert nonzero >= len(want) // 2, f"{what}: most weights have zero gradients"
    return plan_summary.summarize(built.plan, built.name)


@pytest.fixture(scope="module")
def fast_networks():
    """name -> Built for zoo.FAST, built once for the module."""
    built = {name: Built(name) for name in zoo.FAST}
    yield built
    for network in built.values():
        network.close()


@pytest.mark.parametrize("name", zoo.FAST)
def test_fast_zoo_network_is_on_rules_and_matches_the_loop(fast_networks, name):
    built = fast_networks[name]
    counts = plan_summary.method_counts(built.plan)
    assert counts["rules"] == len(built.network.weights), plan_summary.summarize(built.plan)
    check_network(built, with_norms=name == "layers_cnn")


def test_fast_zoo_network_feeds_any_batch_size(fast_networks):
    """One graph for every B: the None batch dimension takes B=1 and B=3."""
    built = fast_networks["layers_cnn"]
    loss, batch, make_feed, _ = built.network
    assert batch.shape[0] is None
    for size in (1, 3):
        values = built.sess.run(loss, make_feed(size, np.random.default_rng(size)))
        assert values.shape == (size,) and np.all(np.isfinite(values))


def test_plan_summary_counts_methods_and_groups_reasons():
    """A weight read by ClipByValue (no rule) falls to the towers; the summary counts it
    and names its reason; the one read in a v2 while loop is on the rules."""
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 3])
        w = tf.compat.v1.get_variable("w", initializer=tf.ones([3, 3]))
        v = tf.compat.v1.get_variable("v", initializer=tf.ones([]))
        h = tf.while_loop(lambda i, h: i < 2, lambda i, h: (i + 1, tf.tanh(h @ w)),
                          [0, x])[1]
        ys = tf.reduce_sum(tf.raw_ops.ClipByValue(t=h, clip_value_min=-v, clip_value_max=v),
                           axis=1)
        plan = pertower.explain(ys, [w, v], batch_size=2)
    counts = plan_summary.method_counts(plan)
    assert counts == {"rules": 1, "towers": 1, "passes": 0, "unreached": 0}, str(plan)
    assert plan_summary.counts_cell(counts) == "1/1/0"
    text = plan_summary.summarize(plan, "loop net")
    assert text.startswith("loop net: 2 weights: 1 rules, 1 towers, 0 passes")
    assert "batch_size needed" in text and "1 fall back:" in text and "v:0" in text


def test_unknown_zoo_name_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"`name` must be one of resnet50, .*'alexnet'"):
        zoo.build("alexnet")


@pytest.mark.heavy
@pytest.mark.parametrize("name", [n for n in zoo.ZOO if n not in zoo.FAST])
def test_zoo_network_matches_the_loop(name):
    """Every other zoo network at B=3: convolutional ones entirely on the rules (no
    batch_size); the recurrent ones by whatever method the plan picks."""
    built = Built(name, batch_size=3, seed=5)
    try:
        if name in zoo.CONVOLUTIONAL:
            counts = plan_summary.method_counts(built.plan)
            assert counts["rules"] == len(built.network.weights), (
                plan_summary.summarize(built.plan, name))
        check_network(built, with_norms=name in ("mobilenet_v2", "ptb_lstm"))
    finally:
        built.close()


def test_bench_models_takes_zoo_names_comma_separated():
    """`python -m benchmarks --models a,b c` reads zoo networks and bench models, and
    names the unknown ones with the choices."""
    from benchmarks import command  # pylint: disable=import-outside-toplevel
    args = command.build_parser().parse_args(["--models", "resnet50,ptb_lstm", "mlp"])
    assert args.models == ["resnet50", "ptb_lstm", "mlp"]
    with pytest.raises(SystemExit):
        command.build_parser().parse_args(["--models", "resnet50,alexnet"])


@pytest.mark.heavy
def test_zoo_bench_measures_and_checks_against_the_loop():
    """run_zoo_bench on the layers CNN at B=2: every row timed, the build times and the
    method counts filled, the gradients agreeing with the loop; the table shows them."""
    from benchmarks import zoo_bench  # pylint: disable=import-outside-toplevel
    rows = zoo_bench.run_zoo_bench(["layers_cnn"], batch_sizes=(2,), repeats=1,
                                   loop_repeats=1, report=lambda line: None)
    assert len(rows) == 1 and not rows[0].error, rows
    row = rows[0]
    assert set(row.ms) == set(zoo_bench.ROWS) and all(v > 0 for v in row.ms.values())
    assert row.counts["rules"] == 10 and row.build_ratio > 0 and row.agrees
    table = zoo_bench.format_zoo_table(rows)
    assert "layers_cnn" in table and "10/0/0" in table and "WRONG" not in table

"""The zoo bench's build timing (benchmarks/zoo_bench.py `measure_builds`):
every timed build in a graph of its own, the first pertower build apart, the medians
(wall and process CPU) those of the recorded runs, the ratios those of the medians, the
garbage of earlier work collected before each timed build, and the table and JSON showing
them. No timing threshold: the numbers are checked for
consistency only. And what the bench compares the loop at: zoo.build's weights the same
in every process (seeded), and a row off the loop checked again at the batch's own
forward (benchmarks/zoo_agreement.py).
"""

import gc
import random
import weakref

import numpy as np
import pytest
import tensorflow as tf

import pertower
from pertower import oracle
from benchmarks import zoo
from benchmarks import zoo_agreement
from benchmarks import zoo_bench

REPEATS = 2


def _median(values):
    ordered = sorted(values)
    middle = len(ordered) // 2
    return (ordered[middle] if len(ordered) % 2
            else (ordered[middle - 1] + ordered[middle]) / 2)


class _Cycle:
    """Garbage that only the cycle collector frees."""

    def __init__(self):
        self.itself = self


def _small_network(name):
    """A stand-in for zoo.build (the bookkeeping of measure_builds is checked, not a
    network's build time): x [B, 4] -> tanh(x w + b) [B, 3] -> the squared sum [B]."""
    x = tf.compat.v1.placeholder(tf.float32, [None, 4], name="x")
    w = tf.compat.v1.get_variable("w", [4, 3])
    b = tf.compat.v1.get_variable("b", [3], initializer=tf.compat.v1.zeros_initializer())
    loss = tf.reduce_sum(tf.tanh(tf.matmul(x, w) + b) ** 2, axis=1)          # [B]
    return zoo.ZooNetwork(name, "a dense layer", loss, x, None, [w, b])


@pytest.fixture(scope="module")
def measured():
    """measure_builds (2 repeats) on a dense layer standing in for the layers CNN, the
    graph each zoo.build ran in, and per timed call (tf.gradients or pertower) whether
    the cycle left after its network's build was freed when it started (automatic
    collection off meanwhile, so only an explicit collection frees it)."""
    graphs, cycles, freed = [], [], []
    pertower_build, tf_build = pertower.per_example_gradients, zoo_bench._tf_gradients

    def recording_build(name):
        graphs.append(tf.compat.v1.get_default_graph())
        out = _small_network(name)
        cycles.append(weakref.ref(_Cycle()))
        return out

    def entered(real):
        def timed(*args, **kwargs):
            freed.append(cycles[-1]() is None)
            return real(*args, **kwargs)
        return timed

    collecting = gc.isenabled()
    gc.disable()
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(zoo, "build", recording_build)
            patch.setattr(pertower, "per_example_gradients", entered(pertower_build))
            patch.setattr(zoo_bench, "_tf_gradients", entered(tf_build))
            times = zoo_bench.measure_builds("layers_cnn", repeats=REPEATS)
    finally:
        if collecting:
            gc.enable()
    return times, graphs, freed


def test_every_build_in_a_fresh_graph(measured):
    times, graphs, _ = measured
    # warm-up, first pertower build, then REPEATS pairs
    assert len(graphs) == 2 + 2 * REPEATS
    assert len({id(g) for g in graphs}) == len(graphs)
    assert all(g is not tf.compat.v1.get_default_graph() for g in graphs)
    assert times.batch_size is None          # every weight on a rule: no batch_size


def test_medians_and_ratios_are_those_of_the_recorded_runs(measured):
    times, _, _ = measured
    runs = {name: getattr(times, name) for name in
            ("tf_gradients_s", "tf_gradients_cpu_s", "pertower_s", "pertower_cpu_s")}
    assert all(len(v) == REPEATS and all(s > 0 for s in v) for v in runs.values())
    assert times.first_s > 0 and times.first_cpu_s > 0
    assert times.medians == {name: _median(v) for name, v in runs.items()}
    assert times.ratio == pytest.approx(
        _median(runs["pertower_s"]) / _median(runs["tf_gradients_s"]), rel=1e-12)
    assert times.cpu_ratio == pytest.approx(
        _median(runs["pertower_cpu_s"]) / _median(runs["tf_gradients_cpu_s"]), rel=1e-12)


def test_every_timed_build_starts_with_no_garbage_pending(measured):
    """The earlier builds' graphs are reference cycles; left pending, freeing them falls
    in whichever later timed build triggers a full collection."""
    _, graphs, freed = measured
    assert len(freed) == len(graphs) == 2 + 2 * REPEATS
    assert all(freed)


def test_table_and_json_show_the_build_columns(measured):
    times, _, _ = measured
    row = zoo_bench.ZooRow("layers_cnn", 2, 1, {"rules": 10, "towers": 0, "passes": 0,
                            "unreached": 0}, times)
    lines = zoo_bench.format_zoo_table([row]).splitlines()
    header, values = lines[0].split(), lines[2].split()
    for column in ("build x cpu", "first build s"):
        assert column in lines[0]
    # columns: network B P counts tf.gradients s | pertower s | build x | build x cpu |
    # first build s (a header of several words counts as several fields)
    assert header[:4] == ["network", "B", "P", "rules/towers/passes"]
    assert values[4:9] == [f"{times.medians['tf_gradients_s']:.2f}",
                           f"{times.medians['pertower_s']:.2f}", f"{times.ratio:.2f}",
                           f"{times.cpu_ratio:.2f}", f"{times.first_s:.2f}"]
    entry = zoo_bench.to_json([row])[0]
    assert entry["build_ratio"] == times.ratio and entry["build_cpu_ratio"] == times.cpu_ratio
    assert entry["builds"]["pertower_cpu_s"] == times.pertower_cpu_s
    assert entry["builds"]["median_pertower_cpu_s"] == _median(times.pertower_cpu_s)
    assert entry["builds"]["first_s"] == times.first_s


def test_a_plan_that_needs_batch_size_is_built_with_the_first_b(monkeypatch):
    """When the build without batch_size is refused, the first build and every timed
    pertower build take the first B."""
    calls = []

    def fake_build(name, pertower_build, batch_size):
        calls.append((pertower_build, batch_size))
        if pertower_build and batch_size is None:
            raise ValueError("batch_size is needed")
        return 1.0 + len(calls), 0.5 + len(calls)

    monkeypatch.setattr(zoo_bench, "_timed_build", fake_build)
    times = zoo_bench.measure_builds("layers_cnn", batch_sizes=(16, 32), repeats=REPEATS)
    assert times.batch_size == 16
    assert calls == [(False, None), (True, None), (True, 16)] + [
        (False, 16), (True, 16)] * REPEATS
    assert (times.first_s, times.first_cpu_s) == (4.0, 3.5)
    assert times.tf_gradients_s == [5.0, 7.0] and times.pertower_cpu_s == [5.5, 7.5]
    assert times.medians["pertower_s"] == 7.0 and times.ratio == 7.0 / 6.0


class _FixedLoop:
    """A stand-in for oracle.SliceLoop whose run returns fixed [B, *w] arrays."""

    def __init__(self, arrays):
        self.arrays = arrays

    def run(self, sess, feed, B):  # pylint: disable=unused-argument
        return [a.copy() for a in self.arrays]


def test_a_disagreeing_row_names_its_weight_examples_and_whether_reruns_agree():
    """zoo_agreement.disagreement on a graph whose 'per-example gradients' are the loop's
    with example 1 of the second weight off by 10%: it names that weight and example, and
    both sides repeat themselves exactly (deterministic, so wrong rather than racy)."""
    want = [np.ones([3, 2], np.float32), np.arange(12, dtype=np.float32).reshape(3, 4)]
    off = want[1].copy()
    off[1] *= 1.1
    with tf.Graph().as_default():
        weights = [tf.Variable(tf.zeros([2]), name="w0"), tf.Variable(tf.zeros([4]), name="w1")]
        gradients = [tf.constant(want[0]), tf.constant(off)]
        with tf.compat.v1.Session() as sess:
            got = sess.run(gradients)
            line = zoo_agreement.disagreement(sess, gradients, _FixedLoop(want), {}, 3,
                                              (got, want), weights)
    assert "worst weight w1:0" in line and "examples [1]" in line, line
    assert line.count("0.0e+00") == 2 and "(pertower), 0.0e+00 (loop)" in line, line
    assert f"each other {0.1 * 7 / 11:.1e}" in line, line


def _initial_weights(name, seed, python_seed, keras_seed=None):
    """zoo.build(name, seed) in a fresh graph after random.seed(python_seed) (and, when
    keras_seed is given, the generator tf_keras.utils.set_random_seed(keras_seed) would
    install, without its global seeds): the initial weights, and Python's next random
    number after the build."""
    from tf_keras.src import backend  # pylint: disable=import-outside-toplevel
    holder = backend._SEED_GENERATOR  # pylint: disable=protected-access
    before = getattr(holder, "generator", None)
    if keras_seed is not None:
        holder.generator = random.Random(keras_seed)
    random.seed(python_seed)
    generator = getattr(holder, "generator", None)
    try:
        with tf.Graph().as_default() as graph, tf.compat.v1.Session(graph=graph) as sess:
            weights = zoo.build(name, seed=seed).weights
            sess.run(tf.compat.v1.global_variables_initializer())
            values = sess.run(weights)
        assert getattr(holder, "generator", None) is generator            # put back
        return values, random.random()
    finally:
        holder.generator = before


def _tiny_keras(name):
    """A stand-in zoo builder: tf_keras Embedding(50, 4) -> Dense(3), unseeded as the
    applications' initializers are."""
    import tf_keras as keras  # pylint: disable=import-outside-toplevel
    tokens = tf.compat.v1.placeholder(tf.int32, [None], name="tokens")
    model = keras.Sequential([keras.layers.Embedding(50, 4), keras.layers.Dense(3)])
    loss = tf.reduce_sum(model(tokens), axis=1)                                  # [B]
    return zoo.ZooNetwork(name, "tiny", loss, tokens, None, list(model.trainable_weights))


def _check_seeded_builds(name):
    """zoo.build(name, seed) gives the same weights whatever state Python's random (or
    tf_keras.utils.set_random_seed's generator) was in, another seed other weights, and
    Python's random continues as if no build happened."""
    first, after_first = _initial_weights(name, 0, python_seed=1)
    second, _ = _initial_weights(name, 0, python_seed=2)
    third, _ = _initial_weights(name, 0, python_seed=3, keras_seed=4)
    other, _ = _initial_weights(name, 1, python_seed=1)
    assert len(first) == len(second) == len(third) >= 3
    assert all(np.array_equal(a, b) and np.array_equal(a, c)
               for a, b, c in zip(first, second, third))
    assert not np.array_equal(first[0], other[0])
    random.seed(1)
    assert after_first == random.random()


def test_zoo_build_gives_the_same_keras_weights_in_every_process(monkeypatch):
    """tf_keras' unseeded initializers draw their seeds from Python's `random` (or from
    tf_keras.utils.set_random_seed's generator), not from the graph's seed: before the
    bench seeded them (zoo.build's `seed`), each process got other weights, so a
    disagreement seen in one bench run could not be reproduced in another. A tiny
    tf_keras network in place of ptb_lstm (the same path); unseeded, the builds differ."""
    monkeypatch.setattr(zoo, "_ptb_lstm", _tiny_keras)
    _check_seeded_builds("ptb_lstm")
    unseeded = [_initial_weights("ptb_lstm", None, python_seed=s)[0][0] for s in (1, 2)]
    assert not np.array_equal(*unseeded)


@pytest.mark.heavy
@pytest.mark.parametrize("name", ["ptb_lstm", "mobilenet"])
def test_zoo_networks_get_the_same_weights_in_every_process(name):
    _check_seeded_builds(name)


@pytest.fixture(scope="module")
def kinked():
    """A graph whose forward depends on B as TensorFlow's rounding at B and at 1 may:
    loss[b] = sum(relu(x[b] * w + c + 1e-3 * (B - 1.5))), c [2] a weight; example 1 has
    x[1] * w + c = 0, so its pre-activation is +1.5e-3 at B = 3 and -5e-4 alone: its
    gradient of c is 1 in the batch and 0 in the loop. Yields (sess, pertower's
    per-example gradients, the loop, BatchForwardGradients, feed, weights)."""
    with tf.Graph().as_default() as graph:
        x = tf.compat.v1.placeholder(tf.float32, [None, 2], name="x")              # [B, 2]
        w = tf.Variable([1.0, 2.0], name="w")
        c = tf.Variable([0.0, 0.5], name="c")
        B = tf.cast(tf.shape(x)[0], tf.float32)
        loss = tf.reduce_sum(tf.nn.relu(x * w + c + 1e-3 * (B - 1.5)), axis=1)     # [B]
        gradients = pertower.per_example_gradients(loss, [w, c])
        loop = oracle.SliceLoop(loss, [w, c])
        forward = zoo_agreement.BatchForwardGradients(loss, [w, c])
        feed = {x: np.array([[1.0, 1.0], [0.0, -0.25], [2.0, -1.0]], np.float32)}
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            yield sess, gradients, loop, forward, feed, [w, c]


def _row(kinked, gradients):
    sess, _, loop, forward, feed, _ = kinked
    got, want = sess.run(gradients, feed), loop.run(sess, feed, 3)
    row = zoo_bench.ZooRow("kinked", 3)
    row.max_relative_diff = zoo_agreement.max_relative_diff(got, want)
    line = zoo_agreement.check_at_batch_forward(row, sess, forward, feed, (got, want))
    return row, line, got, want


def test_a_row_off_the_loop_by_a_kink_agrees_at_the_batch_forward(kinked):
    """pertower is off the loop by example 1's whole term of c (the forwards at B and at 1
    are on either side of the kink), and within float32 rounding of TensorFlow's own
    backward of the batch's forward: the row agrees, and says why."""
    row, line, got, want = _row(kinked, kinked[1])
    assert row.max_relative_diff > zoo_bench.RELATIVE_TOLERANCE
    assert got[1][1, 1] == 1.0 and want[1][1, 1] == 0.0
    assert row.forward_diff <= 1e-6 and row.loop_forward_diff > 0.1
    assert row.agrees is True
    assert "examples [1]" in line and "not pertower" in line, line
    assert zoo_agreement.diff_cell(row) == (f"{row.max_relative_diff:.1e} fwd "
                                            f"{row.forward_diff:.1e}")


def test_a_row_off_at_the_batch_forward_too_is_wrong(kinked):
    """The same with 'per-example gradients' whose example 2 is off by 10%: it disagrees
    at the batch's forward as well, so the row is WRONG."""
    off = [g * tf.constant([[1.0], [1.0], [1.1]]) for g in kinked[1]]
    row, line, _, _ = _row(kinked, off)
    assert row.forward_diff > zoo_bench.RELATIVE_TOLERANCE
    assert row.agrees is False and line.endswith("WRONG"), line
    assert zoo_agreement.diff_cell(row).endswith(" WRONG")

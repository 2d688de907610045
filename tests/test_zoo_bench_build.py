"""The zoo bench's build timing (pertower/tools/bench/zoo_bench.py `measure_builds`):
every timed build in a graph of its own, the first pertower build apart, the medians
(wall and process CPU) those of the recorded runs, the ratios those of the medians, the
garbage of earlier work collected before each timed build, and the table and JSON showing
them. No timing threshold: the numbers are checked for
consistency only.
"""

import gc
import weakref

import pytest
import tensorflow as tf

import pertower
from pertower.tools import zoo
from pertower.tools.bench import zoo_bench

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


@pytest.fixture(scope="module")
def measured():
    """measure_builds on the layers CNN (2 repeats), the graph each zoo.build ran in, and
    per timed call (tf.gradients or pertower) whether the cycle left after its network's
    build was freed when it started (automatic collection off meanwhile, so only an
    explicit collection frees it)."""
    graphs, cycles, freed = [], [], []
    build, pertower_build, tf_build = (zoo.build, pertower.per_example_gradients,
                                       zoo_bench._tf_gradients)

    def recording_build(name):
        graphs.append(tf.compat.v1.get_default_graph())
        out = build(name)
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
    """_disagreement on a graph whose 'per-example gradients' are the loop's with example
    1 of the second weight off by 10%: it names that weight and example, and both sides
    repeat themselves exactly (deterministic, so wrong rather than racy)."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    want = [np.ones([3, 2], np.float32), np.arange(12, dtype=np.float32).reshape(3, 4)]
    off = want[1].copy()
    off[1] *= 1.1
    with tf.Graph().as_default():
        weights = [tf.Variable(tf.zeros([2]), name="w0"), tf.Variable(tf.zeros([4]), name="w1")]
        gradients = [tf.constant(want[0]), tf.constant(off)]
        with tf.compat.v1.Session() as sess:
            got = sess.run(gradients)
            line = zoo_bench._disagreement(sess, gradients, _FixedLoop(want), {}, 3,
                                           (got, want), weights)
    assert "worst weight w1:0" in line and "examples [1]" in line, line
    assert line.count("0.0e+00") == 2 and "(pertower), 0.0e+00 (loop)" in line, line
    assert f"each other {0.1 * 7 / 11:.1e}" in line, line

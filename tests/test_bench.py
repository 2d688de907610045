"""`python -m benchmarks` on tiny sizes: every row agrees with the loop, the JSON holds every
figure, --plot writes a PNG; the bench's arithmetic (agreement, comparison, references,
ratios, medians) on cases worked out by hand; and the memory replay of
`benchmarks.traced_memory` on graphs whose peak can be worked out by hand. No timing
thresholds (shared, noisy machine)."""

import contextlib
import io
import json
import os

import numpy as np
import pytest
import tensorflow as tf

from pertower._api.gradients import METHODS

from benchmarks import command
from benchmarks import compare
from benchmarks import dp
from benchmarks import records
from benchmarks import runner
from benchmarks import traced_memory as run_memory

B = 3
# float32 results against the loop's, from the project's tests (tests/common.py): an
# entry of magnitude v may be off by about 1e-4 * v; smaller entries by 1e-4 (B = 3 and
# these models keep every entry's rounding far below that)
FLOAT32_DIFF = 1e-4


# One `python -m benchmarks` run per case: (models, methods, where the JSON goes). The default
# run benches the mlp with two of the three methods (`--methods` leaves the third out)
# and writes its JSON to standard output (the table then goes to stderr); the heavy run
# benches the cnn (conv rules) with every method and writes its JSON to a file.
SMOKE_CASES = [
    pytest.param((("mlp",), ("towers", "rules"), "stdout"), id="mlp"),
    pytest.param((("cnn",), METHODS, "file"), id="cnn", marks=pytest.mark.heavy),
]


@pytest.fixture(scope="module", params=SMOKE_CASES)
def smoke(request, tmp_path_factory):
    """Runs `python -m benchmarks` once at B=3 with --plot; returns (exit code, the printed
    table, figures from the JSON, the PNG path, models, methods)."""
    models, methods, json_to = request.param
    folder = tmp_path_factory.mktemp("bench")
    json_path, png_path = folder / "figures.json", folder / "figures.png"
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = command.main(["--onednn", "as-is", "--models", *models, "--batch-sizes", str(B),
                         "--methods", *methods, "--repeats", "2", "--loop-repeats", "1",
                         "--json", "-" if json_to == "stdout" else str(json_path),
                         "--plot", str(png_path)])
    if json_to == "stdout":
        table = stderr.getvalue()
        assert code == 0, table
        figures = json.loads(stdout.getvalue())          # stdout is JSON only
    else:
        table = stdout.getvalue()
        assert code == 0, table + stderr.getvalue()
        with open(json_path, encoding="utf-8") as handle:
            figures = json.load(handle)
    return code, table, figures, png_path, models, methods


def _expected_rows(model, methods):
    rows = [records.LOOP, records.BATCH, records.VMAP, records.WRITE_LIMIT, records.NORMS_FLOOR]
    rows += [f"gradients[{m}]" for m in methods] + [f"norms[{m}]" for m in methods]
    if model == "mlp":
        rows += [records.OUTER, records.HAND_NORMS]
    return sorted(rows)


def test_every_row_is_present_and_agrees_with_the_loop(smoke):
    code, out, figures, _, models, methods = smoke
    assert code == 0, out
    entries = figures["entries"]
    assert {e["model"] for e in entries} == set(models)
    for model in models:
        # only the methods asked for (`--methods`)
        names = sorted(e["name"] for e in entries if e["model"] == model)
        assert names == _expected_rows(model, methods), names
    problems = []
    for e in entries:
        where = f"{e['model']} {e['name']}"
        if e["status"] == "n/a":
            # only a method that is not built yet may be missing, and it says so
            if "NotImplementedError" not in e["reason"] or e["name"] in (
                    records.LOOP, records.BATCH, records.VMAP, records.OUTER,
                    records.HAND_NORMS):
                problems.append(f"{where}: n/a for {e['reason']!r}")
            continue
        if e["status"] != "ok":
            problems.append(f"{where}: {e['status']} {e['reason']}")
            continue
        if e["computes"] in records.NOT_COMPARED:   # the write limit, the norms floor
            if e["max_abs_diff"] is not None or e["agrees"] is not None:
                problems.append(f"{where}: a row that computes no gradient was compared")
            continue
        allowed = FLOAT32_DIFF * max(1.0, e["max_abs_reference"])
        if not 0 <= e["max_abs_diff"] <= allowed:
            problems.append(f"{where}: max |diff| {e['max_abs_diff']} > {allowed}")
        if e["agrees"] is not True:
            problems.append(f"{where}: agrees is {e['agrees']!r}")
        if e["max_abs_reference"] <= 0:
            problems.append(f"{where}: the loop's result is all zeros, nothing was compared")
    assert not problems, "\n".join(problems)


def test_json_holds_every_figure_and_numbers_are_positive(smoke):
    _, out, figures, _, models, _ = smoke
    machine = figures["machine"]
    assert machine["cpu_count"] >= 1 and machine["tensorflow"] == tf.__version__
    assert machine["date_utc"].endswith("UTC")
    assert figures["settings"]["batch_sizes"] == {model: [B] for model in models}
    assert set(figures["notes"]) == {"ms", "ratios", "peak_bytes", "max_abs_diff",
                                     "estimate_bytes", "memory_write_limit", "norms_floor",
                                     "cpu_speed"}
    speed = machine["cpu_speed"]
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX",
                 "LD_PRELOAD", "TF_ENABLE_ONEDNN_OPTS"):
        assert speed[name] == os.environ.get(name), name
    assert speed["onednn_enabled"] in (True, False) and speed["avx512"] in (True, False, None)
    assert "TF_ENABLE_ONEDNN_OPTS=" in out and "AVX-512:" in out
    for e in figures["entries"]:
        assert e["batch_size"] == B
        if e["status"] != "ok":
            continue
        where = f"{e['model']} {e['name']}"
        expected_runs = 1 if e["name"] == records.LOOP else 2
        assert len(e["runs_ms"]) == expected_runs, where
        for field in ("median_ms", "build_seconds", "first_run_seconds", "peak_bytes",
                      "ratio_to_loop", "ratio_to_batch"):
            assert e[field] is not None and e[field] > 0, (where, field, e[field])
        # a median lies between the fastest and the slowest run
        assert min(e["runs_ms"]) <= e["median_ms"] <= max(e["runs_ms"]), where
        # the process's CPU ms of the same runs (all threads: never below zero)
        assert len(e["cpu_ms"]) == expected_runs and min(e["cpu_ms"]) >= 0, where
        assert min(e["cpu_ms"]) <= e["median_cpu_ms"] <= max(e["cpu_ms"]), where
        assert (e["ratio_to_outer"] is not None) == (e["model"] == "mlp"), where
    for model in models:
        mine = {e["name"]: e for e in figures["entries"]
                if e["model"] == model and e["status"] == "ok"}
        # each row against itself is 1; a slower row has the larger ratio, to every base
        assert mine[records.LOOP]["ratio_to_loop"] == 1.0
        assert mine[records.BATCH]["ratio_to_batch"] == 1.0
        by_speed = sorted(mine.values(), key=lambda e: e["median_ms"])
        for base in ("ratio_to_loop", "ratio_to_batch"):
            ratios = [e[base] for e in by_speed]
            assert ratios == sorted(ratios), (model, base, ratios)
    for e in figures["entries"]:
        assert e["name"] in out                        # every row is in the printed table
    assert "peak MiB" in out and "est MiB" in out
    assert f"TensorFlow {tf.__version__}" in out and "CPUs" in out


def test_memory_of_materialized_gradients_covers_their_size(smoke):
    """A fetched [B, *x.shape] result is live at the end of the run, so the peak holds
    at least its bytes; the hand-written norms never hold it."""
    _, _, figures, _, models, _ = smoke
    parameters = {"mlp": 100 * 256 + 256 + 256 * 256 + 256 + 256 + 1,
                  "cnn": 5 * 5 * 16 + 16 + 32 * 32 * 16 * 128 + 128 + 128 + 1}
    for e in figures["entries"]:
        assert e["parameters"] == parameters[e["model"]]
        result_bytes = 4 * B * parameters[e["model"]]
        if (e["status"] == "ok" and e["computes"] in ("gradients", "write")
                and e["name"] != records.LOOP):
            assert e["peak_bytes"] >= result_bytes, (e["model"], e["name"], e["peak_bytes"])
        if e["name"].startswith("gradients["):
            # pertower.estimate_memory, on the plan: the result, written once by the
            # rules; the towers hold their gradients before stacking as well
            towers = 2 if e["name"] == "gradients[towers]" else 1
            assert e["estimate_bytes"] >= towers * result_bytes, (e["model"], e["name"])
        else:
            assert e["estimate_bytes"] is None, (e["model"], e["name"])
    if "mlp" in models:
        mlp = {e["name"]: e for e in figures["entries"] if e["model"] == "mlp"}
        assert mlp[records.HAND_NORMS]["peak_bytes"] < 4 * B * parameters["mlp"]


def test_plot_writes_a_png(smoke):
    png_path = smoke[3]
    with open(png_path, "rb") as handle:
        assert handle.read(8) == b"\x89PNG\r\n\x1a\n"
    assert png_path.stat().st_size > 10_000


def test_json_to_stdout_and_unknown_method(capsys):
    # a bench with --json - and --methods towers rules: the `smoke` fixture's default case
    assert command.main(["--onednn", "as-is", "--methods", "fastest"]) == 2
    assert "--methods fastest: unknown" in capsys.readouterr().err


def test_exit_code_is_1_when_an_entry_disagrees(monkeypatch, capsys):
    wrong = records.Entry("mlp", 2, 10, "gradients[towers]", "gradients", median_ms=1.0,
                          runs_ms=[1.0], max_abs_diff=0.5, max_abs_reference=1.0,
                          agrees=False)
    monkeypatch.setattr(runner, "run_bench", lambda **kwargs: [wrong])
    assert command.main(["--onednn", "as-is", "--models", "mlp", "--json", "-"]) == 1
    assert "FAILED: mlp B=2 gradients[towers]" in capsys.readouterr().err


def _replayed_peak(build):
    """The replayed peak of the fetches `build(x)` returns, x fed [8, 1000]."""
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        x = tf.compat.v1.placeholder(tf.float32, [None, 1000])
        fetches = build(x)
        feed = {x: np.ones((8, 1000), np.float32)}
        sess.run(fetches, feed)
        return run_memory.traced_peak_bytes(sess, fetches, feed).peak_bytes


ROW_BYTES = 8 * 1000 * 4  # one [8, 1000] float32 tensor


def test_memory_of_fetched_tensors_adds_up():
    """Two fetched tiles of x, 3 and 5 copies wide, are both live at the end."""
    peak = _replayed_peak(lambda x: [tf.tile(x, [1, 3]), tf.tile(x, [1, 5])])
    assert peak == 8 * ROW_BYTES


def test_memory_freed_before_the_next_allocation_is_not_added():
    """A 50-wide tile reduced to a scalar, then (after it, by a control dependency) a
    20-wide one: the peak is the larger one plus a few scalars, not their sum."""
    def build(x):
        first = tf.reduce_sum(tf.tile(x, [1, 50]))
        with tf.control_dependencies([first]):
            second = tf.reduce_sum(tf.tile(x, [1, 20]))
        return first + second

    peak = _replayed_peak(build)
    assert 50 * ROW_BYTES <= peak <= 50 * ROW_BYTES + 64, peak


def test_the_command_offers_the_bench_models():
    from benchmarks import models
    from benchmarks import command
    assert command.BENCH_MODELS == runner.MODELS == models.MODEL_NAMES
    assert command.build_parser().parse_args(["--models", "cifar"]).models == ["cifar"]


# one method by default (a row per method: the same code for each); both heavy
@pytest.mark.parametrize("methods", [("auto",), pytest.param(("auto", "towers"),
                                                             marks=pytest.mark.heavy)])
def test_dp_rows_time_the_plain_step_each_method_and_the_step_without_noise(methods):
    entries = dp.run_dp_bench(models=["mlp"], batch_sizes=[B], repeats=2,
                              methods=methods, report=lambda line: None)
    assert [e.name for e in entries] == ["plain step"] + [
        f"dp step[{m}]" for m in methods] + ["dp step[auto] σ=0", "sess.run overhead",
                                             dp.PHILOX_UNIFORMS, "noise draw"]
    for e in entries:
        assert e.model == "mlp" and e.batch_size == B and len(e.runs_ms) == 2, e
        assert all(t > 0 for t in e.runs_ms) and e.median_ms > 0, e
    table = dp.format_dp_table(entries)
    assert all(e.name in table for e in entries), table


# The bench's arithmetic, on cases worked out by hand -----------------------------------


@pytest.mark.parametrize("diff, reference, expected", [
    (0.0, 0.0, True),
    (1e-4, 0.5, True),      # the allowance is 1e-4 for results below 1
    (2e-4, 0.5, False),
    (0.9e-2, 100.0, True),  # and 1e-4 of the largest entry above 1: 1e-2 here
    (1.1e-2, 100.0, False),
    (float("inf"), 1.0, False),
])
def test_agreement_with_the_loop(diff, reference, expected):
    assert records.agrees(diff, reference) is expected


def test_compare_finds_the_largest_difference_and_where():
    loop = [np.array([[1.0, 2.0], [3.0, 4.0]]),             # weight 0, [B=2, 2]
            np.array([[0.5], [-8.0]])]                      # weight 1, [B=2, 1]
    got = [np.array([[1.0, 2.0], [3.0, 4.25]]), np.array([[0.5], [-7.0]])]
    assert compare.compare(got, loop) == (1.0, 8.0, [1, 1])
    assert compare.compare(loop, loop) == (0.0, 8.0, [0, 0])
    # a batch gradient has no batch axis: the example is None
    assert compare.compare([np.float32(3.0)], [np.float32(2.5)]) == (0.5, 2.5, [0, None])
    # a result of another shape or count never agrees
    assert compare.compare([np.zeros((2, 3))], [np.zeros((2, 2))])[0] == float("inf")
    assert compare.compare(got[:1], loop)[0] == float("inf")


def test_references_for_sums_and_norms():
    """The loop's per-example gradients [B=2, ...] of two weights: their sum over B, and
    the global norm of each example's gradient (3-4-12 and 0-0-5: 13 and 5)."""
    loop = [np.array([[3.0, 4.0], [0.0, 0.0]]), np.array([[12.0], [5.0]])]
    assert compare.reference_for("gradients", loop) is loop
    total = compare.reference_for("sum", loop)
    np.testing.assert_array_equal(total[0], [3.0, 4.0])
    np.testing.assert_array_equal(total[1], [17.0])
    (norms,) = compare.reference_for("norms", loop)
    np.testing.assert_allclose(norms, [13.0, 5.0], rtol=1e-12)


def test_ratios_to_the_loop_the_batch_gradient_and_the_outer_products():
    def row(name, median):
        return records.Entry("mlp", 4, 10, name, "gradients", median_ms=median)

    rows = [row(records.LOOP, 40.0), row(records.BATCH, 2.0), row(records.OUTER, 4.0),
            row("gradients[auto]", 8.0), row("n/a row", None)]
    runner._ratios(rows)  # pylint: disable=protected-access
    loop, batch, outer, auto, missing = rows
    assert (auto.ratio_to_loop, auto.ratio_to_batch, auto.ratio_to_outer) == (0.2, 4.0, 2.0)
    assert (loop.ratio_to_loop, batch.ratio_to_batch, outer.ratio_to_outer) == (1.0, 1.0, 1.0)
    assert (missing.ratio_to_loop, missing.ratio_to_batch) == (None, None)
    without_outer = [row(records.LOOP, 10.0), row("gradients[auto]", 5.0)]
    runner._ratios(without_outer)  # pylint: disable=protected-access
    assert without_outer[1].ratio_to_loop == 0.5 and without_outer[1].ratio_to_outer is None


def test_dp_rows_median_and_ratio_to_the_plain_step():
    plain = dp.DPEntry("mlp", 8, "plain step", runs_ms=[3.0, 1.0, 2.0])
    step = dp.DPEntry("mlp", 8, "dp step[auto]", runs_ms=[5.0, 9.0, 6.0, 100.0])
    assert (plain.median_ms, step.median_ms) == (2.0, 7.5)
    table = dp.format_dp_table([plain, step])
    row = next(line for line in table.splitlines() if "dp step[auto]" in line)
    assert row.split()[-2:] == ["7.5", "3.75"], table

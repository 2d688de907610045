"""`pertower bench` on tiny sizes: every row agrees with the loop, the JSON holds every
figure, --plot writes a PNG; and the memory replay of `pertower.tools.traced_memory` on graphs
whose peak can be worked out by hand. No timing thresholds (shared, noisy machine)."""

import json
import os

import numpy as np
import pytest
import tensorflow as tf

from pertower.tools import traced_memory as run_memory
from pertower.tools import bench
from pertower.tools import cli
from pertower._api.gradients import METHODS

B = 3
# float32 results against the loop's: |diff| <= TOLERANCE * max(1, |loop|max)
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """Runs `pertower bench` once on both models at B=3; returns (exit code, stdout,
    figures from the JSON file, the PNG path)."""
    folder = tmp_path_factory.mktemp("bench")
    json_path, png_path = folder / "figures.json", folder / "figures.png"
    capture = pytest.MonkeyPatch()
    lines = []
    capture.setattr("builtins.print", lambda *a, **k: lines.append(" ".join(map(str, a))))
    try:
        code = cli.main(["bench", "--models", "mlp", "cnn", "--batch-sizes", str(B),
                         "--repeats", "2", "--loop-repeats", "1", "--json", str(json_path),
                         "--plot", str(png_path)])
    finally:
        capture.undo()
    with open(json_path, encoding="utf-8") as handle:
        figures = json.load(handle)
    return code, "\n".join(lines), figures, png_path


def _expected_rows(model):
    rows = [bench.LOOP, bench.BATCH, bench.VMAP, bench.WRITE_LIMIT, bench.NORMS_FLOOR]
    rows += [f"gradients[{m}]" for m in METHODS] + [f"norms[{m}]" for m in METHODS]
    if model == "mlp":
        rows += [bench.OUTER, bench.HAND_NORMS]
    return sorted(rows)


def test_every_row_is_present_and_agrees_with_the_loop(smoke):
    code, out, figures, _ = smoke
    assert code == 0, out
    entries = figures["entries"]
    for model in ("mlp", "cnn"):
        names = sorted(e["name"] for e in entries if e["model"] == model)
        assert names == _expected_rows(model), names
    problems = []
    for e in entries:
        where = f"{e['model']} {e['name']}"
        if e["status"] == "n/a":
            # only a method that is not built yet may be missing, and it says so
            if "NotImplementedError" not in e["reason"] or e["name"] in (
                    bench.LOOP, bench.BATCH, bench.VMAP, bench.OUTER, bench.HAND_NORMS):
                problems.append(f"{where}: n/a for {e['reason']!r}")
            continue
        if e["status"] != "ok":
            problems.append(f"{where}: {e['status']} {e['reason']}")
            continue
        if e["computes"] in bench.NOT_COMPARED:   # the write limit, the norms floor
            if e["max_abs_diff"] is not None or e["agrees"] is not None:
                problems.append(f"{where}: a row that computes no gradient was compared")
            continue
        allowed = TOLERANCE * max(1.0, e["max_abs_reference"])
        if not 0 <= e["max_abs_diff"] <= allowed:
            problems.append(f"{where}: max |diff| {e['max_abs_diff']} > {allowed}")
        if e["agrees"] is not True:
            problems.append(f"{where}: agrees is {e['agrees']!r}")
        if e["max_abs_reference"] <= 0:
            problems.append(f"{where}: the loop's result is all zeros, nothing was compared")
    assert not problems, "\n".join(problems)


def test_json_holds_every_figure_and_numbers_are_positive(smoke):
    _, out, figures, _ = smoke
    machine = figures["machine"]
    assert machine["cpu_count"] >= 1 and machine["tensorflow"] == tf.__version__
    assert machine["date_utc"].endswith("UTC")
    assert figures["settings"]["batch_sizes"] == {"mlp": [B], "cnn": [B]}
    assert set(figures["notes"]) == {"ms", "ratios", "peak_bytes", "max_abs_diff",
                                     "estimate_bytes", "memory_write_limit", "norms_floor",
                                     "cpu_speed"}
    speed = machine["cpu_speed"]
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "LD_PRELOAD",
                 "TF_ENABLE_ONEDNN_OPTS"):
        assert speed[name] == os.environ.get(name), name
    assert speed["onednn_enabled"] in (True, False) and speed["avx512"] in (True, False, None)
    assert "TF_ENABLE_ONEDNN_OPTS=" in out and "AVX-512:" in out
    for e in figures["entries"]:
        assert e["batch_size"] == B
        if e["status"] != "ok":
            continue
        where = f"{e['model']} {e['name']}"
        expected_runs = 1 if e["name"] == bench.LOOP else 2
        assert len(e["runs_ms"]) == expected_runs, where
        for field in ("median_ms", "build_seconds", "first_run_seconds", "peak_bytes",
                      "ratio_to_loop", "ratio_to_batch"):
            assert e[field] is not None and e[field] > 0, (where, field, e[field])
        assert e["median_ms"] == pytest.approx(float(np.median(e["runs_ms"])))
        loop = next(x for x in figures["entries"]
                    if x["model"] == e["model"] and x["name"] == bench.LOOP)
        assert e["ratio_to_loop"] == pytest.approx(e["median_ms"] / loop["median_ms"])
        assert (e["ratio_to_outer"] is not None) == (e["model"] == "mlp"), where
    for e in figures["entries"]:
        assert e["name"] in out                        # every row is in the printed table
    assert "peak MiB" in out and "est MiB" in out
    assert f"TensorFlow {tf.__version__}" in out and "CPUs" in out


def test_memory_of_materialized_gradients_covers_their_size(smoke):
    """A fetched [B, *x.shape] result is live at the end of the run, so the peak holds
    at least its bytes; the hand-written norms never hold it."""
    _, _, figures, _ = smoke
    parameters = {"mlp": 100 * 256 + 256 + 256 * 256 + 256 + 256 + 1,
                  "cnn": 5 * 5 * 16 + 16 + 32 * 32 * 16 * 128 + 128 + 128 + 1}
    for e in figures["entries"]:
        assert e["parameters"] == parameters[e["model"]]
        result_bytes = 4 * B * parameters[e["model"]]
        if (e["status"] == "ok" and e["computes"] in ("gradients", "write")
                and e["name"] != bench.LOOP):
            assert e["peak_bytes"] >= result_bytes, (e["model"], e["name"], e["peak_bytes"])
        if e["name"].startswith("gradients["):
            # pertower.estimate_memory, on the plan: the result, written once by the
            # rules; the towers hold their gradients before stacking as well
            towers = 2 if e["name"] == "gradients[towers]" else 1
            assert e["estimate_bytes"] >= towers * result_bytes, (e["model"], e["name"])
        else:
            assert e["estimate_bytes"] is None, (e["model"], e["name"])
    mlp = {e["name"]: e for e in figures["entries"] if e["model"] == "mlp"}
    assert mlp[bench.HAND_NORMS]["peak_bytes"] < 4 * B * parameters["mlp"]


def test_plot_writes_a_png(smoke):
    _, _, _, png_path = smoke
    with open(png_path, "rb") as handle:
        assert handle.read(8) == b"\x89PNG\r\n\x1a\n"
    assert png_path.stat().st_size > 10_000


def test_json_to_stdout_and_unknown_method(capsys):
    code = cli.main(["bench", "--models", "mlp", "--batch-sizes", "2", "--methods",
                     "towers", "--repeats", "1", "--loop-repeats", "1", "--json", "-"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    figures = json.loads(captured.out)                 # stdout is JSON only
    names = {e["name"] for e in figures["entries"]}
    assert "gradients[towers]" in names and "gradients[auto]" not in names
    assert "gradients[towers]" in captured.err         # the table went to stderr
    assert cli.main(["bench", "--methods", "fastest"]) == 2
    assert "--methods fastest: unknown" in capsys.readouterr().err


def test_exit_code_is_1_when_an_entry_disagrees(monkeypatch, capsys):
    wrong = bench.Entry("mlp", 2, 10, "gradients[towers]", "gradients", median_ms=1.0,
                        runs_ms=[1.0], max_abs_diff=0.5, max_abs_reference=1.0, agrees=False)
    monkeypatch.setattr(bench, "run_bench", lambda **kwargs: [wrong])
    assert cli.main(["bench", "--models", "mlp", "--json", "-"]) == 1
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


def test_the_cli_offers_the_bench_models():
    from pertower.tools import bench, cli, models
    assert cli.BENCH_MODELS == bench.MODELS == models.MODEL_NAMES


def test_dp_rows_time_the_plain_step_each_method_and_the_step_without_noise():
    entries = bench.run_dp_bench(models=["mlp"], batch_sizes=[B], repeats=2,
                                 methods=("auto", "towers"), report=lambda line: None)
    assert [e.name for e in entries] == ["plain step", "dp step[auto]", "dp step[towers]",
                                         "dp step[auto] σ=0"]
    for e in entries:
        assert e.model == "mlp" and e.batch_size == B and len(e.runs_ms) == 2, e
        assert all(t > 0 for t in e.runs_ms) and e.median_ms > 0, e
    table = bench.format_dp_table(entries)
    assert all(e.name in table for e in entries), table

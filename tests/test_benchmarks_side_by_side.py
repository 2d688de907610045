"""`python -m benchmarks` runs every row in one worker process per oneDNN setting (and
per `--pertower` checkout), in interleaved rounds, and prints the rows side by side;
`--onednn as-is` measures in its own process. The workers are recorded here (not
started) except in the heavy test, which starts both settings for real. No timing
thresholds."""

import json
import os
import subprocess
import sys

import pytest

import benchmarks
from benchmarks import command
from benchmarks import records
from benchmarks import runner
from benchmarks import sides

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _entry(name, ms):
    return records.Entry("mlp", 2, 10, name, "gradients", median_ms=ms, runs_ms=[ms],
                         max_abs_diff=0.0, max_abs_reference=1.0, agrees=True)


def test_workers_one_per_setting_and_checkout_in_rotated_rounds(monkeypatch, capsys, tmp_path):
    """Two checkouts x two settings x two rounds: eight workers, each the same command
    without the driver's options plus `--onednn as-is --json FILE`, with its
    TF_ENABLE_ONEDNN_OPTS, the --env variables and its checkout first on PYTHONPATH;
    round 2 starts with the second column. A cell is the median over the rounds, in
    brackets its ratio to the batch gradient of its column; on/off and "/ first" divide
    the cells as worked out here by hand."""
    other = tmp_path / "old"
    (other / "pertower").mkdir(parents=True)
    (other / "pertower" / "__init__.py").write_text("")
    started = []
    # ms per (checkout, setting): the batch gradient, and gradients[auto] in rounds 1, 2
    measured = {(ROOT, "0"): (2.0, (4.0, 6.0)), (ROOT, "1"): (1.0, (1.0, 3.0)),
                (str(other), "0"): (2.0, (10.0, 10.0)), (str(other), "1"): (2.0, (3.0, 5.0))}

    def record(argv, env, cwd, stdout, check):
        assert check is False and stdout is sys.stderr       # --json -: the table to stderr
        # `python -m` puts the current folder first on sys.path: none with a pertower/
        assert not os.path.exists(os.path.join(cwd, "pertower"))
        checkout = env["PYTHONPATH"].split(os.pathsep)[0]
        assert ROOT in env["PYTHONPATH"].split(os.pathsep)[:2]
        assert env["MALLOC_TRIM_THRESHOLD_"] == "4294967296"
        batch_ms, rounds_ms = measured[(checkout, env["TF_ENABLE_ONEDNN_OPTS"])]
        count = sum(1 for _, e in started if e["PYTHONPATH"] == env["PYTHONPATH"]
                    and e["TF_ENABLE_ONEDNN_OPTS"] == env["TF_ENABLE_ONEDNN_OPTS"])
        started.append((argv, env))
        figures = {"entries": [vars(_entry(records.BATCH, batch_ms)),
                               vars(_entry("gradients[auto]", rounds_ms[count]))],
                   "machine": {"pertower_folder": os.path.join(checkout, "pertower")}}
        with open(argv[argv.index("--json") + 1], "w", encoding="utf-8") as handle:
            json.dump(figures, handle)
        return subprocess.CompletedProcess(argv, 0)

    monkeypatch.setattr(subprocess, "run", record)
    monkeypatch.setattr(sides, "_checkout_label", lambda path: "new" if path == ROOT else "old")
    argv = ["--models", "mlp", "--pertower", ROOT, "--pertower=" + str(other), "--rounds",
            "2", "--batch-sizes", "2", "--env", "MALLOC_TRIM_THRESHOLD_=4294967296",
            "--json", "-"]
    assert command.main(argv) == 0
    assert len(started) == 8
    for worker_argv, _ in started:
        assert worker_argv[:3] == [sys.executable, "-m", "benchmarks"]
        assert worker_argv[3:10] == ["--models", "mlp", "--batch-sizes", "2", "--onednn",
                                     "as-is", "--json"] and len(worker_argv) == 11
    order = [(e["PYTHONPATH"].split(os.pathsep)[0], e["TF_ENABLE_ONEDNN_OPTS"])
             for _, e in started]
    assert order[:4] == [(ROOT, "0"), (ROOT, "1"), (str(other), "0"), (str(other), "1")]
    assert order[4:] == order[1:4] + order[:1]

    captured = capsys.readouterr()
    figures = json.loads(captured.out)
    assert figures["columns"] == ["new off", "new on", "old off", "old on"]
    row, = [r for r in figures["rows"] if r["row"] == "gradients[auto]"]
    assert row["cells"] == [5.0, 2.0, 10.0, 4.0]
    line, = [l for l in captured.err.splitlines() if "gradients[auto]" in l]
    cells = [c.strip() for c in line.strip("| ").split("|")]
    assert cells[4:8] == ["5.0 (2.50x)", "2.0 (2.00x)", "10.0 (5.00x)", "4.0 (2.00x)"]
    assert cells[8:] == ["0.40", "0.40", "2.00", "2.00"]       # on/off; old / new

    # the same table again from the JSON (python -m benchmarks.sides FIGURES.json ROW)
    saved = tmp_path / "figures.json"
    saved.write_text(captured.out)
    assert sides.main([str(saved), "gradients[auto]"]) == 0
    again = capsys.readouterr().out.splitlines()
    assert len(again) == 3 and again[2] == line


def test_a_worker_that_measured_another_pertower_fails_the_run(monkeypatch, capsys):
    def record(argv, env, cwd, stdout, check):
        with open(argv[argv.index("--json") + 1], "w", encoding="utf-8") as handle:
            json.dump({"machine": {"pertower_folder": "/elsewhere/pertower"}}, handle)
        return subprocess.CompletedProcess(argv, 0)

    monkeypatch.setattr(subprocess, "run", record)
    monkeypatch.setattr(sides, "_checkout_label", lambda path: "new")
    assert command.main(["--onednn", "off", "--pertower", ROOT]) == 1
    assert "measured the pertower of /elsewhere/pertower, not" in capsys.readouterr().out


def test_dp_rows_are_divided_by_the_plain_step_in_wall_and_cpu_ms():
    figures = {"dp_steps": [
        {"model": "cifar", "batch_size": 64, "step": "plain step", "median_ms": 20.0,
         "median_cpu_ms": 30.0},
        {"model": "cifar", "batch_size": 64, "step": "dp step[auto]", "median_ms": 26.0,
         "median_cpu_ms": 39.0}]}
    cols = [sides.Column(None, "off", "x off")]
    rows = sides.merge(cols, [{"column": 0, "figures": figures}])
    assert rows[("dp", "cifar", 64, "dp step[auto]" + sides.CPU)] == [39.0]
    table = sides.format_table(cols, rows)
    assert "| dp | cifar | 64 | dp step[auto] | 26.0 (1.30x) |" in table
    assert "| dp | cifar | 64 | dp step[auto] [cpu ms] | 39.0 (1.30x) |" in table


def test_dp_fit_rows_are_divided_by_the_plain_row_of_their_kind():
    """--dp-fit: a DP epoch (with or without noise) by the plain epoch, a DP
    train_on_batch by the plain train_on_batch (benchmarks.dp_fit.reference)."""
    def row(step, ms):
        return {"model": "cifar", "batch_size": 64, "step": step, "median_ms": ms,
                "median_cpu_ms": 2 * ms}
    figures = {"dp_fit": [row("plain fit epoch", 400.0), row("dp fit epoch", 500.0),
                          row("dp fit epoch σ=0", 480.0), row("plain train_on_batch", 50.0),
                          row("dp train_on_batch", 60.0)]}
    cols = [sides.Column(None, "on", "x on")]
    table = sides.format_table(cols, sides.merge(cols, [{"column": 0, "figures": figures}]))
    assert "| dp fit | cifar | 64 | plain fit epoch | 400.0 |" in table
    assert "| dp fit | cifar | 64 | dp fit epoch | 500.0 (1.25x) |" in table
    assert "| dp fit | cifar | 64 | dp fit epoch σ=0 [cpu ms] | 960.0 (1.20x) |" in table
    assert "| dp fit | cifar | 64 | dp train_on_batch | 60.0 (1.20x) |" in table


def test_as_is_measures_here_and_refuses_the_worker_options(monkeypatch, capsys):
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("started a worker"))
    monkeypatch.setattr(runner, "run_bench", lambda **kwargs: [_entry("gradients[towers]", 1.0)])
    assert command.main(["--onednn", "as-is", "--models", "mlp", "--json", "-"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["entries"][0]["name"] == "gradients[towers]"
    for extra in (["--env", "A=1"], ["--pertower", ROOT], ["--rounds", "2"]):
        assert command.main(["--onednn", "as-is"] + extra) == 2
        assert "drop --onednn as-is" in capsys.readouterr().err


def test_bad_options_are_refused(capsys):
    for bad in ("NOVALUE", "=1", "1X=2"):
        with pytest.raises(SystemExit):
            command.build_parser().parse_args(["--env", bad])
        assert "expected NAME=VALUE" in capsys.readouterr().err
    args = command.build_parser().parse_args(["--env", "A=1=2", "--env", "B="])
    assert args.env == [("A", "1=2"), ("B", "")]
    assert command.main(["--pertower", "/nonexistent"]) == 2
    assert "--pertower /nonexistent: no pertower/__init__.py" in capsys.readouterr().err


def test_the_workers_find_this_checkouts_models_first():
    """`benchmarks` puts this checkout's pertower/tools first on pertower.tools' path (the
    models of every column are the same); python_path puts the library's checkout, then
    this one, first."""
    import pertower.tools  # pylint: disable=import-outside-toplevel
    here = os.path.realpath(os.path.join(ROOT, "pertower", "tools"))
    assert os.path.realpath(pertower.tools.__path__[0]) == here
    assert benchmarks.python_path("/x").split(os.pathsep)[:2] == ["/x", ROOT]


@pytest.mark.heavy   # two TensorFlow start-ups; the test above records the workers
def test_both_settings_measured_in_workers_with_quiet_stderr():
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    process = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--models", "mlp", "--batch-sizes", "2",
         "--methods", "towers", "--repeats", "1", "--loop-repeats", "1", "--json", "-",
         "--env", "MALLOC_TRIM_THRESHOLD_=4294967296"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert process.returncode == 0, process.stderr
    figures = json.loads(process.stdout)
    speeds = [w["figures"]["machine"]["cpu_speed"] for w in figures["workers"]]
    assert [s["onednn_enabled"] for s in speeds] == [False, True]
    assert all(s["MALLOC_TRIM_THRESHOLD_"] == "4294967296" for s in speeds)
    assert any(r["row"] == "gradients[towers]" and all(isinstance(c, float) for c in r["cells"])
               for r in figures["rows"])
    assert "on/off" in process.stderr and "oneDNN custom operations" not in process.stderr

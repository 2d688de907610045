"""The example scripts and `pertower demo` run, exit 0 and report agreement with the loop.

They run as a user runs them, in a fresh process of their own ("scenario_examples" of
tests/process_checks.py: tests/scripts/scenario_examples.py runs the three scripts and
then `python -m pertower demo` in that one process, each checked to set up its own
environment: TensorFlow's global state (graph mode, Keras version) is theirs).
"""

import dataclasses
import importlib.metadata

import pytest

EXAMPLES = {
    "scenario1_keras_mlp.py": [
        "OK: per-example gradients match the one-example loop (8 examples, 6 weights)",
    ],
    "scenario2_two_batches_cosine.py": [
        "g1 (kernel) = [3. 6. 9.]",
        "g2 (kernel) = [ 3.  6. 10.]",
        "cosine = 0.9987677",
        "OK: g1, g2 and their cosine match the one-batch-at-a-time loop",
    ],
    "scenario3_cnn_jacobian.py": [
        "(8, 3, 16384, 128)",
        "OK: per-example Jacobians (1 and 3 outputs) match the one-example loop",
    ],
}


@pytest.mark.process_checks("scenario_examples")
@pytest.mark.parametrize("script", sorted(EXAMPLES))
def test_example_runs_and_matches_the_loop(processes, script):
    out = processes.assert_passed("scenario_examples", script).output
    for expected in EXAMPLES[script]:
        assert expected in out, f"missing {expected!r}\n--- stdout\n{out}"


@pytest.mark.process_checks("scenario_examples")
def test_demo_runs_and_every_scenario_agrees(processes):
    out = processes.assert_passed("scenario_examples", "demo").output
    explain = f"--- stdout\n{out}"
    assert out.count("agrees with the loop") == 3, explain
    assert "All scenarios match the one-example loop." in out, explain
    table = out[out.index("scenario  "):].splitlines()
    assert "speed-up" in table[0] and "build s" in table[0], explain
    rows = table[2:5]
    assert [row.split()[0] for row in rows] == ["1", "2", "3"], explain
    assert all(row.split()[-1] == "yes" for row in rows), explain


def test_console_script_is_declared():
    scripts = importlib.metadata.entry_points(group="console_scripts")
    assert [s.value for s in scripts if s.name == "pertower"] == ["pertower.tools.cli:main"]


def test_cli_parses_demo_options_and_rejects_bad_batch_sizes():
    from pertower.tools import cli

    args = cli.build_parser().parse_args(["demo"])
    assert (args.command, args.batch_size, args.repeats) == ("demo", 32, 5)
    assert cli.build_parser().parse_args(["demo", "--batch-size", "8"]).batch_size == 8
    for bad in (["demo", "--batch-size", "0"], ["demo", "--batch-size", "x"], []):
        with pytest.raises(SystemExit) as error:
            cli.build_parser().parse_args(bad)
        assert error.value.code == 2


def test_cli_exits_non_zero_when_a_scenario_disagrees(monkeypatch, capsys):
    from pertower.tools import cli
    from pertower.tools import demo
    from pertower.tools import environment

    agreeing = demo.ScenarioResult(
        name="1 fake", description="fake", detail="", batch_size=4, loop_runs=4,
        max_abs_diff=0.0, agrees=True, build_seconds=0.1, first_run_seconds=0.1,
        pertower_seconds=0.001, loop_seconds=0.004)
    disagreeing = dataclasses.replace(agreeing, name="2 fake", max_abs_diff=1.0,
                                      agrees=False)
    monkeypatch.setattr(environment, "graph_mode_tensorflow",
                        lambda: __import__("tensorflow"))
    monkeypatch.setattr(demo, "run_demo", lambda **kwargs: [agreeing, disagreeing])
    assert cli.main(["demo", "--batch-size", "4"]) == 1
    out = capsys.readouterr().out
    assert "FAILED: 2 fake" in out and "4.0x" in out

    monkeypatch.setattr(demo, "run_demo", lambda **kwargs: [agreeing])
    assert cli.main(["demo"]) == 0

"""The example scripts and `pertower demo` run, exit 0 and report agreement with the loop.

They run as a user runs them, in a fresh process of their own
(tests/scripts/scenario_examples.py runs the three scripts and then
`python -m pertower demo` in that one process, each checked to set up its own
environment: TensorFlow's global state (graph mode, Keras version) is theirs). Only
the first script there starts TensorFlow in a fresh interpreter: that every script sets
TF_USE_LEGACY_KERAS (and quiets TensorFlow) before its first TensorFlow import is
checked on its text here.
"""

import dataclasses
import importlib.metadata
import json
import os
import subprocess
import sys

import pytest

from tests import common

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
    # (B, 3, 16384, 128): B is 8, or what the process passes as --batch-size
    "scenario3_cnn_jacobian.py": [
        ", 3, 16384, 128)",
        "OK: per-example Jacobians (1 and 3 outputs) match the one-example loop (",
        " examples, 6 weights)",
    ],
}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """{script or "demo": its output}, from tests/scripts/scenario_examples.py run in a
    fresh interpreter without TF_USE_LEGACY_KERAS (each sets it up itself)."""
    path = tmp_path_factory.mktemp("examples") / "outputs.json"
    common.run_python("tests/scripts/scenario_examples.py", str(path),
                      env={"TF_USE_LEGACY_KERAS": None})
    return json.loads(path.read_text(encoding="utf-8"))


@pytest.mark.parametrize("script", sorted(EXAMPLES))
def test_example_runs_and_matches_the_loop(outputs, script):
    out = outputs[script]
    for expected in EXAMPLES[script]:
        assert expected in out, f"missing {expected!r}\n--- stdout\n{out}"


def test_demo_runs_and_every_scenario_agrees(outputs):
    out = outputs["demo"]
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


@pytest.mark.parametrize("script", ["scenario2_two_batches_cosine.py", "legacy_lstm.py"])
def test_an_example_that_needs_keras_2_says_how_to_get_it(script):
    """With TF_USE_LEGACY_KERAS off, a script built on tf.compat.v1.layers or rnn_cell
    stops before TensorFlow with the fix, instead of Keras 3's AttributeError."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TF_USE_LEGACY_KERAS="0", PYTHONPATH=root)
    done = subprocess.run([sys.executable, os.path.join(root, "examples", script)],
                          env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1, done.stderr
    assert "needs Keras 2" in done.stderr and "set it to 1" in done.stderr, done.stderr


@pytest.mark.parametrize("value, accepted", [("1", True), ("true", True), ("True", True),
                                             ("yes", False), ("0", False), ("", False)])
def test_the_demo_accepts_what_tensorflow_reads_as_legacy_keras(monkeypatch, value, accepted):
    from pertower.tools import demo

    monkeypatch.setenv("TF_USE_LEGACY_KERAS", value)
    if accepted:
        demo._require_legacy_keras()  # pylint: disable=protected-access
    else:
        with pytest.raises(RuntimeError, match="set TF_USE_LEGACY_KERAS=1"):
            demo._require_legacy_keras()  # pylint: disable=protected-access


def test_every_example_quiets_tensorflow_before_importing_it():
    """Each script sets TF_CPP_MIN_LOG_LEVEL (as the `pertower` command does) and
    TF_USE_LEGACY_KERAS (read when TensorFlow is imported) before its first import of
    TensorFlow (or of a helper that imports it)."""
    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "examples")
    scripts = sorted(name for name in os.listdir(folder)
                     if name.endswith(".py") and name != "digits_common.py")
    assert len(scripts) >= 10, scripts
    for name in scripts:
        with open(os.path.join(folder, name), encoding="utf-8") as handle:
            lines = handle.read().splitlines()
        quiet, keras_2 = (next((n for n, line in enumerate(lines) if line.startswith(
            f'os.environ.setdefault("{variable}", "{value}")')), None)
            for variable, value in (("TF_CPP_MIN_LOG_LEVEL", "2"), ("TF_USE_LEGACY_KERAS", "1")))
        first_tf = next(n for n, line in enumerate(lines)
                        if line.startswith(("import tensorflow", "import tf_keras",
                                            "import digits_common", "import pertower",
                                            "from pertower")))
        assert quiet is not None and quiet < first_tf, name
        assert keras_2 is not None and keras_2 < first_tf, name

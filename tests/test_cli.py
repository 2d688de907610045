"""The `pertower` command (`demo`, `explain`; the benchmarks are `python -m benchmarks`,
tests/test_benchmarks_side_by_side.py) starts without TensorFlow, keeps TensorFlow's
log lines off the terminal and reports the CPU settings it runs under. Subprocesses run
this worktree's pertower (PYTHONPATH). That `import
pertower` loads its public names lazily without touching the environment is checked
in tests/test_docs.py, in the fresh process that runs the documents' blocks."""

import os
import re
import subprocess
import sys

import pytest

from pertower.tools import cli
from pertower.tools import environment
from pertower.tools import timing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOISE = re.compile(r"Profiler session|GPU trace was not collected|cuInit|cuda drivers|"
                   r"oneDNN custom operations|absl::InitializeLog|cpu_feature_guard")


def _python(code_or_args, extra_env=None):
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)      # the command must set it itself
    env.update(extra_env or {})
    args = ["-c", code_or_args] if isinstance(code_or_args, str) else code_or_args
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600, check=False)


def test_help_and_version_do_not_import_tensorflow():
    process = _python(
        "import sys\n"
        "import pertower.tools.cli as c\n"
        "for argv in (['--help'], ['demo', '--help'], ['explain', '--help'], ['--version']):\n"
        "    try:\n"
        "        c.main(argv)\n"
        "    except SystemExit as exit:\n"
        "        assert exit.code == 0, (argv, exit.code)\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in\n"
        "                ('tensorflow', 'tf_keras', 'numpy'))\n"
        "assert not loaded, loaded\n"
        "print('no tensorflow')\n")
    assert process.returncode == 0, process.stderr
    assert "no tensorflow" in process.stdout and "--batch-size B" in process.stdout
    assert "pertower 0.1.0" in process.stdout


def test_the_bench_is_not_a_command_of_the_installed_package(capsys):
    """`pertower bench` is gone: the benchmarks run from a checkout (python -m benchmarks)."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench"])
    assert exit_info.value.code == 2 and "invalid choice: 'bench'" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["module", "script", "bench module"])
def test_the_command_prints_help_without_tensorflow_log_lines(command):
    if command == "module":
        args = [sys.executable, "-m", "pertower", "--help"]
    elif command == "bench module":
        args = [sys.executable, "-m", "benchmarks", "--help"]
    else:
        # what the `pertower` console script of setup.py's entry point runs (an
        # installed script may predate this checkout's layout, so it is not used)
        with open(os.path.join(ROOT, "setup.py"), encoding="utf-8") as handle:
            assert '"pertower=pertower.tools.cli:main"' in handle.read()
        args = [sys.executable, "-c", "import sys; from pertower.tools.cli import main; "
                "sys.argv[0] = 'pertower'; sys.exit(main())", "--help"]
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONPROFILEIMPORTTIME="1")
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    process = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=600, check=False)
    assert process.returncode == 0, process.stderr
    assert ("--onednn" if command == "bench module" else "explain") in process.stdout
    # PYTHONPROFILEIMPORTTIME lists every module imported, on stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in process.stderr.splitlines()
                if line.startswith("import time:")}
    # `python -m benchmarks` parses with the bench's own command module
    assert ("benchmarks.command" if command == "bench module"
            else "pertower.tools.cli") in imported
    assert not {m for m in imported if m.split(".")[0] == "tensorflow"}
    assert not NOISE.search(process.stderr)


def test_version_is_in_one_place():
    import pertower
    from pertower import _version
    assert pertower.__version__ == _version.__version__
    with open(os.path.join(ROOT, "setup.py"), encoding="utf-8") as handle:
        assert "_version.py" in handle.read()
    process = _python(["setup.py", "--version"])
    assert process.stdout.strip().splitlines()[-1] == _version.__version__, process.stderr


def test_quiet_native_logs_drops_tensorflow_noise_and_keeps_the_rest(capfd):
    with environment.quiet_native_logs():
        os.write(2, b"2026-01-01 I profiler_session.cc] Profiler session initializing.\n")
        os.write(2, b"W gpu_tracer] GPU trace was not collected\n")
        os.write(2, b"a real error from native code\n")
    err = capfd.readouterr().err
    assert "a real error from native code" in err
    assert "Profiler" not in err and "GPU trace" not in err


def test_prepare_tensorflow_keeps_the_users_settings():
    environ = {"TF_CPP_MIN_LOG_LEVEL": "0"}
    assert environment.prepare_tensorflow(environ) == ["TF_USE_LEGACY_KERAS"]
    assert environ == {"TF_CPP_MIN_LOG_LEVEL": "0", "TF_USE_LEGACY_KERAS": "1"}


def test_cpu_facts_report_the_variables_as_set():
    facts = environment.cpu_facts({"MALLOC_MMAP_THRESHOLD_": "4294967296"})
    assert facts["MALLOC_MMAP_THRESHOLD_"] == "4294967296"
    assert facts["MALLOC_TRIM_THRESHOLD_"] is None and facts["LD_PRELOAD"] is None
    line = environment.describe_cpu_facts(facts)
    assert "MALLOC_MMAP_THRESHOLD_=4294967296" in line and "LD_PRELOAD=(unset)" in line


def test_round_robin_and_table():
    calls = []
    times = timing.round_robin([(lambda: calls.append("a"), 3), (lambda: calls.append("b"), 1)])
    assert calls == ["a", "b", "a", "a"] and [len(t) for t in times] == [3, 1]
    assert all(t >= 0 for t in times[0] + times[1])
    table = timing.format_table(("name", "ms", "x"), [("a", "1.50", "1.0"),
                                                      ("longer", "12.00", "8.0"),
                                                      ("skipped", "n/a: too big")])
    lines = table.splitlines()
    assert lines[0] == "name       ms    x" and lines[1] == "-" * len(lines[0])
    assert lines[2] == "a        1.50  1.0" and lines[3] == "longer  12.00  8.0"
    assert lines[4] == "skipped  n/a: too big"

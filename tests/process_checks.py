"""Checks that need a process of their own, started once per test session.

Some checks need a process-wide TensorFlow mode that the test process cannot switch to
(eager execution, `tf.compat.v1.disable_v2_behavior()`), servers that live until their
process ends, or a fresh interpreter (the examples and `pertower demo` set up their own
environment). Each such process is a script or command of `PROCESSES`; a script runs
many checks and reports each on a line of its own:

    pertower-check {"name": "check_v1_cond", "ok": true, "message": ""}

The test process queues every process that its collected tests name (with the marker
`@pytest.mark.process_checks("legacy")`) as soon as collection ends; a background
thread runs them one at a time, so their start-ups overlap the other tests. Each test
then waits for its process and asserts the result of its own check
(`Processes.assert_passed`) or reads its output (`Processes.completed`).
tests/conftest.py holds the one `Processes` of the session.

The script side is `run_checks`, called by the scripts of tests/scripts/.
"""

import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

__all__ = ["PROCESSES", "Processes", "Completed", "CheckResult", "run_checks",
           "LEGACY_HEAVY_CHECKS", "legacy_process", "legacy_params", "free_ports"]

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
_PREFIX = "pertower-check "
# A process that has not ended by then is taken as hung and killed. Generous: the
# background processes run at a lower priority, and on a shared, loaded machine the
# legacy process alone took over 600 s (its checks 40-60 s each instead of a few).
TIMEOUT_SECONDS = 1800


@dataclasses.dataclass(frozen=True)
class _Command:
    """How to start one process.

    Attributes:
      argv: the arguments after the Python executable.
      legacy_keras_env: True to pass TF_USE_LEGACY_KERAS=1 (tests/conftest.py sets it in
        this process); False to remove it, so that the process must set it up itself.
    """

    argv: tuple
    legacy_keras_env: bool = True
    one_thread: bool = True


PROCESSES = {
    # tf.compat.v1.disable_v2_behavior(): reference variables, v1 control flow.
    "legacy": _Command((os.path.join(HERE, "scripts", "legacy_mode_checks.py"),)),
    # its long checks (LEGACY_HEAVY_CHECKS), for the heavy run (-m heavy)
    "legacy_heavy": _Command((os.path.join(HERE, "scripts", "legacy_mode_checks.py"), "heavy")),
    # the same, for the rules of tests/test_rules_published.py.
    "published_legacy": _Command((os.path.join(HERE, "scripts", "published_rules_checks.py"),)),
    "published_legacy_zoo": _Command(
        (os.path.join(HERE, "scripts", "published_rules_checks.py"), "zoo")),
    # the same, for the weight functions of tests/test_rules_weight_functions.py.
    "weight_functions_legacy": _Command((os.path.join(HERE, "scripts",
                                                      "weight_function_checks.py"),)),
    # weights read inside while loops on the rules (tests/test_rules_recurrent.py)
    "recurrent_legacy": _Command((os.path.join(HERE, "scripts", "recurrent_rules_checks.py"),)),
    # batch sizes used as shapes and indices in the towers, under disable_v2_behavior()
    "tower_sizes": _Command((os.path.join(HERE, "scripts", "tower_sizes_checks.py"),)),
    # joined batches through v1 loops and the row passes' fed-size message
    "messages_joined_legacy": _Command(
        (os.path.join(HERE, "scripts", "messages_and_joined_checks.py"),)),
    # Python gradients and transposed convolutions in the towers, the environment's oneDNN
    "python_gradients_legacy": _Command(
        (os.path.join(HERE, "scripts", "python_gradient_checks.py"), "inherit", "legacy"),
        one_thread=False),
    # loops bounded by a batch reduction and Python gradients on row passes, v1 loops
    "never_wrong_loops": _Command((os.path.join(HERE, "scripts", "never_wrong_loop_checks.py"),)),
    # non-float variables in DPOptimizer and the rules' static sizes, in each shape mode
    **{f"never_wrong_{kind}_{mode}": _Command(
        (os.path.join(HERE, "scripts", f"never_wrong_{kind}_checks.py"), mode),
        one_thread=False)
       for kind in ("dtype", "shape") for mode in ("graph", "legacy")},
    "curvature_legacy": _Command((os.path.join(HERE, "scripts", "curvature_legacy_checks.py"),)),
    # the DP modes and per-weight norms under disable_v2_behavior()
    "dp_modes_legacy": _Command((os.path.join(HERE, "scripts", "dp_modes_legacy_checks.py"),)),
    # tests/test_rules_convs.py under disable_v2_behavior() and with TF_ENABLE_ONEDNN_OPTS=1
    **{f"convs_{mode}": _Command((os.path.join(HERE, "scripts", "conv_rules_checks.py"), mode),
                                 one_thread=mode == "legacy") for mode in ("legacy", "onednn")},
    **{f"zoo_speed_{m}": _Command((os.path.join(HERE, "scripts", "zoo_speed_checks.py"), m))
       for m in ("legacy", "onednn")},   # tests/test_rules_zoo_speed.py in the other modes
    # eager execution on (TensorFlow 2's default): pertower refuses, naming the switch.
    "eager": _Command((os.path.join(HERE, "scripts", "eager_mode_checks.py"),)),
    # two tf.distribute.Servers, alive until the process ends.
    "distributed": _Command((os.path.join(HERE, "scripts", "distributed_towers.py"),)),
    # DPSyncReplicasOptimizer on a ps and two workers (in-process servers, one thread each)
    **{name: _Command((os.path.join(HERE, "scripts", "dp_distributed_checks.py"), *args),
                      one_thread=False)
       for name, args in (("dp_distributed", ()), ("dp_distributed_stats", ("stats",)),
                          ("dp_distributed_legacy", ("legacy",)))},
    # the user-facing commands, as a user runs them: they set their environment up.
    "scenario_examples": _Command((os.path.join(HERE, "scripts", "scenario_examples.py"),),
                                  legacy_keras_env=False),
    # Keras 3 (tf.keras without TF_USE_LEGACY_KERAS): its own summary line, no checks.
    "keras3": _Command((os.path.join(HERE, "scripts", "keras3_weights.py"),),
                       legacy_keras_env=False),
}


# The checks of tests/scripts/legacy_mode_checks.py that take several seconds each: they
# run in the process "legacy_heavy", read by heavy tests only; the others in "legacy".
LEGACY_HEAVY_CHECKS = frozenset({
    "check_v1_bidirectional_dynamic_rnn_microbatches_match_oracle",
    "check_legacy_lstm_example_runs_and_matches_the_loop",
    "check_v1_dynamic_rnn_final_state_of_each_cell_is_proven",
    "check_v1_raw_rnn_is_checked_at_run_time_and_matches_oracle",
    "check_v1_dynamic_rnn_basic_rnn_and_multi_rnn_cells_match_oracle",
    "check_lstm_with_control_flow_v2_matches_oracle",
    "check_v1_map_fn_over_the_batch_is_proven",
    "check_v1_dynamic_rnn_final_state_with_sequence_length_is_proven",
})


def legacy_process(check):
    """The process that runs legacy check `check`: "legacy_heavy" or "legacy"."""
    return "legacy_heavy" if check in LEGACY_HEAVY_CHECKS else "legacy"


def legacy_params(checks):
    """pytest parameters for the legacy checks named `checks`, each marked with the
    process that runs it (and `heavy` for the long ones)."""
    import pytest  # pylint: disable=import-outside-toplevel  (the scripts import this module)
    return [pytest.param(check, marks=(pytest.mark.process_checks(legacy_process(check)),)
                         + ((pytest.mark.heavy,) if check in LEGACY_HEAVY_CHECKS else ()))
            for check in checks]


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """What a process reported for one check.

    Attributes:
      ok: whether the check passed.
      message: the error, if it failed.
      output: what the check returned (e.g. the output of the script it ran), or "".
    """

    ok: bool
    message: str
    output: str


@dataclasses.dataclass(frozen=True)
class Completed:
    """A finished process: its exit code, output and per-check results.

    Attributes:
      name: the key of `PROCESSES`.
      returncode: the exit code.
      stdout, stderr: the output.
      checks: check name -> `CheckResult`, in the order reported.
    """

    name: str
    returncode: int
    stdout: str
    stderr: str
    checks: dict

    def explain(self):
        """The exit code and output, for a failure message."""
        return (f"process {self.name!r}: exit code {self.returncode}\n--- stdout\n"
                f"{self.stdout[-6000:]}\n--- stderr\n{self.stderr[-4000:]}")


class Processes:
    """The processes of one test session, each run at most once.

    `start` queues a process; a background thread runs the queue one process at a time
    (the test process keeps one core, the queue the other). `completed` waits for a
    process, starting it at once if it is still queued.

    Args:
      processes: name -> `_Command` (default `PROCESSES`).
    """

    def __init__(self, processes=None):
        self._commands = dict(PROCESSES if processes is None else processes)
        self._lock = threading.Lock()
        self._queue = []       # names to start, in order
        self._started = {}     # name -> (Popen, stdout file, stderr file)
        self._done = {}        # name -> Completed
        self._thread = None

    def start(self, name):
        """Queues process `name` to run in the background (once per session)."""
        if name not in self._commands:
            raise KeyError(f"unknown process {name!r}; known: {sorted(self._commands)}")
        with self._lock:
            if name in self._queue or name in self._started:
                return
            self._queue.append(name)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run_queue, daemon=True,
                                                name="process_checks")
                self._thread.start()

    def _run_queue(self):
        while True:
            with self._lock:
                if not self._queue:
                    self._thread = None
                    return
                name = self._queue.pop(0)
                popen = self._launch(name)
            _wait(popen)

    def _launch(self, name):
        """Starts process `name` (call with the lock held); returns its Popen."""
        command = self._commands[name]
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        if command.legacy_keras_env:
            env["TF_USE_LEGACY_KERAS"] = "1"
        else:
            env.pop("TF_USE_LEGACY_KERAS", None)
        # In the background of the test process: one TensorFlow thread each and a lower
        # scheduling priority, so that they use the core the test process's Python
        # leaves idle instead of slowing it down (their results are not timed).
        if command.one_thread:   # (TensorFlow's oneDNN convolutions crash on one thread)
            env.setdefault("TF_NUM_INTRAOP_THREADS", "1")
            env.setdefault("TF_NUM_INTEROP_THREADS", "1")
        # Files, not pipes: nobody reads while the process runs, and a full pipe blocks.
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        popen = subprocess.Popen([sys.executable, *command.argv], cwd=ROOT, env=env,
                                 stdout=out, stderr=err, text=True,
                                 preexec_fn=_lower_priority if os.name == "posix" else None)
        self._started[name] = (popen, out, err)
        return popen

    def completed(self, name):
        """Waits for process `name` (starting it now if it has not started); returns
        its `Completed`."""
        if name not in self._commands:
            raise KeyError(f"unknown process {name!r}; known: {sorted(self._commands)}")
        with self._lock:
            if name not in self._started:
                if name in self._queue:
                    self._queue.remove(name)
                self._launch(name)
            popen, out, err = self._started[name]
        returncode = _wait(popen)
        with self._lock:
            if name not in self._done:
                texts = []
                for f in (out, err):
                    f.seek(0)
                    texts.append(f.read())
                    f.close()
                self._done[name] = _parse(name, returncode, *texts)
            return self._done[name]

    def assert_passed(self, name, check):
        """Asserts that process `name` reported check `check` as passed; returns its
        `CheckResult`."""
        done = self.completed(name)
        assert check in done.checks, f"check {check!r} not reported\n{done.explain()}"
        result = done.checks[check]
        assert result.ok, f"{check}: {result.message}\n{done.explain()}"
        return result

    def assert_passed_without_abort(self, name, check):
        """`assert_passed`, after asserting that process `name` ended by itself (exit 0
        or 1), not by a signal or an abort."""
        done = self.completed(name)
        assert done.returncode in (0, 1), (
            f"{name}: the process ended with {done.returncode} (aborted?)\n{done.explain()}")
        return self.assert_passed(name, check)

    def stop(self):
        """Drops the queue and kills the processes still running (their tests did not
        run to the end)."""
        with self._lock:
            self._queue.clear()
            for name, (popen, out, err) in self._started.items():
                if popen.poll() is None:
                    popen.kill()
                popen.wait()
                if name not in self._done:
                    out.close()
                    err.close()


def _wait(popen):
    """Waits for `popen` up to TIMEOUT_SECONDS, then kills it; returns the exit code."""
    try:
        return popen.wait(timeout=TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
        popen.kill()
        return popen.wait()


def _parse(name, returncode, stdout, stderr):
    """A `Completed` from a finished process's output."""
    checks = {}
    for line in stdout.splitlines():
        if line.startswith(_PREFIX):
            record = json.loads(line[len(_PREFIX):])
            checks[record["name"]] = CheckResult(record["ok"], record["message"],
                                                 record["output"])
    return Completed(name, returncode, stdout, stderr, checks)


def _lower_priority():
    """Runs in the child before it starts: a nicer scheduling priority."""
    os.nice(10)


def run_checks(checks, title):
    """Runs each check; prints one `pertower-check` line each and a summary.

    Args:
      checks: a list of functions without arguments; a check fails by raising, and may
        return a string (reported as its output). The name reported is the function's
        `__name__`.
      title: the summary's words, e.g. "legacy checks".

    Returns:
      The exit code: 0 if every check passed, else 1.
    """
    failed = 0
    for check in checks:
        start = time.perf_counter()
        try:
            output = check()
            record = {"name": check.__name__, "ok": True, "message": "",
                      "output": output if isinstance(output, str) else ""}
        except Exception as error:  # pylint: disable=broad-except  # report all, then fail
            failed += 1
            record = {"name": check.__name__, "ok": False,
                      "message": f"{type(error).__name__}: {error}", "output": ""}
        record["seconds"] = round(time.perf_counter() - start, 2)
        print(_PREFIX + json.dumps(record), flush=True)
    print(f"{title}: {len(checks) - failed} passed, {failed} failed", flush=True)
    return 1 if failed else 0


def free_ports(n):
    """n ports the OS reports free on 127.0.0.1 (bound together, then released), for the
    scripts that start tf.distribute.Servers."""
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports

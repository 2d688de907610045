"""The runner of tests/process_checks.py: starts the processes of a test session in the
background, each once, and reads their reports (`Runner`, `Completed`, `CheckResult`).

A process's script prints one line per check, `CHECK_PREFIX` and a JSON record
(`process_checks.run_checks`); a group of processes run in one interpreter frames each
member's output with the lines of `section_lines`.
"""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

__all__ = ["Runner", "Completed", "CheckResult", "CHECK_PREFIX", "TIMEOUT_SECONDS",
           "section_lines", "claim_member"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECK_PREFIX = "pertower-check "
# A process that has not ended by then is taken as hung and killed. Generous: the
# background processes run at a lower priority, and on a shared, loaded machine the
# legacy process alone took over 600 s (its checks 40-60 s each instead of a few).
TIMEOUT_SECONDS = 1800
_SECTION_START, _SECTION_END = "pertower-process-start ", "pertower-process-end "
# what a group's run reads to claim its members (`claim_member`)
_DIRECTORY_ENV, _RUN_ENV = "PERTOWER_PROCESS_DIRECTORY", "PERTOWER_PROCESS_RUN"


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


class Runner:
    """The processes of one test session, each run at most once.

    `start` queues a process; a background thread runs the queue one process at a time
    (the test process keeps one core, the queue the other). `completed` waits for a
    process, starting it at once if nobody has started it yet and no run of its shared
    group that this object started is still going to reach it. Queued members of one
    of `groups` run together in one interpreter.

    Each run writes its output to files RUN.out and RUN.err in `directory` and its exit
    code to RUN.rc when it has ended. Several test processes (pytest-xdist's workers)
    share one directory: each queues the same processes, and a claim file (NAME.claim,
    created exclusively when a process starts, holding the name of its RUN) makes sure
    that each runs once, in whichever test process starts it first; the others read
    its files.

    Args:
      commands: name -> how to start it (an object with `argv`, the arguments after the
        Python executable; `legacy_keras_env`, True to set TF_USE_LEGACY_KERAS=1, False
        to remove it; `one_thread`, True for one TensorFlow thread; optionally
        `environment`, (name, value) pairs to set, for a group's whole run, and
        `fresh`, True for a member that must run first in its group's run, in a fresh
        interpreter).
      groups: tuples of names that may run together, through `group_script`.
      group_script: the script that runs the names of a group given as its arguments
        (tests/scripts/process_group.py).
      directory: the directory for the output files, shared by the test processes of one
        session; None for a private temporary one (removed by `stop`).
      shared: the groups (of `groups`) that two runs may share out, each started by one
        of the test processes sharing `directory` (worth a second start-up only for
        long groups); the members of another group run in the run that claims the
        first of them.
    """

    def __init__(self, commands, groups=(), group_script=None, directory=None, shared=()):
        self._commands = dict(commands)
        self._groups = {name: group for group in groups for name in group}
        self._shared = set(shared)
        self._group_script = group_script
        self._private = directory is None
        self._directory = tempfile.mkdtemp(prefix="pertower-processes-") if directory is None \
            else directory
        self._lock = threading.Lock()
        self._queue = []       # names to start, in order
        self._started = {}     # run name -> Popen, for the runs this object started
        self._done = {}        # name -> Completed
        self._timeouts = {}    # run name -> seconds before it is taken as hung
        self._shared_runs = {}   # run name -> its members, for the runs of a shared group
        self._thread = None

    def _path(self, name, suffix):
        return os.path.join(self._directory, f"{name}.{suffix}")

    def _fresh(self, name):
        return getattr(self._commands[name], "fresh", False)

    def _check_name(self, name):
        if name not in self._commands:
            raise KeyError(f"unknown process {name!r}; known: {sorted(self._commands)}")

    def start(self, *names):
        """Queues the processes `names` to run in the background, in this order (each
        once per session; the members of a group queued together run together)."""
        for name in names:
            self._check_name(name)
        with self._lock:
            for name in names:
                if name not in self._queue and not os.path.exists(self._path(name, "claim")):
                    self._queue.append(name)
            if self._queue and self._thread is None:
                self._thread = threading.Thread(target=self._run_queue, daemon=True,
                                                name="process_checks")
                self._thread.start()

    def _run_queue(self):
        while True:
            with self._lock:
                if not self._queue:
                    self._thread = None
                    return
                run, popen = self._launch(self._queue[0])
            if popen is not None:
                self._finish(run, popen)

    def _claim(self, name, run=None):
        """True if this object may run process `name`: nobody has claimed it before in
        this directory. The claim names `run` if given (else the run writes it later)."""
        try:
            descriptor = os.open(self._path(name, "claim"),
                                 os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        with os.fdopen(descriptor, "w") as f:
            f.write(run or "")
        return True

    def _launch(self, name):
        """Starts process `name` if nobody has, with the queued members of its group
        (call with the lock held); takes them off the queue. Returns (run name, Popen),
        or (None, None) if other test processes started them all.

        The run claims its first member here; a group's run claims each other member
        when it reaches it (`claim_member`) and skips those claimed meanwhile by
        another run. So two test processes that queue the same `shared` group both
        start a run of it, and the two runs share its members out as they go, side by
        side on the two cores, until none is left."""
        group = self._groups.get(name, (name,))
        # `name` first, then the queued members in the queue's order; but the fresh
        # ones before all, in the group's order
        names = [name] + [n for n in self._queue if n in group and n != name]
        for n in names:
            if n in self._queue:
                self._queue.remove(n)
        names.sort(key=lambda n: group.index(n) if self._fresh(n) else len(group))
        if group in self._shared:   # two runs share its members out
            run = next((n for n in names if self._claim(n)), None)
        else:   # another run that has its first member runs the others too
            run = names[0] if self._claim(names[0]) else None
        if run is None:
            return None, None
        with open(self._path(run, "claim"), "w") as f:   # the name of the run's files
            f.write(run)
        if group in self._shared:   # each run claims the next member when it gets there
            names = [run] + [n for n in names[names.index(run) + 1:]
                             if not os.path.exists(self._path(n, "claim"))]
        else:   # claimed now: a test process that reads one of them waits for this run
            names = [run] + [n for n in names[1:] if self._claim(n, run)]
        command = self._commands[run]
        argv = command.argv if names == [run] else (self._group_script, *names)
        # a group runs on one thread only if each of its members may
        one_thread = all(self._commands[n].one_thread for n in names)
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env[_DIRECTORY_ENV], env[_RUN_ENV] = self._directory, run   # for claim_member
        if command.legacy_keras_env:
            env["TF_USE_LEGACY_KERAS"] = "1"
        else:
            env.pop("TF_USE_LEGACY_KERAS", None)
        for n in names:   # each member's own settings, for the whole run
            env.update(getattr(self._commands[n], "environment", ()))
        # In the background of the test process: one TensorFlow thread each and a lower
        # scheduling priority, so that they use the core the test process's Python
        # leaves idle instead of slowing it down (their results are not timed).
        if one_thread:   # (TensorFlow's oneDNN convolutions crash on one thread)
            env.setdefault("TF_NUM_INTRAOP_THREADS", "1")
            env.setdefault("TF_NUM_INTEROP_THREADS", "1")
        # Files, not pipes: nobody reads while the process runs, and a full pipe blocks.
        with open(self._path(run, "out"), "w") as out, \
                open(self._path(run, "err"), "w") as err:
            popen = subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env,
                                     stdout=out, stderr=err, text=True,
                                     preexec_fn=_lower_priority if os.name == "posix" else None)
        self._started[run] = popen
        self._timeouts[run] = TIMEOUT_SECONDS * len(names)   # each member's own time
        if group in self._shared:
            self._shared_runs[run] = names
        return run, popen

    def _finish(self, run, popen):
        """Waits for `popen` (run `run`) and writes its exit code to RUN.rc."""
        returncode = _wait(popen, self._timeouts[run])
        partial = self._path(run, "rc.partial")
        try:
            with open(partial, "w") as f:
                f.write(str(returncode))
            os.replace(partial, self._path(run, "rc"))
        except FileNotFoundError:
            if os.path.isdir(self._directory):
                raise
            # `stop` killed the run and removed the private directory: its readers
            # had read what they needed (a group's run may outlive its last section)

    def completed(self, name):
        """Waits for process `name` (starting it now if nobody has started it); returns
        its `Completed`."""
        self._check_name(name)
        while True:
            with self._lock:
                if name in self._done:
                    return self._done[name]
                if os.path.exists(self._path(name, "claim")):
                    run, popen = None, None
                    break
                if not self._reaches(name):
                    run, popen = self._launch(name)
                    break
            time.sleep(0.2)   # a run of its shared group will claim it (or end)
        if popen is not None:
            self._finish(run, popen)
        done = self._wait_for(name)
        with self._lock:
            self._done.setdefault(name, done)
            return self._done[name]

    def _reaches(self, name):
        """True if a run of a shared group that this object started is still going and
        will reach member `name` (unless the other run claims it first): `completed`
        waits for it instead of starting `name` alone, which would cost a TensorFlow
        start-up more (call with the lock held)."""
        return any(name in names and self._started[run].poll() is None
                   for run, names in self._shared_runs.items())

    def _read(self, run, suffix):
        with open(self._path(run, suffix)) as f:
            return f.read()

    def _wait_for(self, name):
        """The `Completed` of process `name`, once its run has reported its end (another
        test process may still be running it)."""
        deadline = time.monotonic() + TIMEOUT_SECONDS * len(self._commands) + 60
        run = ""
        while True:
            if not run:
                run = self._read(name, "claim")   # written just after the claim
            if run and os.path.exists(self._path(run, "out")):
                ended = os.path.exists(self._path(run, "rc"))
                stdout = self._read(run, "out")
                if run == name and ended and _SECTION_START + name not in stdout:
                    return _parse(name, int(self._read(run, "rc")), stdout,
                                  self._read(run, "err"))
                section = _section(stdout, name)
                if section is not None or ended:
                    if section is None:   # the group ended before this member did
                        section = (int(self._read(run, "rc")) or 1, stdout[stdout.find(
                            _SECTION_START + name):] if _SECTION_START + name in stdout
                            else "")
                    return _parse(name, section[0], section[1], self._read(run, "err"))
            if time.monotonic() > deadline:
                raise AssertionError(f"process {name!r}: no end in time in "
                                     f"{self._directory}")
            time.sleep(0.2)

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

    def stop(self, wait=False):
        """Drops the queue; then waits for the runs still going if `wait` (other test
        processes sharing the directory may still read them), else kills them (their
        tests did not run to the end). Removes a private directory."""
        with self._lock:
            self._queue.clear()
            thread = self._thread
        if wait and thread is not None:
            thread.join()
        with self._lock:
            for popen in self._started.values():
                if popen.poll() is None:
                    popen.kill()
                popen.wait()
        if self._private:
            shutil.rmtree(self._directory, ignore_errors=True)


def _section(stdout, name):
    """(exit code, output) of member `name` of a group's run, from the run's stdout, or
    None if it has not ended yet."""
    start = stdout.find(_SECTION_START + name + "\n")
    end = stdout.find(_SECTION_END + name + " ", start)
    if start < 0 or end < 0:
        return None
    line_end = stdout.find("\n", end)
    if line_end < 0:
        return None
    code = int(stdout[end + len(_SECTION_END + name + " "):line_end])
    return code, stdout[start:end]


def section_lines(name):
    """The lines that open and close member `name`'s output in a group's run (the end
    line is completed with the member's exit code)."""
    return _SECTION_START + name, _SECTION_END + name


def claim_member(name):
    """For a group's run (tests/scripts/process_group.py), before it runs member `name`:
    True if it may (it claimed `name` in the runner's directory, or the runner claimed
    it for this run, or the run was started by hand, outside a `Runner`); False if
    another run has claimed `name` (it runs or ran there, and its readers read it
    there)."""
    directory, run = os.environ.get(_DIRECTORY_ENV), os.environ.get(_RUN_ENV)
    if not directory or not run or name == run:
        return True   # the runner claimed the run's first member itself
    path = os.path.join(directory, f"{name}.claim")
    try:
        descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        with open(path, encoding="utf-8") as f:
            return f.read() == run   # the runner claimed it for this run
    with os.fdopen(descriptor, "w") as f:
        f.write(run)
    return True


def _wait(popen, timeout):
    """Waits for `popen` up to `timeout` seconds, then kills it; returns the exit code."""
    try:
        return popen.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        popen.kill()
        return popen.wait()


def _parse(name, returncode, stdout, stderr):
    """A `Completed` from a finished process's output."""
    checks = {}
    for line in stdout.splitlines():
        if line.startswith(CHECK_PREFIX):
            record = json.loads(line[len(CHECK_PREFIX):])
            checks[record["name"]] = CheckResult(record["ok"], record["message"],
                                                 record["output"])
    return Completed(name, returncode, stdout, stderr, checks)


def _lower_priority():
    """Runs in the child before it starts: a nicer scheduling priority."""
    os.nice(10)

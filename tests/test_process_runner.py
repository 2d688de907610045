"""tests/process_runner.py, on small scripts without TensorFlow: each process runs once
for the test processes that share a directory (pytest-xdist's workers), a group's
members run in one interpreter and each reads its own section, and a group that ends
early fails the members it did not finish."""

import os
import sys
import time

import pytest

from tests import process_checks
from tests import process_runner

_CHECK = ("import json, sys; print({prefix!r} + json.dumps(dict(name={name!r}, ok={ok}, "
          "message='', output=str(sys.argv[1:]))), flush=True)")

# A group script: runs each member named in its arguments that it can claim, framed by
# section lines; a member "crash" ends the whole process, a member "waits" waits until
# another run has claimed member "d".
# Its checks' output: the number of TensorFlow threads the runner set ("" for none),
# then the value of PERTOWER_TEST_SETTING if set.
_GROUP = '''
import json, os, sys, time
from tests import process_runner
for name in sys.argv[1:]:
    if not process_runner.claim_member(name):
        continue
    start, end = {sections}[name]
    print(start, flush=True)
    while name == "waits" and not os.path.exists(  # until another run claims "d"
            os.path.join(os.environ["PERTOWER_PROCESS_DIRECTORY"], "d.claim")):
        time.sleep(0.05)
    if name == "crash":
        sys.exit(3)
    if name == "slow":
        time.sleep(1.0)
    threads = (os.environ.get("TF_NUM_INTRAOP_THREADS", "")
               + os.environ.get("PERTOWER_TEST_SETTING", ""))
    print({prefix!r} + json.dumps(dict(name="check_" + name, ok=True, message="",
                                       output=threads)))
    print(end, 0 if name != "fails" else 1, flush=True)
'''


def _command(tmp_path, name, ok=True):
    path = tmp_path / f"{name}.py"
    path.write_text(_CHECK.format(prefix=process_runner.CHECK_PREFIX, name=f"check_{name}",
                                  ok=ok))
    return process_checks._Command((str(path), "arg"))  # pylint: disable=protected-access


def _runner(tmp_path, commands, directory, groups=(), shared=()):
    sections = {name: process_runner.section_lines(name) for name in commands}
    group = tmp_path / "group.py"
    group.write_text(_GROUP.format(sections=sections, prefix=process_runner.CHECK_PREFIX))
    return process_runner.Runner(commands, groups=groups, group_script=str(group),
                                 directory=str(directory), shared=shared)


def test_two_runners_sharing_a_directory_run_each_process_once(tmp_path):
    commands = {name: _command(tmp_path, name) for name in ("a", "b", "c")}
    shared = tmp_path / "shared"
    shared.mkdir()
    first, second = (_runner(tmp_path, commands, shared) for _ in range(2))
    for runner in (first, second):
        for name in commands:
            runner.start(name)
    for name in commands:
        result = second.assert_passed(name, f"check_{name}")
        assert result.output == "['arg']"
        assert first.assert_passed(name, f"check_{name}") == result
    first.stop(wait=True)
    second.stop(wait=True)
    runs = sorted(p for p in os.listdir(shared) if p.endswith(".out"))
    assert runs == ["a.out", "b.out", "c.out"]   # one run each, by one of the two


def test_a_failed_check_and_an_unknown_name_are_reported(tmp_path):
    commands = {"bad": _command(tmp_path, "bad", ok=False)}
    runner = _runner(tmp_path, commands, tmp_path)
    with pytest.raises(AssertionError, match=r"(?s)check_bad: .*process 'bad': exit code 0"):
        runner.assert_passed("bad", "check_bad")
    with pytest.raises(AssertionError, match=r"check 'check_other' not reported"):
        runner.assert_passed("bad", "check_other")
    with pytest.raises(KeyError, match=r"unknown process 'nope'; known: \['bad'\]"):
        runner.completed("nope")
    runner.stop()


def test_queued_members_of_a_group_run_in_one_process_each_with_its_section(tmp_path):
    names = ("g1", "fails", "crash", "g2")
    commands = {name: _command(tmp_path, name) for name in names + ("alone",)}
    runner = _runner(tmp_path, commands, tmp_path, groups=(names,))
    runner.start("g1", "fails", "crash", "alone")   # g2 is not queued: not run
    g1 = runner.completed("g1")
    assert (g1.returncode, sorted(g1.checks)) == (0, ["check_g1"])
    fails = runner.completed("fails")
    assert (fails.returncode, sorted(fails.checks)) == (1, ["check_fails"])
    crash = runner.completed("crash")   # the group process ended in its section
    assert crash.returncode == 3 and not crash.checks
    runner.assert_passed("alone", "check_alone")
    assert runner.completed("g2").checks == {"check_g2": process_runner.CheckResult(
        True, "", "['arg']")}   # asked for later: run on its own
    runner.stop()
    assert sorted(p for p in os.listdir(tmp_path) if p.endswith(".out")) == [
        "alone.out", "g1.out", "g2.out"]


def test_every_group_member_is_a_process_that_runs_alone_too():
    for group in process_checks.GROUPS:
        commands = [process_checks.PROCESSES[name] for name in group]
        fresh = [command.fresh for command in commands]
        # the fresh ones first (they run first), each setting Keras up itself
        assert fresh == sorted(fresh, reverse=True), group
        assert not any(c.legacy_keras_env for c in commands if c.fresh), group
        # the others in one environment: one Keras setting
        assert len({c.legacy_keras_env for c in commands if not c.fresh}) <= 1, group
    grouped = [name for group in process_checks.GROUPS for name in group]
    assert len(grouped) == len(set(grouped)), "a process in two groups"
    assert os.path.exists(os.path.join(process_checks.HERE, "scripts", "process_group.py"))
    assert sys.executable


def test_a_group_member_claimed_elsewhere_is_read_from_the_run_that_claimed_it(tmp_path):
    names = ("g1", "g2", "g3")
    commands = {name: _command(tmp_path, name) for name in names}
    first, second = (_runner(tmp_path, commands, tmp_path, groups=(names,)) for _ in range(2))
    first.assert_passed("g2", "check_g2")        # nothing queued: g2 alone
    second.start(*names)                         # g1 and g3 together, g2 not again
    for name in names:
        assert second.assert_passed(name, f"check_{name}").ok
    assert (tmp_path / "g1.claim").read_text() == "g1"
    assert (tmp_path / "g3.claim").read_text() == "g1"
    assert (tmp_path / "g2.claim").read_text() == "g2"
    first.stop()
    second.stop()


def test_a_group_runs_on_one_thread_only_if_each_of_its_members_does(tmp_path, monkeypatch):
    monkeypatch.delenv("TF_NUM_INTRAOP_THREADS", raising=False)
    commands = {name: _command(tmp_path, name) for name in ("o1", "o2", "m1", "m2")}
    for name in ("m1", "m2"):   # one member that needs TensorFlow's default threads
        commands[name] = process_checks._Command(  # pylint: disable=protected-access
            commands[name].argv, one_thread=name != "m2")
    runner = _runner(tmp_path, commands, tmp_path, groups=(("o1", "o2"), ("m1", "m2")))
    runner.start("o1", "o2", "m1", "m2")
    for name, threads in (("o1", "1"), ("o2", "1"), ("m1", ""), ("m2", "")):
        assert runner.assert_passed(name, f"check_{name}").output == threads, name
    runner.stop()


def test_a_members_environment_is_set_for_its_groups_whole_run(tmp_path, monkeypatch):
    monkeypatch.delenv("PERTOWER_TEST_SETTING", raising=False)
    monkeypatch.delenv("TF_NUM_INTRAOP_THREADS", raising=False)
    commands = {name: _command(tmp_path, name) for name in ("e1", "e2", "e3")}
    commands["e2"] = process_checks._Command(  # pylint: disable=protected-access
        commands["e2"].argv, environment=(("PERTOWER_TEST_SETTING", "x"),))
    runner = _runner(tmp_path, commands, tmp_path, groups=(("e1", "e2"),))
    runner.start("e1", "e2")
    for name in ("e1", "e2"):   # e1 runs first, in the run that e2's setting is set for
        assert runner.assert_passed(name, f"check_{name}").output == "1x", name
    assert runner.assert_passed("e3", "check_e3").output == "['arg']"   # alone, unset
    runner.stop()


def test_run_checks_runs_the_heavy_checks_only_with_the_argument_heavy(monkeypatch, capsys):
    def check_fast():
        return "fast"

    def check_long():
        return "long"

    for argv, ran in ((["script.py"], ["check_fast"]), (["script.py", "heavy"], ["check_long"])):
        monkeypatch.setattr(sys, "argv", argv)
        assert process_checks.run_checks([check_fast, check_long], "t", heavy={"check_long"}) == 0
        out = capsys.readouterr().out
        assert [name for name in ("check_fast", "check_long") if f'"{name}"' in out] == ran, out
    with pytest.raises(ValueError, match=r"`heavy` names no check of `checks`: \['check_gone'\]"):
        process_checks.run_checks([check_fast], "t", heavy={"check_gone"})


def test_two_runners_queueing_a_group_share_its_members_out_between_two_runs(tmp_path):
    names = ("waits", "b", "c", "d")
    commands = {name: _command(tmp_path, name) for name in names}
    first, second = (_runner(tmp_path, commands, tmp_path, groups=(names,), shared=(names,))
                     for _ in range(2))
    first.start(*names)    # a run of the group, from "waits"
    second.start(*names)   # another run, from "b" (the first run waits for it)
    for name in names:
        assert first.assert_passed(name, f"check_{name}").ok
        assert second.assert_passed(name, f"check_{name}").ok
    first.stop(wait=True)
    second.stop(wait=True)
    claims = {name: (tmp_path / f"{name}.claim").read_text() for name in names}
    assert claims == {"waits": "waits", "b": "b", "c": "b", "d": "b"}
    out = {run: (tmp_path / f"{run}.out").read_text() for run in ("waits", "b")}
    for name in names:   # each member ran once, in the run that claimed it
        assert [run for run, text in out.items()
                if process_runner.section_lines(name)[0] + "\n" in text] == [claims[name]]


def test_the_queue_starts_the_longest_runs_first_and_shares_the_shared_group_out_last():
    names = list(reversed(process_checks.PROCESSES))
    order = process_checks.queue_order(names)
    assert sorted(order) == sorted(names)
    cost = {name: process_checks.COSTS.get(name, process_checks.DEFAULT_COST)
            for name in names}
    group_of = {name: group for group in process_checks.GROUPS for name in group}
    total = {name: sum(cost[n] for n in group_of.get(name, (name,))) for name in names}
    shared = [name for name in order if group_of.get(name) in process_checks.SHARED_GROUPS]
    assert shared and order[-len(shared):] == shared   # shared out last,
    assert [cost[name] for name in shared] == sorted(cost[name] for name in shared)[::-1]
    alone = order[:-len(shared)]                       # after the longest runs first
    assert [total[name] for name in alone] == sorted(total[name] for name in alone)[::-1]
    for group in process_checks.GROUPS:   # contiguous; a group not shared in the order queued
        where = [order.index(name) for name in group]
        assert max(where) - min(where) == len(group) - 1, group
        if group not in process_checks.SHARED_GROUPS:
            assert [order[i] for i in sorted(where)] == [n for n in names if n in group], group


def test_the_fresh_members_of_a_group_run_first_in_the_groups_order(tmp_path):
    names = ("f1", "f2", "g1", "g2")
    commands = {name: _command(tmp_path, name) for name in names}
    for name in ("f1", "f2"):
        commands[name] = process_checks._Command(  # pylint: disable=protected-access
            commands[name].argv, legacy_keras_env=False, fresh=True)
    runner = _runner(tmp_path, commands, tmp_path, groups=(names,))
    runner.start("g2", "f2", "g1", "f1")
    for name in names:
        assert runner.assert_passed(name, f"check_{name}").ok
    runner.stop()
    out = (tmp_path / "f1.out").read_text()   # one run, from f1, in this order
    starts = [out.index(process_runner.section_lines(name)[0] + "\n") for name in
              ("f1", "f2", "g2", "g1")]
    assert starts == sorted(starts), out
    assert sorted(p for p in os.listdir(tmp_path) if p.endswith(".out")) == ["f1.out"]


def test_a_member_read_before_its_groups_run_reaches_it_waits_for_that_run(tmp_path):
    """The run of a group that is not shared claims its queued members when it starts:
    another test process that reads one of them first waits for that run (it does not
    start a run of its own)."""
    names = ("waits", "b", "d")   # "waits" holds the run until "d" is claimed
    commands = {name: _command(tmp_path, name) for name in names}
    first, second = (_runner(tmp_path, commands, tmp_path, groups=(names,)) for _ in range(2))
    first.start(*names)
    while not (tmp_path / "waits.out").exists():
        time.sleep(0.05)
    assert second.assert_passed("d", "check_d").ok   # read from the first's run
    for name in names:
        assert first.assert_passed(name, f"check_{name}").ok
    first.stop(wait=True)
    second.stop(wait=True)
    assert {name: (tmp_path / f"{name}.claim").read_text() for name in names} == dict.fromkeys(
        names, "waits")
    assert sorted(p for p in os.listdir(tmp_path) if p.endswith(".out")) == ["waits.out"]


def test_a_member_read_before_its_shared_groups_run_reaches_it_waits_for_that_run(tmp_path):
    """A run of a shared group claims each member when it reaches it: a test of the test
    process that started the run, reading a later member first, waits for the run
    (it does not start the member alone, a TensorFlow start-up more)."""
    names = ("slow", "b")   # "slow" holds the run for a second before "b"
    commands = {name: _command(tmp_path, name) for name in names}
    runner = _runner(tmp_path, commands, tmp_path, groups=(names,), shared=(names,))
    runner.start(*names)
    while not (tmp_path / "slow.out").exists():
        time.sleep(0.05)
    assert runner.assert_passed("b", "check_b").ok   # before "slow" ends
    runner.stop(wait=True)
    assert (tmp_path / "b.claim").read_text() == "slow"
    assert sorted(p for p in os.listdir(tmp_path) if p.endswith(".out")) == ["slow.out"]


def test_a_group_not_shared_runs_once_for_two_runners(tmp_path):
    names = ("g1", "g2", "g3")
    commands = {name: _command(tmp_path, name) for name in names}
    first, second = (_runner(tmp_path, commands, tmp_path, groups=(names,)) for _ in range(2))
    first.start(*names)
    second.start(*names)
    for name in names:
        assert second.assert_passed(name, f"check_{name}").ok
    first.stop(wait=True)
    second.stop(wait=True)
    assert {(tmp_path / f"{name}.claim").read_text() for name in names} == {"g1"}
    assert sorted(p for p in os.listdir(tmp_path) if p.endswith(".out")) == ["g1.out"]

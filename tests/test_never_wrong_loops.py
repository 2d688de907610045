"""Loops bounded by a reduction over the batch (issue 17, item 1), against the
one-example loop in both modes, and gradients written in Python downstream of a v1
loop (item 2, row passes: v1 loops only): the checks of tests/scripts/never_wrong_loop_checks.py
run here (TensorFlow 2 behaviour in graph mode: v2 While loops) and in a process of
their own under tf.compat.v1.disable_v2_behavior() (v1 loops), started once per session (tests/process_checks.py).
"""


import pytest

from tests.scripts import never_wrong_loop_checks

HEAVY = never_wrong_loop_checks.HEAVY   # the heavy run's (in both modes)
NAMES = [check.__name__ for check in never_wrong_loop_checks.CHECKS]
LEGACY_NAMES = NAMES + [check.__name__ for check in never_wrong_loop_checks.LEGACY_ONLY_CHECKS]


@pytest.mark.parametrize("check", [
    pytest.param(check, id=check.__name__,
                 marks=(pytest.mark.heavy,) if check.__name__ in HEAVY else ())
    for check in never_wrong_loop_checks.CHECKS])
def test_v2_loops(check):
    assert check() in ("While", "StatelessWhile")


@pytest.mark.process_checks("never_wrong_loops")
@pytest.mark.parametrize("name", [name for name in LEGACY_NAMES if name not in HEAVY])
def test_v1_loops_under_disable_v2_behavior(processes, name):
    processes.assert_passed("never_wrong_loops", name)


@pytest.mark.heavy
@pytest.mark.process_checks("never_wrong_loops_heavy")
@pytest.mark.parametrize("name", sorted(HEAVY))
def test_v1_loops_under_disable_v2_behavior_heavy(processes, name):
    processes.assert_passed("never_wrong_loops_heavy", name)

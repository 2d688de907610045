"""Loops bounded by a reduction over the batch (issue 17, item 1), against the
one-example loop in both modes, and gradients written in Python downstream of a v1
loop (item 2, row passes: v1 loops only): the checks of tests/loop_bound_cases.py run
here (TensorFlow 2 behaviour in graph mode: v2 While loops) and in
tests/legacy/test_loops_bounded_by_the_batch.py under tf.compat.v1.disable_v2_behavior() (v1 loops).
"""

import pytest

from tests import loop_bound_cases as never_wrong_loop_checks

HEAVY = never_wrong_loop_checks.HEAVY   # the heavy run's (in both modes)


@pytest.mark.parametrize("check", [
    pytest.param(check, id=check.__name__,
                 marks=(pytest.mark.heavy,) if check.__name__ in HEAVY else ())
    for check in never_wrong_loop_checks.CHECKS])
def test_v2_loops(check):
    assert check() in ("While", "StatelessWhile")

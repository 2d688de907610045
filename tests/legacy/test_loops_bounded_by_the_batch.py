"""Loops bounded by a reduction over the batch, and gradients written in Python
downstream of a v1 loop (row passes), under tf.compat.v1.disable_v2_behavior() (v1
loops): the checks of tests/loop_bound_cases.py, against the one-example loop."""

import pytest

from tests import loop_bound_cases as loops


@pytest.mark.parametrize("check", [
    pytest.param(check, id=check.__name__[len("check_"):],
                 marks=pytest.mark.heavy if check.__name__ in loops.HEAVY else ())
    for check in loops.CHECKS + loops.LEGACY_ONLY_CHECKS])
def test_v1_loops(check):
    assert check() == "LoopCond"

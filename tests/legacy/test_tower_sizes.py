"""Batch-size values used as shapes, indices, ranges, segment ids or partitions in the
towers (tests/tower_size_cases.py) under tf.compat.v1.disable_v2_behavior(), where the
sizes are `Dimension`s: every kind on the towers, the refusals; method "auto", sparse
rows and norms in the heavy run (the default run checks them in graph mode,
tests/test_tower_sizes.py)."""

import pytest

from tests import tower_size_cases as sizes


@pytest.mark.parametrize("check", [
    pytest.param(check, id=check.__name__[len("check_"):],
                 marks=pytest.mark.heavy if check.__name__ in sizes.HEAVY else ())
    for check in sizes.CHECKS])
def test_size_uses_under_legacy_shapes(check):
    check()

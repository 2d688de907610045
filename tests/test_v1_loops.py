"""TF1 (v1) while loops (Enter/Exit/NextIteration/LoopCond), as built under
tf.compat.v1.disable_v2_behavior() or restored from a meta graph: dynamic_rnn with each
cell, bidirectional_dynamic_rnn, while_loop, map_fn and scan, against the one-example
loop. They run in the shared "legacy" process (tests/scripts/v1_loop_checks.py, called
by tests/scripts/legacy_mode_checks.py), one TensorFlow start-up for every legacy check.
"""

import pytest

from tests.scripts import v1_loop_checks
from tests import process_checks

LEGACY_CHECKS = [check.__name__ for check in v1_loop_checks.CHECKS]


@pytest.mark.parametrize("check", process_checks.legacy_params(LEGACY_CHECKS))
def test_v1_loops_match_oracle(processes, check):
    processes.assert_passed(process_checks.legacy_process(check), check)

"""Proofs through TF1 (v1) loops (issue 17, items 9, 10 and 13): dynamic_rnn's final
state with each cell, tf.compat.v1.map_fn over the batch, and raw_rnn's run-time check,
against the one-example loop. v1 control flow is process-wide, so the checks run in the
shared "legacy" process (tests/scripts/v1_loop_proof_checks.py, called by
tests/scripts/legacy_mode_checks.py).
"""

import pytest

from tests.scripts import v1_loop_proof_checks
from tests import process_checks

PROOF_CHECKS = [check.__name__ for check in v1_loop_proof_checks.CHECKS]


@pytest.mark.parametrize("check", process_checks.legacy_params(PROOF_CHECKS))
def test_v1_loop_proofs_match_oracle(processes, check):
    processes.assert_passed(process_checks.legacy_process(check), check)

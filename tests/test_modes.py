"""Process-wide modes that the main test process cannot switch to: the checks of the
"legacy" (tf.compat.v1.disable_v2_behavior()) and "eager" processes of
tests/process_checks.py, each process started once per session."""

import pytest
from tests import process_checks

LEGACY_CHECKS = ["check_layers_model", "check_v1_cond", "check_keras_model",
                 "check_hand_checkable_case", "check_hand_checkable_case_in_two_placeholders"]
EAGER_CHECKS = ["check_eager_is_on", "check_per_example_gradients_refuses_eager",
                "check_microbatch_gradients_refuses_eager"]


@pytest.mark.parametrize("check", process_checks.legacy_params(LEGACY_CHECKS))
def test_legacy_graphs_under_disable_v2_behavior_match_oracle(processes, check):
    processes.assert_passed(process_checks.legacy_process(check), check)


@pytest.mark.process_checks("eager")
@pytest.mark.parametrize("check", EAGER_CHECKS)
def test_eager_mode_is_refused_with_the_switch_to_use(processes, check):
    processes.assert_passed("eager", check)


@pytest.mark.process_checks("legacy")
@pytest.mark.process_checks("eager")
def test_every_reported_check_is_asserted_by_a_test(processes):
    """A check added to a script needs a test that asserts it (and vice versa: a test's
    check that the script does not report fails in `assert_passed`)."""
    # pylint: disable-next=import-outside-toplevel
    from tests import test_control_flow, test_dp, test_mixing, test_v1_loop_proofs, test_v1_loops
    asserted = {
        "legacy": set(LEGACY_CHECKS) | set(test_control_flow.LEGACY_CHECKS)
                  | set(test_mixing.LEGACY_CHECKS) | set(test_v1_loops.LEGACY_CHECKS)
                  | set(test_v1_loop_proofs.PROOF_CHECKS),
        "eager": set(EAGER_CHECKS) | set(test_dp.EAGER_CHECKS),
    }
    asserted["legacy"] -= process_checks.LEGACY_HEAVY_CHECKS
    for name, checks in asserted.items():
        done = processes.completed(name)
        assert set(done.checks) == checks, done.explain()


@pytest.mark.heavy
@pytest.mark.process_checks("legacy_heavy")
def test_every_long_legacy_check_is_reported(processes):
    """The long legacy checks (process "legacy_heavy") are exactly those listed."""
    done = processes.completed("legacy_heavy")
    assert set(done.checks) == set(process_checks.LEGACY_HEAVY_CHECKS), done.explain()

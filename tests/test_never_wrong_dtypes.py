"""Non-float variables in DPOptimizer's `var_list` (issue 17, item 8): the checks of
tests/scripts/never_wrong_dtype_checks.py, each mode in a process of its own (a dtype
mismatch once aborted the process at `sess.run`)."""

import pytest

NAMES = ["check_dp_optimizer_skips_int64_and_string_variables",
         "check_dp_optimizer_refuses_a_var_list_without_float_variables"]


@pytest.mark.process_checks("never_wrong_dtype_graph")
@pytest.mark.process_checks("never_wrong_dtype_legacy")
@pytest.mark.parametrize("mode", ["graph", "legacy"])
@pytest.mark.parametrize("name", NAMES)
def test_non_float_variables_in_dp_optimizer(processes, mode, name):
    processes.assert_passed_without_abort(f"never_wrong_dtype_{mode}", name)

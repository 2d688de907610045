"""The per-op rules in both shape modes (issue 17, item 7): the checks of
tests/scripts/never_wrong_shape_checks.py, each mode in a process of its own (under
tf.compat.v1.disable_v2_behavior() static shapes are `Dimension` objects)."""

import pytest

NAMES = ["check_conv2d_strided_valid_that_skips_the_last_rows",
         "check_conv2d_same_and_unstrided", "check_depthwise_conv2d_strided_valid",
         "check_dense_bias_and_batch_matmul", "check_embedding_lookup"]


@pytest.mark.process_checks("never_wrong_shape_graph")
@pytest.mark.process_checks("never_wrong_shape_legacy")
@pytest.mark.parametrize("mode", ["graph", "legacy"])
@pytest.mark.parametrize("name", NAMES)
def test_rules_in_both_shape_modes(processes, mode, name):
    done = processes.completed(f"never_wrong_shape_{mode}")
    assert done.returncode in (0, 1), f"{mode}: the process ended with {done.returncode}" \
        f" (aborted?)\n{done.explain()}"
    processes.assert_passed(f"never_wrong_shape_{mode}", name)

"""pertower on TensorFlow's distributed runtime: in-process `tf.distribute.Server`s on
127.0.0.1, in one fresh interpreter (tests/scripts/clusters.py: its servers live until it
ends). Towers placed on the two tasks of a cluster (tests/scripts/distributed_towers.py)
and `pertower.DPSyncReplicasOptimizer` across a parameter server and two workers
(tests/scripts/dp_distributed_checks.py), against the one-example loop. Their heavy
variants run in tests/test_devices.py and tests/test_dp_distributed.py.
"""

import pytest

from tests import common


@pytest.fixture(scope="module")
def out():
    """The output of tests/scripts/clusters.py (which exited 0: every check passed)."""
    return common.run_python("tests/scripts/clusters.py").stdout


def test_towers_on_two_servers_of_a_cluster_match_oracle(out):
    """Two servers, the cluster's devices, the graph's placement, the towers on the two
    tasks against the oracle."""
    for check in ("check_cluster_devices_answer", "check_graph_placement",
                  "check_towers_on_two_tasks_match_oracle"):
        assert f"passed {check}" in out, out


def test_dp_sgd_on_a_cluster_of_a_ps_and_two_workers(out):
    """One step against DPOptimizer and the loop, split mode refused with partial
    aggregation, the noise of each mode against chi-square bounds."""
    for check in ("check_one_step_equals_single_process_and_loop",
                  "check_split_mode_refused_with_partial_aggregation",
                  "check_chief_noise_drawn_once", "check_split_noise_shares_uncorrelated"):
        assert f"passed {check}" in out, out
    assert "7 passed, 0 failed" in out, out

"""Run in a process of its own (servers live until the process ends): DP-FTRL across a
parameter server and two workers (`pertower.DPSyncReplicasOptimizer` around a
`pertower.DPFTRLOptimizer`, tests/scripts/dp_distributed_checks.py's cluster): the
chief's weights after each global step against the single-process DP-FTRL arithmetic
on the union of the workers' batches, with the tree's stream added once per step.

    python tests/scripts/dp_ftrl_cluster.py [legacy]

run by tests/test_dp_ftrl.py (heavy). Prints one line per check and exits 1 if one failed.
"""

import os

import numpy as np

from tests import common
from tests import scripts
from tests.scripts import dp_distributed_checks as cluster   # sets the graph mode

import pertower  # noqa: E402  (after the mode)
import tensorflow as tf  # noqa: E402
from pertower._dp import tree as tree_lib  # noqa: E402

CLIP, SIGMA, MOMENTUM, SEED, STEPS = 1.0, 1.3, 0.9, 21, 5


def check_two_workers_add_the_tree_s_noise_once_per_global_step():
    """Probe (loss_i = <a_i, v>, 3 + 4 examples): v_t = v_(t-1) - η u_t / 7,
    u_t = μ u_(t-1) + (clipped sum of the 7) + σ C r_t, r_t the tree's residual."""
    probe = cluster.Probe()
    before, after, _ = cluster.run_cluster(
        probe, STEPS, CLIP, SIGMA, seed=None, optimizer=lambda: pertower.DPFTRLOptimizer(
            CLIP, SIGMA, cluster.LR, momentum=MOMENTUM, seed=SEED))
    graph = tf.Graph()
    with graph.as_default():
        (released,) = tree_lib.TreeNoise(SEED).add([tf.zeros(before[0].shape)], [1.0])
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            residuals = [sess.run(released) for _ in range(STEPS)]
    clipped = probe.clipped_sum(np.arange(sum(cluster.SIZES)), CLIP)
    v, u = before[0].astype(np.float64), 0.0
    for step, r in enumerate(residuals):
        u = MOMENTUM * u + clipped + SIGMA * CLIP * r
        v = v - cluster.LR * u / sum(cluster.SIZES)
        common.assert_all_close(after[step], [v], rtol=1e-5, atol=1e-5,
                                what=f"global step {step + 1}")
    return f"{STEPS} global steps"


def main():
    code = scripts.run_each([check_two_workers_add_the_tree_s_noise_once_per_global_step])
    os._exit(code)  # pylint: disable=protected-access  # servers cannot stop in-process


if __name__ == "__main__":
    main()

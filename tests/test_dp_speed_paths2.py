"""The DP noise draw's reproducibility across thread pools and its pairs' statistics, and
the bench's draw rows to 0.01 ms (issue 19, item 7)."""

import re

import numpy as np
import pytest
import scipy.stats
import tensorflow as tf

# large enough that TensorFlow shards the Philox op and the elementwise ops over its
# intra-op threads: the draws must not depend on how the work was cut
P = 300_001


@pytest.fixture(scope="module")
def draws_by_config():
    """{(intra, inter): [2h] draws of key [7, 2]} and the draws of key [8, 2] (two threads)."""
    from pertower._dp import noise as noise_lib  # pylint: disable=import-outside-toplevel
    results, other = {}, None
    for intra, inter in [(1, 1), (2, 2), (0, 0)]:
        config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=intra,
                                          inter_op_parallelism_threads=inter)
        with tf.Graph().as_default(), tf.compat.v1.Session(config=config) as sess:
            key = tf.compat.v1.placeholder(tf.int64, [2])
            draws = noise_lib.normal_pairs(P, key)                         # [2h]
            results[(intra, inter)] = sess.run(draws, {key: [7, 2]})
            if intra == 2:
                other = sess.run(draws, {key: [8, 2]})
    return results, other


def test_the_draw_is_the_same_on_one_thread_and_on_a_pool(draws_by_config):
    results, other = draws_by_config
    single = results[(1, 1)]
    assert single.shape == (2 * 150_016,) and single.dtype == np.float32
    for config, draws in results.items():
        np.testing.assert_array_equal(draws, single, err_msg=str(config))
    assert np.mean(other == single) < 1e-3   # another key: other draws


def test_the_draw_s_pairs_are_independent_normals(draws_by_config):
    """The two halves are z0 = r cos(θ), z1 = r sin(θ) of the same pairs: each half is
    N(0, 1), the halves are uncorrelated, and z0² + z1² is χ² with 2 degrees of freedom
    (what a wrong radius or a half paired with the wrong angle would break)."""
    draws = draws_by_config[0][(1, 1)].astype(np.float64)
    z0, z1 = np.split(draws, 2)                                            # [h] each
    for half in (z0, z1):
        assert scipy.stats.kstest(half, "norm").pvalue > 1e-6
    assert abs(np.corrcoef(z0, z1)[0, 1]) < 6 / np.sqrt(z0.size)
    assert abs(np.corrcoef(z0 ** 2, z1 ** 2)[0, 1]) < 6 / np.sqrt(z0.size)
    assert scipy.stats.kstest(z0 ** 2 + z1 ** 2, "chi2", args=(2,)).pvalue > 1e-6


def test_the_bench_prints_the_draw_rows_to_a_hundredth_of_a_millisecond():
    from benchmarks import dp  # pylint: disable=import-outside-toplevel
    rows = [dp.DPEntry("cifar", 8, "plain step", runs_ms=[50.0]),
            dp.DPEntry("cifar", 8, "dp step[auto]", runs_ms=[60.04]),
            dp.DPEntry("cifar", 8, dp.SESSION_OVERHEAD, runs_ms=[0.123]),
            dp.DPEntry("cifar", 8, "noise draw", runs_ms=[0.64, 0.66], faults=[0, 2, 30]),
            dp.DPEntry("cifar", 8, dp.TORCH_NOISE, runs_ms=[0.347])]
    # the columns (model, B, step, faults, cpu ms, ms, x plain) are two or more spaces apart
    lines = [re.split(r"\s{2,}", line.strip())
             for line in dp.format_dp_table(rows).splitlines()[2:]]

    def cells(name):
        found = [line[5:] for line in lines if line[2] == name]
        assert len(found) == 1, lines
        return found[0]
    assert cells("dp step[auto]") == ["60.0", "1.20"]
    assert cells(dp.SESSION_OVERHEAD) == ["0.12", "0.00"]
    assert cells("noise draw") == ["0.65", "0.01"]
    assert cells(dp.TORCH_NOISE) == ["0.35", "0.01"]
    # 60.04 - 50 - 0.65 = 9.39
    assert cells("dp − plain − noise") == ["9.4", "0.19"]
    faults = {line[2]: line[3] for line in lines}
    assert faults["noise draw"] == "2" and faults["plain step"] == "-", lines


def test_the_bench_counts_the_page_faults_of_each_run():
    """`dp._counted` appends the process's minor page faults of each call: touching
    fresh pages of a new mapping faults at least once per page."""
    import mmap  # pylint: disable=import-outside-toplevel
    from benchmarks import dp  # pylint: disable=import-outside-toplevel
    row, pages = dp.DPEntry("mlp", 8, "plain step"), 64

    def touch():
        with mmap.mmap(-1, pages * mmap.PAGESIZE) as memory:
            for page in range(pages):
                memory[page * mmap.PAGESIZE] = 1
    run = dp._counted(touch, row)   # pylint: disable=protected-access
    run()
    run()
    assert len(row.faults) == 2 and min(row.faults) >= pages, row.faults

"""The DP bench's table (issue 19, item 7): the rows' process CPU ms, the margin
"dp − plain − noise" in CPU ms, the two-worker rows' CPU rows, the draw rows to 0.01 ms
and the page faults of each run (no timing thresholds: the checks are the table's
arithmetic and what a run records)."""

import re

import pytest

from benchmarks import dp
from benchmarks import records


def _entry(name, wall, cpu, model="cifar", B=8):
    return dp.DPEntry(model, B, name, runs_ms=[wall], cpu_ms=[cpu])


def test_the_cpu_margin_row_is_dp_minus_plain_minus_noise_of_the_cpu_medians():
    rows = [_entry("plain step", 10.0, 8.0), _entry("dp step[auto]", 16.0, 11.0),
            _entry("noise draw", 1.0, 0.5),
            dp.DPEntry("cifar", 8, "2 workers CPU: plain step", runs_ms=[9.0]),
            dp.DPEntry("cifar", 8, "2 workers CPU: dp step", runs_ms=[12.0])]
    lines = dp.format_dp_table(rows).splitlines()
    assert lines[0].split()[-6:] == ["faults", "cpu", "ms", "ms", "x", "plain"], lines[0]
    wall = [line for line in lines if "dp − plain − noise" in line and "CPU" not in line]
    cpu = [line for line in lines if "dp − plain − noise, CPU" in line]
    # wall: 16 - 10 - 1 = 5 ms, 0.50 of the plain step; CPU: 11 - 8 - 0.5 = 2.5, 0.31
    assert wall[0].split()[-2:] == ["5.0", "0.50"], lines
    assert cpu[0].split()[-3:] == ["2.5", "-", "0.31"], lines
    step = next(line for line in lines if "dp step[auto]" in line)
    assert step.split()[-3:] == ["11.0", "16.0", "1.60"], lines
    ratios = dp.plain_ratios(rows)
    assert ratios[-2:] == pytest.approx([1.0, 12.0 / 9.0])


def test_without_cpu_times_there_is_no_cpu_margin_row():
    rows = [dp.DPEntry("mlp", 8, "plain step", runs_ms=[10.0]),
            dp.DPEntry("mlp", 8, "dp step[auto]", runs_ms=[16.0]),
            dp.DPEntry("mlp", 8, "noise draw", runs_ms=[4.0])]
    lines = dp.format_dp_table(rows).splitlines()
    assert not any("CPU" in line for line in lines), lines
    assert sum("dp − plain − noise" in line for line in lines) == 1, lines


def test_a_counted_run_records_its_cpu_ms_and_faults():
    row = dp.DPEntry("mlp", 8, "plain step")
    work = lambda: sum(i * i for i in range(200_000))  # noqa: E731
    counted = records.counted(work, row)
    counted()
    counted()
    assert len(row.cpu_ms) == 2 and len(row.faults) == 2
    assert all(c > 0 for c in row.cpu_ms) and row.median_cpu_ms == pytest.approx(
        sum(row.cpu_ms) / 2)


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
    """`records.counted` appends the process's minor page faults of each call: touching
    fresh pages of a new mapping faults at least once per page."""
    import mmap  # pylint: disable=import-outside-toplevel
    from benchmarks import dp  # pylint: disable=import-outside-toplevel
    row, pages = dp.DPEntry("mlp", 8, "plain step"), 64

    def touch():
        with mmap.mmap(-1, pages * mmap.PAGESIZE) as memory:
            for page in range(pages):
                memory[page * mmap.PAGESIZE] = 1
    run = records.counted(touch, row)
    run()
    run()
    assert len(row.faults) == 2 and min(row.faults) >= pages, row.faults

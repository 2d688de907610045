"""The DP bench's CPU figures (issue 19, item 7): the rows' process CPU ms, the margin
"dp − plain − noise" in CPU ms, and the two-worker rows' CPU rows (no timing
thresholds: the checks are the table's arithmetic and what a run records)."""

import pytest

from benchmarks import dp


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
    counted = dp._counted(work, row)  # pylint: disable=protected-access
    counted()
    counted()
    assert len(row.cpu_ms) == 2 and len(row.faults) == 2
    assert all(c > 0 for c in row.cpu_ms) and row.median_cpu_ms == pytest.approx(
        sum(row.cpu_ms) / 2)

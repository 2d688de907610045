"""Wall-clock timing and plain-text tables shared by `pertower demo` and the benchmarks
(`python -m benchmarks`)."""

import time

__all__ = ["seconds", "round_robin", "format_table"]


def seconds(run):
    """The wall time of one call of `run()`, in seconds."""
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def round_robin(runs):
    """Times `(run, repeats)` pairs one call of each in turn, so that a change of load
    on the machine hits them alike; returns one list of seconds per pair."""
    times = [[] for _ in runs]
    for r in range(max((repeats for _, repeats in runs), default=0)):
        for k, (run, repeats) in enumerate(runs):
            if r < repeats:
                times[k].append(seconds(run))
    return times


def format_table(header, rows):
    """A plain-text table (no trailing newline), its first column left-aligned, the
    others right-aligned. `rows` are tuples of strings as long as `header`; a shorter
    row (a name and a note) is written as its name, then its other cells."""
    full = [row for row in rows if len(row) == len(header)]
    widths = [max(len(row[i]) for row in [header] + full) for i in range(len(header))]

    def line(cells):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths)))

    text = [line(header), "-" * len(line(header))]
    for row in rows:
        text.append(line(row) if len(row) == len(header)
                    else "  ".join([row[0].ljust(widths[0])] + list(row[1:])))
    return "\n".join(text)

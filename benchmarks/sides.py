"""Every row on both oneDNN settings, and on other checkouts of pertower, side by side.

`python -m benchmarks ...` (unless `--onednn as-is`) measures nothing itself: it runs the
same command with `--onednn as-is --json FILE` in one worker process per column. A column
is one checkout of pertower (`--pertower PATH`, repeatable; default the pertower this
Python imports) on one oneDNN setting ("off": TF_ENABLE_ONEDNN_OPTS=0, "on": =1;
TensorFlow reads it when it is imported, so each setting needs a process of its own).
`--rounds N` runs every column N times, interleaved (round r runs each column once, the
order rotated by r), so that a change in the machine's load falls on every column alike;
a cell is the median over the rounds.

A worker imports the library from its checkout (first on PYTHONPATH) and the bench, the
models and the zoo from this checkout (`benchmarks.ROOT`, see `benchmarks`), so every
column measures the same models; a row that a checkout cannot run (an older API) shows
its error in that column.

The table has one line per row of the workers' tables, keyed (section, model, B, row):

    section     "gradients" (the gradient table), "dp" (--dp, --dp-only), "dp fit"
                (--dp-fit: fit epochs and train_on_batch), "zoo"
                (--models with zoo networks; "build s" rows are seconds, not ms),
                "curvature" (--curvature); each gradient and DP row also as "ROW [cpu
                ms]": the process's CPU ms (all threads), steadier under load
    cell        median ms over the rounds, and in brackets its ratio to the row's
                reference in the same column: the batch gradient (gradients and zoo
                rows), the plain SGD step (DP steps)
    on/off      per checkout, its oneDNN-on cell over its off cell
    vs first    per setting, each further checkout's cell over the first checkout's

`python -m benchmarks.sides FIGURES.json [ROW ...]` prints the table again from the JSON
that `python -m benchmarks --json FIGURES.json` wrote (only the rows whose name contains
one of ROW, when given).
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile

import benchmarks
from benchmarks import dp_fit

__all__ = ["SETTINGS", "CPU", "Column", "columns", "worker_argv", "run", "rows_of", "merge",
           "format_table", "main"]

SETTINGS = {"off": "0", "on": "1"}
# the suffix of a row's process-CPU twin ("plain step [cpu ms]")
CPU = " [cpu ms]"
# driver options: removed from the workers' argv (each takes one value; --env goes to
# the workers' environment)
_DRIVER_OPTIONS = ("--onednn", "--pertower", "--rounds", "--json", "--plot", "--env")


class Column:
    """One worker's setting: a checkout of pertower (None: the one this Python imports),
    a oneDNN setting ("off", "on") and a short label."""

    def __init__(self, checkout, onednn, label):
        self.checkout, self.onednn, self.label = checkout, onednn, label

    def library(self):
        """The folder of the pertower package this column's worker must import."""
        return os.path.join(benchmarks.python_path(self.checkout).split(os.pathsep)[0],
                            "pertower")

    def environment(self, extra):
        """os.environ for this column's worker, with the --env assignments `extra`."""
        env = dict(os.environ)
        env.update(dict(extra or ()))
        env["TF_ENABLE_ONEDNN_OPTS"] = SETTINGS[self.onednn]
        env["PYTHONPATH"] = benchmarks.python_path(self.checkout)
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        return env


def _checkout_label(path):
    """'base@c46c4b0' for a git checkout, the folder's name otherwise."""
    folder = os.path.abspath(path or benchmarks.python_path().split(os.pathsep)[0])
    try:
        commit = subprocess.run(["git", "-C", folder, "rev-parse", "--short=7", "HEAD"],
                                capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", folder, "status", "--porcelain", "--", "pertower"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return os.path.basename(folder)
    return f"{os.path.basename(folder)}@{commit}{'+' if dirty else ''}"


def columns(checkouts, onednn):
    """The columns of `--pertower` paths (or [None]) by oneDNN settings, checkout-major."""
    for path in checkouts or ():
        if not os.path.isfile(os.path.join(path, "pertower", "__init__.py")):
            raise ValueError(f"--pertower {path}: no pertower/__init__.py there; pass the "
                             "root of a checkout of pertower")
    settings = list(SETTINGS) if onednn == "both" else [onednn]
    return [Column(path, setting, f"{_checkout_label(path)} {setting}")
            for path in (checkouts or [None]) for setting in settings]


def worker_argv(argv, json_path, plot_path=None):
    """The command line of a worker: `argv` without the driver's options, then
    `--onednn as-is --json json_path` (and `--plot plot_path`)."""
    out, skip = [], False
    for token in argv:
        if skip:
            skip = False
        elif token in _DRIVER_OPTIONS:
            skip = True
        elif not token.startswith(tuple(o + "=" for o in _DRIVER_OPTIONS)):
            out.append(token)
    out += ["--onednn", "as-is", "--json", json_path]
    return out + (["--plot", plot_path] if plot_path else [])


def _load():
    try:
        with open("/proc/loadavg", encoding="utf-8") as handle:
            return float(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def run(args, report):
    """Runs the workers of `args` (the parsed options; args.argv the command line) in
    rounds, prints their progress and the side-by-side table; returns (exit code, the
    figures as a JSON-ready dict)."""
    cols = columns(args.pertower, args.onednn)
    figures = {"columns": [c.label for c in cols], "rounds": args.rounds,
               "argv": list(args.argv), "env": [list(a) for a in args.env or ()],
               "workers": []}
    code = 0
    with tempfile.TemporaryDirectory(prefix="pertower-bench-") as folder:
        for r in range(args.rounds):
            order = list(range(len(cols)))
            order = order[r % len(cols):] + order[:r % len(cols)]
            for k in order:
                column = cols[k]
                path = os.path.join(folder, f"{r}-{k}.json")
                plot = None
                if args.plot and r == 0:
                    stem, ext = os.path.splitext(args.plot)
                    plot = os.path.abspath(args.plot if len(cols) == 1 else (
                        f"{stem}.{column.label.replace(' ', '-').replace('@', '-')}{ext}"))
                load = _load()
                report(f"--- round {r + 1}/{args.rounds}: {column.label} (load {load})")
                # cwd: a folder without pertower/ in it, since `python -m` puts the
                # current folder first on sys.path, before PYTHONPATH's checkout
                done = subprocess.run(
                    [sys.executable, "-m", "benchmarks"] + worker_argv(args.argv, path, plot),
                    env=column.environment(args.env), cwd=folder,
                    stdout=sys.stderr if args.json == "-" else None, check=False)
                code = max(code, done.returncode)
                worker = {"column": k, "round": r, "load_1min": load,
                          "exit_code": done.returncode}
                if os.path.isfile(path):
                    with open(path, encoding="utf-8") as handle:
                        worker["figures"] = json.load(handle)
                    measured = worker["figures"].get("machine", {}).get("pertower_folder")
                    if os.path.realpath(str(measured)) != os.path.realpath(column.library()):
                        report(f"WARNING: {column.label} measured the pertower of {measured}, "
                               f"not {column.library()}")
                        code = max(code, 1)
                figures["workers"].append(worker)
    rows = merge(cols, figures["workers"])
    figures["rows"] = [{"section": key[0], "model": key[1], "batch_size": key[2],
                        "row": key[3], "cells": cells} for key, cells in rows.items()]
    loads = [w["load_1min"] for w in figures["workers"] if w["load_1min"] is not None]
    report("")
    report(f"side by side: {len(cols)} columns x {args.rounds} rounds, interleaved; "
           f"1-min load at each worker's start: median "
           f"{statistics.median(loads) if loads else 'n/a'}, range "
           f"{min(loads) if loads else 'n/a'}-{max(loads) if loads else 'n/a'}")
    report(f"command: {' '.join(['python -m benchmarks'] + list(args.argv))}"
           + "".join(f" (env {n}={v})" for n, v in args.env or ()))
    report("")
    report(format_table(cols, rows))
    return code, figures


def rows_of(figures):
    """{(section, model, B, row): median ms, or a str saying why there is none} of one
    worker's JSON figures."""
    out = {}
    for e in figures.get("entries", ()):
        key = ("gradients", e["model"], e["batch_size"], e["name"])
        out[key] = e["median_ms"] if e.get("median_ms") is not None else (
            e.get("status") or "n/a")
        if e.get("median_cpu_ms") is not None:
            out[key[:3] + (e["name"] + CPU,)] = e["median_cpu_ms"]
    for d in figures.get("dp_steps", ()):
        out[("dp", d["model"], d["batch_size"], d["step"])] = (
            d["median_ms"] if d.get("median_ms") is not None else "n/a")
        if d.get("median_cpu_ms") is not None:   # the process's CPU ms: steadier under load
            out[("dp", d["model"], d["batch_size"], d["step"] + CPU)] = d["median_cpu_ms"]
    for d in figures.get("dp_fit", ()):   # (--dp-fit: benchmarks.dp_fit)
        key = (dp_fit.SECTION, d["model"], d["batch_size"], d["step"])
        out[key] = d["median_ms"] if d.get("median_ms") is not None else "n/a"
        if d.get("median_cpu_ms") is not None:
            out[key[:3] + (d["step"] + CPU,)] = d["median_cpu_ms"]
    for z in figures.get("zoo", ()):
        if z.get("error"):
            out[("zoo", z["network"], z["batch_size"], "error")] = z["error"][:60]
        for name, ms in (z.get("ms") or {}).items():
            out[("zoo", z["network"], z["batch_size"], name)] = ms if ms is not None else "n/a"
        for name, seconds in (z.get("builds") or {}).items():
            if name in ("median_tf_gradients_s", "median_pertower_s") and seconds is not None:
                short = "tf.gradients" if "tf_" in name else "pertower"
                out[("zoo", z["network"], z["batch_size"], f"build s: {short}")] = seconds
    for c in figures.get("curvature", ()):
        out[("curvature", c["model"], c["batch_size"], c["entry"])] = (
            c["median_ms"] if c.get("median_ms") is not None else "n/a")
    return out


def merge(cols, workers):
    """{key: [cell per column]}: the median over the rounds of each column's value
    (a str when no round measured it), keys in the first order met."""
    values = {}
    for worker in workers:
        for key, value in rows_of(worker.get("figures") or {}).items():
            values.setdefault(key, [[] for _ in cols])[worker["column"]].append(value)
    return {key: [_median_or_note(v) for v in cells] for key, cells in values.items()}


def _median_or_note(values):
    numbers = [v for v in values if isinstance(v, (int, float))]
    if numbers:
        return statistics.median(numbers)
    return values[0] if values else "-"


def _reference(key):
    """The key of the row a row is divided by in its own column, or None."""
    section, model, B, name = key
    if name.endswith(CPU):
        reference = _reference((section, model, B, name[:-len(CPU)]))
        return reference and reference[:3] + (reference[3] + CPU,)
    if name.startswith("build s") or name == "error":
        return None
    if section == dp_fit.SECTION:   # "dp fit epoch σ=0" -> "plain fit epoch"
        base = dp_fit.reference(name)
        return base and (section, model, B, base)
    if "dp step" in name:
        return (section, model, B, name.split("dp step")[0] + "plain step")
    if section == "dp":
        return None if name.endswith("plain step") else (section, model, B, "plain step")
    if section in ("gradients", "zoo", "curvature") and name != "batch gradient":
        return (section, model, B, "batch gradient")
    return None


def _cell(value, reference):
    if not isinstance(value, (int, float)):
        return str(value)
    text = f"{value:.3g}" if value < 1 else f"{value:.1f}"
    if isinstance(reference, (int, float)) and reference > 0:
        text += f" ({value / reference:.2f}x)"
    return text


def _ratio(a, b):
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0:
        return f"{a / b:.2f}"
    return ""


def format_table(cols, rows, only=None):
    """The side-by-side table (markdown) of `merge`'s rows (those whose name contains one
    of the strings `only`, when given; their references stay those of all the rows)."""
    checkouts = list(dict.fromkeys(c.checkout for c in cols))
    settings = list(dict.fromkeys(c.onednn for c in cols))
    index = {(c.checkout, c.onednn): k for k, c in enumerate(cols)}
    header = ["section", "model", "B", "row"] + [c.label for c in cols]
    if len(settings) == 2:
        header += [f"on/off {cols[index[(ck, 'on')]].label.rsplit(' ', 1)[0]}"
                   for ck in checkouts]
    if len(checkouts) > 1:
        header += [f"{cols[index[(ck, s)]].label} / first" for s in settings
                   for ck in checkouts[1:]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for key, cells in rows.items():
        if only and not any(word in key[3] for word in only):
            continue
        ref = rows.get(_reference(key)) if _reference(key) else None
        line = [str(k) for k in key]
        line += [_cell(v, ref[k] if ref else None) for k, v in enumerate(cells)]
        if len(settings) == 2:
            line += [_ratio(cells[index[(ck, "on")]], cells[index[(ck, "off")]])
                     for ck in checkouts]
        if len(checkouts) > 1:
            line += [_ratio(cells[index[(ck, s)]], cells[index[(checkouts[0], s)]])
                     for s in settings for ck in checkouts[1:]]
        lines.append("| " + " | ".join(line) + " |")
    return "\n".join(lines)


class _Saved(Column):
    """A column read back from the JSON (its label only)."""

    def __init__(self, label):
        checkout, onednn = label.rsplit(" ", 1)
        super().__init__(checkout, onednn, label)


def main(argv=None):
    """`python -m benchmarks.sides FIGURES.json [ROW ...]`: the side-by-side table again."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print(__doc__.split("\n\n")[0], file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as handle:
        figures = json.load(handle)
    cols = [_Saved(label) for label in figures["columns"]]
    rows = merge(cols, figures["workers"])
    print(format_table(cols, rows, only=argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

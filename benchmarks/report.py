"""The bench's output: the plain-text table, the JSON figures with their footnotes, and
the plot (median ms and peak MiB against B)."""

import dataclasses

from pertower._api import gradients as gradients_lib
from pertower.tools import timing
from benchmarks import records

__all__ = ["MEMORY_FOOTNOTE", "PEERS_FOOTNOTE", "cell", "format_table", "to_json", "plot"]

# The plot's colors for the peers' rows.
PEER_COLORS = {records.TORCH_VMAP: "tab:red", records.JAX_VMAP: "darkcyan",
               records.TF_PLAIN: "dimgrey", records.PERTOWER_DP: "tab:blue",
               records.OPACUS_HOOKS: "salmon", records.OPACUS_GHOST: "darkred",
               records.JAX_DP: "lime"}

MEMORY_FOOTNOTE = (
    "peak MiB: one sess.run traced with RunOptions(trace_level=FULL_TRACE); its step_stats "
    "are replayed: every buffer allocated in the run is live from its node's start to "
    "its last consumer's end (fetched tensors to the end of the run), plus each running "
    "node's temporaries (memory.peak_bytes); in-place outputs share their input's buffer; "
    "constants, variables and fed inputs are not counted. loop: one example's sess.run "
    "(the B results the loop stacks in numpy are not counted). est MiB: "
    "pertower.estimate_memory for the same call (result, towers' gradients, replayed "
    "activations), computed before any op is built.")


PEERS_FOOTNOTE = (
    "peers: each framework in its own child process per round (rounds alternate the "
    "frameworks), weights copied from the TensorFlow model; ms: median over the rounds' "
    "timed passes. torch vmap(grad) / jax jit(vmap(grad)): per-example gradients against "
    "the loop's; dp step: one DP-SGD step (clip C = median per-example norm, noise "
    "multiplier 1), checked once with noise 0 against the loop's clipped mean; step: tf "
    "plain SGD against the loop's mean gradient. No peak memory is traced for them.")


def cell(value, spec, missing="-"):
    """`value` formatted with `spec`, or `missing` for None."""
    return missing if value is None else format(value, spec)


def _mib(n_bytes):
    """Bytes as MiB with two decimals ("-" for None)."""
    return cell(None if n_bytes is None else n_bytes / 2**20, ".2f")


def _diff_cell(entry):
    """The max|diff| cell: (ref) for the loop, n/c for a row not compared."""
    if entry.name == records.LOOP:
        return "(ref)"
    if entry.max_abs_diff is None:
        return "n/c"
    return cell(entry.max_abs_diff, ".1e") + ("" if entry.agrees else " WRONG")


def format_table(entries):
    """The entries as plain-text tables, one per model and B (a string)."""
    header = ("entry", "ms", "x loop", "x batch", "x outer", "build s", "1st run s",
              "peak MiB", "est MiB", "max|diff|")
    blocks = []
    keys = []
    for e in entries:
        if (e.model, e.batch_size) not in keys:
            keys.append((e.model, e.batch_size))
    for model_name, B in keys:
        P = next(e.parameters for e in entries if (e.model, e.batch_size) == (model_name, B))
        rows = []
        for e in entries:
            if (e.model, e.batch_size) != (model_name, B):
                continue
            if e.status != "ok":
                rows.append((e.name, f"{e.status}: {e.reason}"))
                continue
            rows.append((e.name, cell(e.median_ms, ".2f"), cell(e.ratio_to_loop, ".3f"),
                         cell(e.ratio_to_batch, ".1f"), cell(e.ratio_to_outer, ".2f"),
                         cell(e.build_seconds, ".2f"), cell(e.first_run_seconds, ".2f"),
                         _mib(e.peak_bytes), _mib(e.estimate_bytes), _diff_cell(e)))
        notes = [f"  {e.name} WRONG: largest difference at {e.note}" for e in entries
                 if (e.model, e.batch_size) == (model_name, B) and e.status == "ok"
                 and e.agrees is False and e.note]
        blocks.append(f"{model_name}, B={B}, P={P:,} weights\n"
                      + timing.format_table(header, rows)
                      + "".join("\n" + line for line in notes))
    return "\n\n".join(blocks)


def to_json(entries, machine, settings):
    """The figures as a JSON-ready dict: machine, settings, footnotes and entries
    (with a "peers" note when settings has "peers")."""
    figures = {
        "machine": machine,
        "settings": settings,
        "notes": {
            "ms": "median wall milliseconds of one pass over the batch (loop: B sess.run)",
            "ratios": "ratio_to_X = median_ms / X's median_ms (below 1: faster than X)",
            "peak_bytes": MEMORY_FOOTNOTE,
            "max_abs_diff": "max |result - loop's result|; norms against the norms of the "
                            "loop's gradients, the batch gradient against their sum; "
                            "the memory-write limit and the norms floor are not compared",
            "estimate_bytes": "pertower.estimate_memory(ys, xs, batch_size=B, "
                              "method=m).total_bytes",
            "memory_write_limit": "tf.tile writing B x P float32 (the per-example "
                                  "gradients' bytes) once: the physical floor",
            "norms_floor": "the forward pass and one backward pass to the output of every "
                           "op the rules use, no weight gradient: what any rules-based "
                           "per-example norm costs at least",
            "cpu_speed": "allocator and oneDNN settings of the measuring process (see "
                         "README, CPU speed)",
        },
        "entries": [dataclasses.asdict(e) for e in entries],
    }
    if "peers" in settings:
        figures["notes"]["peers"] = PEERS_FOOTNOTE
    return figures


_FIXED_COLORS = {records.LOOP: "black", records.BATCH: "grey", records.OUTER: "tab:brown",
                 records.HAND_NORMS: "tab:brown", records.VMAP: "tab:purple",
                 records.WRITE_LIMIT: "silver", records.NORMS_FLOOR: "gainsboro"}
_METHOD_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:cyan", "tab:olive",
                  "tab:pink")


def _color(name):
    """One color per reference entry; gradients[m] and norms[m] share method m's color."""
    if name in _FIXED_COLORS:
        return _FIXED_COLORS[name]
    if name in PEER_COLORS:
        return PEER_COLORS[name]
    method = name[name.find("[") + 1:-1]
    methods = list(gradients_lib.METHODS)
    index = methods.index(method) if method in methods else len(methods)
    return _METHOD_COLORS[index % len(_METHOD_COLORS)]


def plot(entries, path):
    """Draws median ms and peak MiB against B, one column per model, into `path`."""
    try:
        import matplotlib  # pylint: disable=import-outside-toplevel
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
    except ImportError as error:
        raise RuntimeError(
            f"python -m benchmarks --plot needs matplotlib ({error}); install it with "
            "`pip install matplotlib` or drop --plot.") from None
    models = list(dict.fromkeys(e.model for e in entries))
    figure, axes = plt.subplots(2, len(models), figsize=(6.5 * len(models), 8.5),
                                squeeze=False)
    for column, model_name in enumerate(models):
        mine = [e for e in entries if e.model == model_name and e.status == "ok"]
        names = list(dict.fromkeys(e.name for e in mine))
        sizes = sorted({e.batch_size for e in mine})
        for row, (attribute, scale, label) in enumerate(
                [("median_ms", 1.0, "median ms per pass"),
                 ("peak_bytes", 2.0 ** -20, "peak MiB of one run")]):
            ax = axes[row][column]
            for name in names:
                points = sorted((e.batch_size, getattr(e, attribute) * scale)
                                for e in mine if e.name == name
                                and getattr(e, attribute) is not None)
                # norms dashed, gradients solid, training steps (peers) dotted
                style = "--" if "norms" in name else ":" if "step" in name else "-"
                # a row that disagrees with the loop keeps its time, marked in the legend
                wrong = any(e.agrees is False for e in mine if e.name == name)
                if points:
                    ax.plot(*zip(*points), style, marker="o", color=_color(name),
                            label=name + (" (WRONG at some B)" if wrong else ""))
            ax.set_xscale("log", base=2)
            ax.set_xticks(sizes)
            ax.set_xticklabels([str(b) for b in sizes])
            ax.minorticks_off()
            ax.set_yscale("log")
            ax.set_xlabel("B (examples)")
            ax.set_ylabel(label)
            ax.set_title(f"{model_name}: {label}")
            ax.grid(True, which="both", alpha=0.3)
            if row == 0:
                ax.legend(fontsize=8)
    figure.suptitle("python -m benchmarks (loop = one sess.run per example; memory of the loop: "
                    "one example)", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)

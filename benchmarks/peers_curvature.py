"""`python -m benchmarks --curvature`: pertower's GGN diagonal and Kronecker factors side by
side with BackPACK's (DiagGGNExact, DiagGGNMC, KFLR, KFAC), each in its own process.

Notation:
    B   examples        K   outputs per example        MC  one sampled column
    diag  the GGN diagonal of the summed loss, one array per weight
    A, G  a kernel's Kronecker factors (`pertower.kfac_factors`; BackPACK's [G, A])

The driver (the bench's TensorFlow process) builds each model ("mlp": MSE, l = sum_k
(f_k - y_k)^2; "cifar": softmax cross-entropy), times on one batch pertower's
`diag_ggn` (exact and one sample), `kfac_factors` (exact: KFLR, one sample: KFAC), the
batch gradient and `per_example_gradients`, and writes a job folder (the
`benchmarks.peers_jobs` layout) with the weights, the batch and pertower's
exact diagonal and factors. Then one child, `python -m
benchmarks.peers_curvature JOB_DIR ...`, started with the peers' Python
(`--peers-python`, or the environment variable PERTOWER_PEERS_PYTHON: torch and
BackPACK live in an environment of their own, since TensorFlow imports torch when it
is installed beside it), imports torch and BackPACK 1.7.1 only, rebuilds each model as
an nn.Sequential with the same weights, losses with reduction="sum" (the convention of
pertower's functions), times the four extensions and the batch gradient, and compares:
    DiagGGNExact  with pertower's exact diagonal, every weight;
    KFLR          Linear kernels: [G, A] with pertower's (G, A); Conv2d kernels: A only
                  (patch order [Cin, kh, kw] moved to TensorFlow's [kh, kw, Cin]): for
                  a convolution BackPACK's G is the GGN of the bias, sum over positions
                  taken before the outer product, where pertower's is KFC's Gamma.
The Monte-Carlo entries are timed only (their values are random).

Importing this module imports neither TensorFlow nor torch.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks import records

__all__ = ["CURVATURE_MODELS", "PYTHON_VARIABLE", "TARGETS", "peers_python",
           "run_curvature", "run_command", "format_rows", "target_rows", "main"]

CURVATURE_MODELS = ("mlp", "cifar")
PYTHON_VARIABLE = "PERTOWER_PEERS_PYTHON"
_LOSSES = {"mlp": "mse", "cifar": "softmax_cross_entropy"}
_TIMEOUT_SECONDS = 1800


def peers_python(option=None):
    """The Python that runs the peers' children: `option`, else $PERTOWER_PEERS_PYTHON,
    else this interpreter."""
    return option or os.environ.get(PYTHON_VARIABLE) or sys.executable


def _logits(model):
    """[B, K]: the network output the model's cost reads ("mlp": the last Dense's
    output; "cifar": the logits of its softmax cross-entropy)."""
    if model.name == "mlp":
        return model.dense_taps[-1][1]
    return model.ys.op.inputs[1] if model.ys.op.inputs[0].dtype.is_integer else (
        model.ys.op.inputs[0])


def _round_robin_ms(sess, entries, feed, repeats):
    """{name: median ms} of `repeats` runs of each entry, taken in turns (one run of
    every entry per round), so that a change of the machine's load during the
    measurement weighs on every entry alike and their ratios stay fair."""
    for fetches in entries.values():
        sess.run(fetches, feed)                                # warm-up
    runs = {name: [] for name in entries}
    for _ in range(repeats):
        for name, fetches in entries.items():
            start = time.perf_counter()
            sess.run(fetches, feed)
            runs[name].append(1e3 * (time.perf_counter() - start))
    return {name: statistics.median(values) for name, values in runs.items()}


def prepare(model_name, B, folder, repeats):
    """Times pertower's entries on `model_name` at B; writes the job folder; returns
    {entry name: median ms}."""
    # pylint: disable=import-outside-toplevel
    import numpy as np
    import tensorflow as tf
    import pertower
    from benchmarks import models
    # pylint: enable=import-outside-toplevel

    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(B)
    with tf.Graph().as_default() as graph, tf.compat.v1.Session(graph=graph) as sess:
        tf.compat.v1.set_random_seed(B)
        model = models.build(model_name, B, rng)
        logits, loss = _logits(model), _LOSSES[model_name]
        weights = model.weights
        kernels = [k for k, w in enumerate(weights) if w.shape.rank >= 2]
        entries = {
            "tf batch gradient": tf.gradients(tf.reduce_sum(model.ys), weights),
            "pertower per_example_gradients": pertower.per_example_gradients(
                model.ys, weights, batch_size=B),
            "pertower diag_ggn exact": pertower.diag_ggn(logits, weights, loss=loss),
            "pertower diag_ggn mc=1": pertower.diag_ggn(logits, weights, loss=loss,
                                                        mc_samples=1),
            "pertower kfac_factors exact (KFLR)": [
                pertower.kfac_factors(logits, [weights[k] for k in kernels], loss=loss)],
            "pertower kfac_factors mc=1 (KFAC)": [
                pertower.kfac_factors(logits, [weights[k] for k in kernels], loss=loss,
                                      mc_samples=1)],
        }
        sess.run(tf.compat.v1.global_variables_initializer())
        feed = model.feed
        times = _round_robin_ms(sess, entries, feed, repeats)
        values, diag, kfac = sess.run((weights, entries["pertower diag_ggn exact"],
                                       entries["pertower kfac_factors exact (KFLR)"][0]),
                                      feed)
        x_in, t_in = models.split_feed(feed)
    np.save(os.path.join(folder, "x.npy"), feed[x_in])
    np.save(os.path.join(folder, "t.npy"), feed[t_in])
    for k, (w, d) in enumerate(zip(values, diag)):
        np.save(os.path.join(folder, f"w{k}.npy"), w)
        np.save(os.path.join(folder, f"diag{k}.npy"), d)
    for k, factors in zip(kernels, kfac):
        np.save(os.path.join(folder, f"A{k}.npy"), factors.A)
        np.save(os.path.join(folder, f"G{k}.npy"), factors.G)
    meta = {"model": model_name, "batch_size": B, "lr": 0.0, "clip": 0.0,
            "noise_multiplier": 0.0, "shapes": [list(w.shape) for w in values],
            "kernels": kernels, "loss": loss}
    with open(os.path.join(folder, "meta.json"), "w", encoding="utf-8") as handle:
        json.dump(meta, handle)
    return times


# The BackPACK child (torch and BackPACK only) ----------------------------------------


def _backpack_model(torch, job):
    """The job's model as an nn.Sequential BackPACK can extend, TF's weights loaded."""
    from benchmarks import peers_torch  # pylint: disable=import-outside-toplevel
    nn = torch.nn
    shapes = [tuple(s) for s in job.meta["shapes"]]
    if job.model == "mlp":
        layers = []
        for kernel in shapes[::2]:
            layers += [nn.Linear(*kernel), nn.ReLU()]
        layers = layers[:-1]
    else:   # cifar: conv relu avgpool, conv relu avgpool, conv relu, global mean, dense
        c = [s for s in shapes[::2]]
        layers = [nn.Conv2d(c[0][2], c[0][3], 3, padding=1), nn.ReLU(), nn.AvgPool2d(2),
                  nn.Conv2d(c[1][2], c[1][3], 3, padding=1), nn.ReLU(), nn.AvgPool2d(2),
                  nn.Conv2d(c[2][2], c[2][3], 3, padding=1), nn.ReLU(), nn.AvgPool2d(8),
                  nn.Flatten(), nn.Linear(*c[3])]
    net = nn.Sequential(*layers)
    with torch.no_grad():
        for p, value in zip(net.parameters(), job.weights):
            p.copy_(torch.from_numpy(peers_torch._to_torch_layout(value)))  # pylint: disable=protected-access
    return net


def _to_tf(array):
    """A torch-layout weight-shaped array in TensorFlow's layout."""
    if array.ndim == 2:
        return array.T
    if array.ndim == 4:
        return array.transpose(2, 3, 1, 0)
    return array


def _backpack_job(torch, backpack, job, repeats):
    """{entry: (median ms, max |diff|, max |pertower|, note)} of BackPACK on one job."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    ext = backpack.extensions
    net = backpack.extend(_backpack_model(torch, job))
    x = torch.from_numpy(job.x if job.x.ndim == 2 else job.x.transpose(0, 3, 1, 2).copy())
    if job.meta["loss"] == "mse":
        criterion, target = torch.nn.MSELoss(reduction="sum"), torch.from_numpy(job.t)
    else:
        criterion = torch.nn.CrossEntropyLoss(reduction="sum")
        target = torch.from_numpy(job.t.astype(np.int64))
    criterion = backpack.extend(criterion)
    params = list(net.parameters())
    folder = job.folder

    def run(extension=None):
        net.zero_grad()
        loss = criterion(net(x), target)
        if extension is None:
            loss.backward()
        else:
            with backpack.backpack(extension):
                loss.backward()

    def timed(extension):
        run(extension)
        runs = []
        for _ in range(repeats):
            start = time.perf_counter()
            run(extension)
            runs.append(1e3 * (time.perf_counter() - start))
        return statistics.median(runs)

    rows = {"torch batch gradient": (timed(None), None, None, "")}
    ms = timed(ext.DiagGGNExact())
    got = [_to_tf(p.diag_ggn_exact.detach().numpy()) for p in params]
    want = [np.load(os.path.join(folder, f"diag{k}.npy")) for k in range(len(params))]
    rows["backpack DiagGGNExact"] = (ms, max(float(np.abs(g - w).max()) for g, w in
                                             zip(got, want)),
                                     max(float(np.abs(w).max()) for w in want),
                                     "vs pertower diag_ggn exact, every weight")
    rows["backpack DiagGGNMC"] = (timed(ext.DiagGGNMC()), None, None, "timed only")
    ms = timed(ext.KFLR())
    diffs, scale = [], 0.0
    for k in job.meta["kernels"]:
        G_bp, A_bp = (f.detach().numpy() for f in params[k].kflr)
        A = np.load(os.path.join(folder, f"A{k}.npy"))
        if A_bp.shape != A.shape:
            raise ValueError(f"weight {k}: BackPACK's A {A_bp.shape}, pertower's {A.shape}")
        if params[k].ndim == 4:          # [Cin, kh, kw] patch order -> [kh, kw, Cin]
            c_in, kh, kw = params[k].shape[1:]
            order = np.arange(c_in * kh * kw).reshape(c_in, kh, kw).transpose(1, 2, 0).ravel()
            pairs = [(A_bp[np.ix_(order, order)], A)]
        else:
            pairs = [(A_bp, A), (G_bp, np.load(os.path.join(folder, f"G{k}.npy")))]
        diffs += [float(np.abs(g - w).max()) for g, w in pairs]
        scale = max([scale] + [float(np.abs(w).max()) for _, w in pairs])
    rows["backpack KFLR"] = (ms, max(diffs), scale, "vs pertower kfac_factors: Linear A "
                                                    "and G, Conv2d A")
    rows["backpack KFAC"] = (timed(ext.KFAC()), None, None, "timed only")
    return rows


def main(argv=None):
    """The child: `python -m benchmarks.peers_curvature [--repeats R] JOB ...`;
    prints one JSON object {"versions", "jobs": {folder: {entry: [ms, diff, scale,
    note]}}}."""
    argv = list(sys.argv[1:] if argv is None else argv)
    repeats = 3
    if argv[:1] == ["--repeats"]:
        repeats, argv = int(argv[1]), argv[2:]
    import torch  # pylint: disable=import-outside-toplevel
    import backpack  # pylint: disable=import-outside-toplevel
    from importlib import metadata  # pylint: disable=import-outside-toplevel
    from benchmarks import peers_jobs  # pylint: disable=import-outside-toplevel
    torch.set_float32_matmul_precision("highest")
    stdout, sys.stdout = sys.stdout, sys.stderr
    try:
        results = {folder: _backpack_job(torch, backpack, peers_jobs.Job(folder), repeats)
                   for folder in argv}
    finally:
        sys.stdout = stdout
    versions = {"torch": torch.__version__,
                "backpack": metadata.version("backpack-for-pytorch"),
                "torch_threads": torch.get_num_threads()}
    json.dump({"versions": versions, "jobs": results}, sys.stdout)
    sys.stdout.write("\n")
    return 0


# The driver -----------------------------------------------------------------------------


def run_curvature(keys, repeats, report=print, python=None):
    """Times pertower's and BackPACK's curvature on each (model, B) of `keys`.

    Returns:
      (rows, versions): rows (model, B, entry, median ms, max |diff| or None, max
      |pertower| or None, note); the child's versions, or {"missing": why}.
    """
    # pylint: disable=import-outside-toplevel
    from benchmarks import peers as tool_peers
    # pylint: enable=import-outside-toplevel
    folder = tempfile.mkdtemp(prefix="pertower-curvature-")
    rows, jobs = [], []
    for model_name, B in keys:
        report(f"{model_name} B={B}: pertower's curvature ...")
        job = os.path.join(folder, f"{model_name}-{B}")
        for name, ms in prepare(model_name, B, job, repeats).items():
            rows.append((model_name, B, name, ms, None, None, ""))
        jobs.append((model_name, B, job))
    python = peers_python(python)
    report(f"BackPACK child: {python}")
    command = [python, "-m", "benchmarks.peers_curvature", "--repeats",
               str(repeats)] + [job for _, _, job in jobs]
    done = subprocess.run(command, env=tool_peers._child_env(),  # pylint: disable=protected-access
                          capture_output=True, text=True, timeout=_TIMEOUT_SECONDS,
                          check=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return rows, {"missing": f"the BackPACK child exited with {done.returncode}: "
                                 f"{tail}"[:300]}
    result = json.loads(lines[-1])
    for model_name, B, job in jobs:
        for name, (ms, diff, scale, note) in result["jobs"][job].items():
            rows.append((model_name, B, name, ms, diff, scale, note))
    return rows, result["versions"]


def run_command(args, report):
    """`python -m benchmarks --curvature` with parsed `args`: pertower's and BackPACK's
    rows, printed; returns (the figures, the exit code: 1 when a checked value
    disagrees or BackPACK is missing)."""
    models = [m for m in (args.models or CURVATURE_MODELS) if m in CURVATURE_MODELS]
    sizes = args.batch_sizes or [32]
    repeats = args.repeats or 3
    rows, versions = run_curvature([(m, B) for m in models for B in sizes], repeats, report,
                                   args.peers_python)
    report(format_rows(rows))
    report(f"BackPACK child: {versions}")
    report(f"ms: median of {repeats} runs (TensorFlow's entries taken in turns); x batch: "
           "divided by TensorFlow's batch gradient (tf.gradients of the summed loss) in "
           "the same process.")
    figures = {"curvature": [dict(zip(("model", "batch_size", "entry", "median_ms",
                                        "max_abs_diff", "max_abs_reference", "note"), row))
                             for row in rows], "versions": versions,
               "targets": target_rows(rows)}
    bad = [f"{m} B={B} {name}" for m, B, name, _, diff, scale, _ in rows
           if diff is not None and not records.agrees(diff, scale)]
    if bad or "missing" in versions:
        report(f"FAILED: {'; '.join(bad) or versions.get('missing')}")
        return figures, 1
    return figures, 0


def format_rows(rows):
    """The table: per model and B, each entry's ms, x the TensorFlow batch gradient and
    max |diff| against pertower's value."""
    lines = [f"{'model':6s} {'B':>4s}  {'entry':36s} {'ms':>9s} {'x batch':>8s} "
             f"{'max|diff|':>10s} {'max|ref|':>9s}  note"]
    batch_ms = {(m, B): ms for m, B, name, ms, *_ in rows if name == "tf batch gradient"}
    for model_name, B, name, ms, diff, scale, note in rows:
        ratio = ms / batch_ms[model_name, B] if batch_ms.get((model_name, B)) else None
        lines.append(f"{model_name:6s} {B:4d}  {name:36s} {ms:9.2f} "
                     f"{'' if ratio is None else f'{ratio:.2f}':>8s} "
                     f"{'' if diff is None else f'{diff:.1e}':>10s} "
                     f"{'' if scale is None else f'{scale:.1e}':>9s}  {note}")
    return "\n".join(lines + target_rows(rows))


# (what, numerator entry, denominator entry, bound): issue 18's targets, each a ratio of
# two entries' ms in the same run (bound None: shown only)
TARGETS = (
    ("exact diag_ggn / batch gradient", "pertower diag_ggn exact", "tf batch gradient", 10.0),
    ("mc=1 diag_ggn / per-example gradients", "pertower diag_ggn mc=1",
     "pertower per_example_gradients", 1.5),
    ("exact diag_ggn / BackPACK DiagGGNExact", "pertower diag_ggn exact",
     "backpack DiagGGNExact", 1.0),
    ("mc=1 diag_ggn / BackPACK DiagGGNMC", "pertower diag_ggn mc=1", "backpack DiagGGNMC",
     1.0),
    ("BackPACK DiagGGNExact / torch batch gradient", "backpack DiagGGNExact",
     "torch batch gradient", None),
)


def target_rows(rows):
    """One line per model, B and target: the ratio of the two entries' ms and whether it
    is within the bound ("met" / "NOT met"); targets with a missing entry are left out."""
    ms = {(m, B, name): value for m, B, name, value, *_ in rows}
    lines = []
    for model_name, B in dict.fromkeys((m, B) for m, B, *_ in rows):
        for what, top, bottom, bound in TARGETS:
            if (model_name, B, top) not in ms or not ms.get((model_name, B, bottom)):
                continue
            ratio = ms[model_name, B, top] / ms[model_name, B, bottom]
            verdict = ("" if bound is None else
                       f"  (target <= {bound:g}: {'met' if ratio <= bound else 'NOT met'})")
            lines.append(f"target {model_name:6s} {B:4d}  {what:46s} {ratio:7.2f}{verdict}")
    return lines


if __name__ == "__main__":
    sys.exit(main())

"""A peers' job folder, loaded, and one entry measured on it: what every child process
of `python -m benchmarks --peers` shares (numpy only).

Notation:
    B   examples        C   clip norm       σ   noise multiplier     lr  learning rate
    g_i the gradient of example i's loss over all weights; n_i = ||g_i||_2
    clipped mean = (1/B) sum_i g_i * min(1, C / n_i)

A job folder (written by `benchmarks.peers.prepare_job`):
    meta.json     {"model", "batch_size", "lr", "clip", "noise_multiplier", "shapes"}
    x.npy, t.npy  the batch (t: float targets [B, 1], or int labels [B] for "cifar")
    w{k}.npy      weight k, TensorFlow layout, model order (kernel, bias per layer)
    g{k}.npy      the loop's per-example gradients of weight k, [B, *w_k.shape]
    mean{k}.npy   their mean over B (what a plain SGD step applies)
    clipped{k}.npy  their clipped mean (what a DP-SGD step with σ = 0 applies)
"""

import json
import os
import time

import numpy as np

from benchmarks import compare as compare_lib
from benchmarks import records

__all__ = ["Job", "measure"]


class Job:
    """One job folder, loaded: meta, batch, weights; references opened on demand."""

    def __init__(self, folder):
        self.folder = folder
        with open(os.path.join(folder, "meta.json"), encoding="utf-8") as handle:
            self.meta = json.load(handle)
        self.model = self.meta["model"]
        self.B = self.meta["batch_size"]
        self.lr = self.meta["lr"]
        self.clip = self.meta["clip"]
        self.sigma = self.meta["noise_multiplier"]
        self.x = np.load(os.path.join(folder, "x.npy"))
        self.t = np.load(os.path.join(folder, "t.npy"))
        self.weights = [np.load(os.path.join(folder, f"w{k}.npy"))
                        for k in range(len(self.meta["shapes"]))]

    def reference(self, computes):
        """The loop's arrays an entry computing `computes` is compared with (memory-mapped:
        the per-example gradients can be large)."""
        prefix = {"gradients": "g", "step": "mean", "dp step": "clipped"}[computes]
        return [np.load(os.path.join(self.folder, f"{prefix}{k}.npy"), mmap_mode="r")
                for k in range(len(self.weights))]


def measure(job, name, computes, build, check, repeats):
    """Builds an entry (`build()` -> (run, result)): `run()` does one pass and returns
    when it is finished, `result()` returns the values to check, in TensorFlow's layout,
    after the first run. Returns the entry's dict."""
    entry = {"model": job.model, "batch_size": job.B, "name": name, "computes": computes,
             "status": "ok", "reason": "", "runs_ms": []}
    try:
        start = time.perf_counter()
        run, result = build()
        entry["build_seconds"] = time.perf_counter() - start
        start = time.perf_counter()
        run()
        entry["first_run_seconds"] = time.perf_counter() - start
        if check:
            (entry["max_abs_diff"], entry["max_abs_reference"],
             entry["worst"]) = compare_lib.compare(result(), job.reference(computes))
        for r in range(repeats):
            start = time.perf_counter()
            run()
            entry["runs_ms"].append(1e3 * (time.perf_counter() - start))
            if check and r == 0 and computes == "gradients":
                # the same inputs again: a different max |diff| shows a result that
                # changes from run to run (a DP step's check holds its first result)
                entry["max_abs_diff_rerun"] = compare_lib.compare(
                    result(), job.reference(computes))[0]
    except Exception as error:  # pylint: disable=broad-except
        entry["status"], entry["reason"] = "error", records.short_error(error)
    return entry

"""The child process of `python -m benchmarks --peers`: one framework, one round.

    python -m benchmarks.peers_worker --framework {tf,torch,jax} --repeats R
        [--check] JOB_DIR [JOB_DIR ...]

imports only its framework (TensorFlow and pertower for "tf", PyTorch and Opacus for
"torch", JAX for "jax"), builds each job's model with the weights the driver
(`benchmarks.peers`) exported from the TensorFlow model, and prints one JSON
object on stdout: {"framework", "versions", "entries": [...]}. With --check it first
compares each entry's result with the references in the job folder (the loop's
per-example gradients, their mean, their clipped mean).

The job folders and the measuring are `benchmarks.peers_jobs`; the PyTorch
and JAX entries are `peers_torch` and `peers_jax` (each imports its framework when it
runs); the TensorFlow entries are here.

Notation: that of `benchmarks.peers_jobs` (B examples, C clip norm, σ noise
multiplier, lr learning rate, g_i example i's gradient, n_i = ||g_i||_2).
"""

import argparse
import json
import sys

import numpy as np

from pertower.tools import environment
from benchmarks import models
from benchmarks import peers_jax
from benchmarks import peers_jobs
from benchmarks import peers_torch
from benchmarks import records

__all__ = ["main"]


# TensorFlow: a plain SGD step and pertower's DP-SGD step -------------------------------


def _tf_entries(jobs, check, repeats):
    environment.prepare_tensorflow()
    # TensorFlow's lite utilities import jax when it is installed (`from jax import
    # jit`, ImportError tolerated): keep JAX out of the TensorFlow child
    sys.modules.setdefault("jax", None)
    with environment.quiet_native_logs():
        import tensorflow as tf  # pylint: disable=import-outside-toplevel
    tf.compat.v1.disable_eager_execution()
    import pertower  # pylint: disable=import-outside-toplevel

    versions = {"tensorflow": tf.__version__, "pertower": pertower.__version__}
    entries = []
    for job in jobs:
        with tf.Graph().as_default() as graph, tf.compat.v1.Session(graph=graph) as sess:
            model = models.build(job.model, job.B, np.random.default_rng(0))
            x_in, t_in = models.split_feed(model.feed)
            feed = {x_in: job.x, t_in: job.t}
            ys = model.ys
            loss = (ys if ys.shape.rank == 1 else
                    tf.reduce_sum(ys, axis=list(range(1, ys.shape.rank))))  # [B]
            sgd = tf.compat.v1.train.GradientDescentOptimizer

            def plain():
                mean_grads = tf.gradients(tf.reduce_mean(loss), model.weights)
                step = sgd(job.lr).minimize(tf.reduce_mean(loss), var_list=model.weights)
                return step, mean_grads

            def dp():
                check_grads = [g for g, _ in pertower.DPOptimizer(
                    sgd(job.lr), job.clip, 0.0).compute_gradients(
                        loss, var_list=model.weights, batch_size=job.B)]
                step = pertower.DPOptimizer(sgd(job.lr), job.clip, job.sigma).minimize(
                    loss, var_list=model.weights, batch_size=job.B)
                return step, check_grads

            def builder(make):
                def build():
                    step, check_tensors = make()
                    sess.run(tf.compat.v1.global_variables_initializer())
                    for w, value in zip(model.weights, job.weights):
                        w.load(value, sess)
                    # the check runs before the first step moves the weights
                    values = sess.run(check_tensors, feed) if check else None
                    return (lambda: sess.run(step, feed)), (lambda: values)
                return build

            with environment.quiet_native_logs():
                entries.append(peers_jobs.measure(job, records.TF_PLAIN, "step",
                                                  builder(plain), check, repeats))
                entries.append(peers_jobs.measure(job, records.PERTOWER_DP, "dp step",
                                                  builder(dp), check, repeats))
    return versions, entries


_RUNNERS = {"tf": _tf_entries, "torch": peers_torch.torch_entries, "jax": peers_jax.jax_entries}
_MODULES = {"tensorflow": "tf", "torch": "torch", "jax": "jax"}


def main(argv=None):
    """Runs the jobs for one framework; prints the JSON result on stdout; returns 0."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peers_worker")
    parser.add_argument("--framework", choices=sorted(_RUNNERS), required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--check", action="store_true")
    parser.add_argument("jobs", nargs="+")
    args = parser.parse_args(argv)
    jobs = [peers_jobs.Job(folder) for folder in args.jobs]
    stdout = sys.stdout
    sys.stdout = sys.stderr          # library prints must not corrupt the JSON
    try:
        versions, entries = _RUNNERS[args.framework](jobs, args.check, args.repeats)
    finally:
        sys.stdout = stdout
    # the frameworks this process loaded: its own only
    versions["loaded"] = [name for name in _MODULES if sys.modules.get(name) is not None]
    json.dump({"framework": args.framework, "versions": versions, "entries": entries},
              stdout)
    stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

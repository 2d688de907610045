"""pertower's benchmarks, run from a checkout: every way to get per-example gradients,
side by side, on both oneDNN settings (and, with --pertower, on other checkouts).

    python -m benchmarks [--onednn both|off|on|as-is] [--pertower PATH ...] [--rounds N]
                         [--full] [--dp] [--models M ...] [--batch-sizes B ...] ...
    python -m benchmarks.recurrent ...      the recurrent language model's rows

They import pertower like any user (pip install -e . or PYTHONPATH), as Opacus and
BackPACK keep theirs; `pip install -r benchmarks/requirements.txt` adds what --plot
and --peers use.

Notation:
    B   examples in the batch       P   weights (parameters) of the model
    x   one weight                  [B, *x.shape] one gradient of x per example
    A   a dense layer's input [B, i]    dZ the gradient at its pre-activation [B, j]

For each model and batch size B, one graph and one session hold the model and one
entry per way of computing its per-example gradients (or their norms):

    loop              one `sess.run` of tf.gradients per example (pertower.oracle
                      SliceLoop): the reference every other result is compared with
    batch gradient    tf.gradients(tf.reduce_sum(ys), xs): one backward pass, the floor
    outer products    (MLP) dense kernel gradient of example i = a_i ⊗ dz_i, bias = dz_i,
                      written by hand from one batched tf.gradients w.r.t. the
                      pre-activations (Goodfellow 2015, arXiv 1510.01799): the
                      practical limit
    norms by hand     (MLP) ||grad_i||^2 = sum over layers ||a_i||^2 ||dz_i||^2 + ||dz_i||^2
    vectorized_map    tf.vectorized_map over the per-example losses of a function that
                      calls tf.gradients, as TensorFlow Privacy's vectorized DP
                      optimizers do
    gradients[m]      pertower.per_example_gradients(..., method=m), m in METHODS
    norms[m]          pertower.per_example_norms(..., method=m)
    memory-write limit  tf.tile writing as many bytes as the B per-example gradients
                      (B x P x 4): the physical floor of any method that returns them

The models are those of `benchmarks.models`. Next to each pertower gradients
entry's traced peak, "est MiB" is `pertower.estimate_memory` for the same call. The
machine information includes the CPU facts of `pertower.tools.environment` (allocator
variables, oneDNN, AVX-512), which change these speeds several-fold.

The package, from the command down (each module imports only those below it):

    command       the options and their run (`python -m benchmarks`); imports no
                  TensorFlow until it runs
    sides         the worker processes (one per oneDNN setting and checkout, in
                  rounds) and their rows side by side
    dp            `--dp`: a plain SGD step against pertower.DPOptimizer's step
    runner        every row for one model at one B, timed round robin; `run_bench`
    peers         `--peers`: the same models in PyTorch and JAX, each in its own child
                  process (`peers_worker`, with `peers_torch`, `peers_jax`, `peers_jobs`)
    baselines     the rows written by hand in plain TensorFlow
    machine       the machine's description and the memory budget that skips a row
    traced_memory the peak memory of one traced `sess.run` (its step stats replayed)
    report        the table, the JSON figures and the plot
    compare       a result against the loop's (numpy only)
    records       a row (`Entry`), the rows' names, the tolerance (no TensorFlow, no numpy)
    models, zoo   the networks measured, built by name (TensorFlow imported when building)

Importing this package imports nothing but `pertower.tools` (which imports neither
TensorFlow nor the library): the timing and environment modules of
pertower/tools in this checkout come first on its path, so that with `--pertower PATH`
the library is PATH's and what measures it (with this package's models and zoo) is the
same on every checkout. Import its modules, e.g. `from benchmarks import runner, report`.
"""

import os

import pertower.tools

__all__ = ["ROOT", "python_path"]

# the checkout holding this folder: ROOT/benchmarks/__init__.py
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_TOOLS = os.path.join(ROOT, "pertower", "tools")
if os.path.isdir(_TOOLS) and os.path.realpath(_TOOLS) not in map(os.path.realpath,
                                                                 pertower.tools.__path__):
    pertower.tools.__path__.insert(0, _TOOLS)


def python_path(library=None):
    """PYTHONPATH for a child process: `library` (a checkout holding pertower/; default
    the one this process imports), then ROOT (for `benchmarks`), then os.environ's."""
    library = library or os.path.dirname(os.path.dirname(os.path.abspath(pertower.__file__)))
    given = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join(dict.fromkeys([os.path.abspath(library), ROOT] + given))

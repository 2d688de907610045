"""`pertower bench`: every way to get per-example gradients, side by side, in one process.

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

The models are those of `pertower.tools.models`. Next to each pertower gradients
entry's traced peak, "est MiB" is `pertower.estimate_memory` for the same call. The
machine information includes the CPU facts of `pertower.tools.environment` (allocator
variables, oneDNN, AVX-512), which change these speeds several-fold.

The package, from the command down (each module imports only those below it):

    command       the `bench` options and their run (`pertower bench`,
                  `python -m pertower.tools.bench`); imports no TensorFlow until it runs
    dp            `--dp`: a plain SGD step against pertower.DPOptimizer's step
    runner        every row for one model at one B, timed round robin; `run_bench`
    peers         `--peers`: the same models in PyTorch and JAX, each in its own child
                  process (`peers_worker`, with `peers_torch`, `peers_jax`, `peers_jobs`)
    baselines     the rows written by hand in plain TensorFlow
    machine       the machine's description and the memory budget that skips a row
    report        the table, the JSON figures and the plot
    compare       a result against the loop's (numpy only)
    records       a row (`Entry`), the rows' names, the tolerance (no TensorFlow, no numpy)

Importing this package imports nothing else: import its modules, e.g.
`from pertower.tools.bench import runner, report`.
"""

__all__ = []

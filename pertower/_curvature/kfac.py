"""Kronecker factors of the generalized Gauss-Newton matrix per layer (KFLR, KFAC, KFC).

Notation:
    B   examples in the batch            K   outputs (logits) per example
    M   columns of the loss Hessian's factor S, [M, B, K] (`loss_hessian`)
    R   rows of a layer: B*k for a dense layer read with k rows per example, B*Ho*Wo
        for a convolution (one row per output position); |T| = R/B
    a   one row of the layer's input A: [d_in] (a convolution's patch, kh*kw*Cin)
    dz  the gradient at the layer's output Z of one column m: [d_out]

For a dense layer Z = A W (W [d_in, d_out]) and one example (k = 1), the gradient of
column m is a ⊗ dz_m, so the GGN block of W flattened row-major is exactly

    sum_m (a ⊗ dz_m)(a ⊗ dz_m)^T = (a a^T) ⊗ (sum_m dz_m dz_m^T).

Over a batch the block is sum_n (a_n a_n^T) ⊗ G_n; K-FAC (Martens & Grosse 2015, arXiv
1503.05671) replaces the mean of the products by the product of the means:

    A = (1/B) sum_rows a a^T                       [d_in, d_in]
    G = (B/R) sum_m sum_rows dz_m dz_m^T           [d_out, d_out]
    GGN block of W (of the summed loss sum_n l_n) ≈ kron(A, G),

exact at B = 1 for a dense layer with exact columns (KFLR, Botev, Ritter, Barber 2017,
arXiv 1706.03662); KFAC with Monte-Carlo columns. A convolution is a dense layer on the
patch ([kh, kw, Cin]) at every output position (KFC, Grosse & Martens 2016, arXiv
1602.01407), G with its 1/|T| KFC's Gamma; a dense layer on [B, k, d] likewise, |T| = k
(KFAC-expand, Eschenhagen et al. 2023, arXiv 2311.00636).

Conventions: the loss is the SUM over examples (for a mean loss divide G by B).
BackPACK (1.7.1, `KFLR`, `KFAC`) returns [G, A] for a torch weight [d_out, d_in], with
the same A (its patches ordered [Cin, kh, kw]) and, for a dense layer and
reduction="sum", the same G; for a convolution its G is |T| times KFC's Gamma.
"""

import typing
import warnings

import tensorflow as tf

from pertower import _checks
from pertower import _context
from pertower import _dispatch
from pertower import _plan
from pertower import _request
from pertower._curvature import columns as columns_lib
from pertower._curvature import loss_hessian
from pertower import _engine
from pertower import _loops

__all__ = ["KroneckerFactors", "kfac_factors"]


class KroneckerFactors(typing.NamedTuple):
    """A [d_in, d_in] and G [d_out, d_out]: kron(A, G) approximates the GGN block of the
    kernel flattened row-major as the layer reads it ([d_in, d_out]; [kh, kw, Cin,
    Cout]); kron(G, A) for a kernel stored transposed (MatMul transpose_b=True)."""

    A: tf.Tensor
    G: tf.Tensor


class _Layer(typing.NamedTuple):
    """A covered kernel's input rows [R, d_in] and output Z."""

    rows: tf.Tensor
    output: tf.Tensor


_INSTEAD = "use pertower.diag_ggn for its GGN diagonal"


def _layer_or_reason(uses, reason):
    """An entry of xs (its `uses`, or None and why no rule covers it): a `_Layer` for a
    dense or convolution kernel covered by its rule, else why it gets no factors."""
    if uses is None:
        return f"no rule covers it ({reason}): {_INSTEAD}"
    if not uses:
        return "`logits` does not depend on it"
    if len(uses) > 1:
        names = ", ".join(repr(use.op.name) for use in uses)
        return (f"it is read by {len(uses)} ops ({names}), a shared layer whose GGN block "
                f"has no single Kronecker form: {_INSTEAD}")
    (use,) = uses
    op = use.op
    if isinstance(use, _loops.LoopUse):
        return (f"it is read inside a loop ({use.label}): a weight shared by the steps "
                f"has no single Kronecker form per layer here: {_INSTEAD}")
    rows = use.rule.kfac_rows(use)                          # [R, d_in], or why not
    if rows is not None:
        return rows if isinstance(rows, str) else _Layer(rows, use.output)
    if op.type == "BiasAdd" or use.weight_shape.rank == 1:
        return (f"it is a bias or scale (read by {op.name!r}, {op.type}), not a kernel; "
                f"Kronecker factors are built for dense and Conv2D kernels only: {_INSTEAD}")
    return (f"it is read by {op.name!r} ({op.type}); Kronecker factors are built for the "
            f"kernels of dense (MatMul) and Conv2D layers only: {_INSTEAD}")


@_context.public("kfac_factors")
def kfac_factors(logits, xs, loss="softmax_cross_entropy", mc_samples=None, batch=None,
                 batch_size=None, seed=None, name=None):
    """Kronecker factors (A, G) of the GGN block of each dense or convolution kernel.

    For the summed loss sum_n l(logits_n) and each kernel W a rule covers (dense,
    Conv2D): the GGN block of W ≈ kron(A, G), as in the module docstring (its
    conventions too); the columns from one vectorized backward pass.

    Args:
      logits: [B, K] network outputs that `loss` reads.
      xs: a kernel or a list of weights (e.g. `model.trainable_weights`).
      loss: "softmax_cross_entropy", "sigmoid_cross_entropy" or "mse"
        (l = sum_k (f_k - y_k)^2). The labels are not needed.
      mc_samples: None for the exact columns (M = K; K - 1 for the softmax), or k sampled
        columns.
      batch, batch_size: as in `pertower.per_example_gradients` (the tensors carrying
        the batch; B when the batch axis is None and B is known).
      seed: an int for reproducible sampled columns, or None.
      name: name scope for the new ops (default "kfac_factors").

    Returns:
      A list parallel to `xs`: a `KroneckerFactors(A, G)` per covered kernel, of the
      logits' dtype; None for any other entry (a bias, a weight no rule covers, a
      depthwise or grouped filter, a weight read by several ops), each named with why
      in one UserWarning.

    Example:
      logits = model(x)                                           # [B, 10]
      factors = pertower.kfac_factors(logits, model.trainable_weights)
      A, G = factors[0]                                           # first kernel
      # a preconditioned gradient of W [d_in, d_out]: (A + λI)^-1 dW (G + λI)^-1
    """
    _checks.require_graph_mode()
    loss = loss_hessian.check_loss(loss)
    mc_samples = loss_hessian.check_mc_samples(mc_samples)
    logits = _checks.require_graph_tensor(logits, "logits")
    xs = _checks.as_list(xs)
    request = _request.make_request(
        logits, xs, _request.Examples(batch, batch_size),
        _dispatch.options(validate=False, memory_limit=float("inf"), refuse=False),
        ys_argument="logits")
    plan = _dispatch.make_plan(request)
    found = [_layer_or_reason(u, r) for u, r in zip(plan.uses, plan.reasons)]
    # one warning naming every weight that gets None, with why
    lines = [f"  {_plan.weight_name(x)}: {why}" for x, why in zip(xs, found)
             if isinstance(why, str)]
    if lines:
        warnings.warn(_context.prefixed(
            "no Kronecker factors (None) for these entries of `xs`:\n" + "\n".join(lines)),
            stacklevel=2)
    covered = [k for k, layer in enumerate(found) if isinstance(layer, _Layer)]
    results = [None] * len(xs)
    if not covered:
        return results
    with logits.graph.as_default(), tf.name_scope(name or _context.name()):
        S = loss_hessian.hessian_factor(logits, loss, mc_samples, seed)     # [M, B, K]
        outputs = [found[k].output for k in covered]
        dZ = columns_lib.output_gradient_columns(logits, outputs, S)      # [M, *Z.shape]
        B = _engine.group_count(request, None)
        for k, columns in zip(covered, dZ):
            rows = found[k].rows                                          # [R, d_in]
            d_out = columns.shape[-1]
            dz = tf.reshape(columns, [-1, d_out])                         # [M*R, d_out]
            R = tf.cast(tf.shape(rows)[0], rows.dtype)                    # B * |T|
            B_ = tf.cast(B, rows.dtype)
            # sum over the rows r of r r^T
            A = tf.matmul(rows, rows, transpose_a=True) / B_              # [d_in, d_in]
            G = tf.matmul(dz, dz, transpose_a=True) * (B_ / R)            # [d_out, d_out]
            results[k] = KroneckerFactors(A, G)
    return results

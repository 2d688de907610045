"""The output gradients of M backpropagated columns, from one vectorized backward pass.

Notation:
    B   examples        K   outputs per example        M   columns
    S   [M, B, K] columns (e.g. `loss_hessian.hessian_factor`)
    Z   a tensor the logits depend on (a layer's output), dZ_m its gradient for column m

    dZ[m] = d (sum_n S[m, n] . logits_n) / d Z = tf.gradients(logits, Z, grad_ys=S[m])

The backward pass is linear in grad_ys, so the M passes are one pass over a stacked
column axis: `pfor` (behind `tf.vectorized_map`), else a `tf.while_loop` over m; with
control flow on the path (a loop's gradient cannot be built inside pfor's body), one
tf.gradients per column. The result says which way served and why.
"""

import logging

import tensorflow as tf

from pertower import _context
from pertower import _graph_walk
from pertower import _op_types as op_types
from pertower import _tf

__all__ = ["Columns", "output_gradient_columns"]


class Columns(list):
    """The list of dZ columns, [M, *Z.shape] per entry of `outputs`, and how they were
    computed: `method` "one pass" (one column), "pfor", "per column" or "while loop";
    `vectorized` whether one pass served all columns; `reason` why pfor was not taken
    (None when it served)."""

    def __init__(self, tensors, vectorized, reason=None, method=None):
        super().__init__(tensors)
        self.vectorized = vectorized
        self.reason = reason
        self.method = method or ("pfor" if vectorized else "while loop")


def _control_flow_on_path(logits, outputs):
    """An op between `outputs` and `logits` (along floating tensors) that runs control
    flow (a TF2 loop, conditional or function call, or an op of a TF1 frame), or None."""
    upstream = _graph_walk.upstream_ops([logits])
    seen, stack = set(), list(outputs)
    while stack:
        t = stack.pop()
        if t.op not in upstream or t.ref() in seen:
            continue
        seen.add(t.ref())
        for op in t.consumers():
            if op in upstream and (op.type in op_types.CALL_OP_TYPES or
                                   op.type in op_types.V1_LOOP_OP_TYPES or
                                   _tf.control_flow_context(op) is not None):
                return op
            stack.extend(o for o in op.outputs if o.dtype.base_dtype.is_floating)
    return None


def output_gradient_columns(logits, outputs, S):
    """logits [B, K], tensors Z, S [M, B, K] (not differentiated through) -> a
    `Columns` of [M, *Z.shape] per Z: dZ[m] (zeros for a Z the logits do not reach)."""
    outputs = list(outputs)
    if not outputs:
        return Columns([], True)
    logits = tf.convert_to_tensor(logits)
    S = tf.stop_gradient(tf.convert_to_tensor(S, dtype=logits.dtype))
    if S.shape.rank is not None and S.shape.rank != 3:
        raise _context.error(ValueError, "the columns `S` must be [M, B, K] for logits "
                                         f"[B, K], but received shape {S.shape}.")
    M = S.shape[0] if S.shape[0] is not None else tf.shape(S)[0]

    def loop_fn(m):
        """[*Z.shape] per Z: the gradient of sum(S[m] * logits); zeros where unconnected."""
        grads = tf.gradients(logits, outputs, grad_ys=tf.gather(S, m))
        return [tf.zeros_like(Z) if g is None else tf.convert_to_tensor(g)
                for g, Z in zip(grads, outputs)]

    if isinstance(M, int) and M == 1:   # one column: one backward pass, nothing to vectorize
        return Columns([dZ[None] for dZ in loop_fn(0)], True, method="one pass")
    flow = _control_flow_on_path(logits, outputs)
    if flow is not None and isinstance(M, int):
        # the gradient of a loop or call built inside pfor's (or a while loop's) body
        # cannot reach the forward op's intermediates: one tf.gradients per column
        per_column = [loop_fn(m) for m in range(M)]
        return Columns([tf.stack([c[j] for c in per_column]) for j in range(len(outputs))],
                       False, f"{flow.name!r} ({flow.type}) runs control flow on the "
                              "path: one backward pass per column",
                       "per column")

    logger = tf.get_logger()
    level = logger.level
    logger.setLevel(logging.CRITICAL)   # pfor logs the op it fails on, which is handled here
    try:
        stacked = _tf.pfor(loop_fn, M, fallback_to_while_loop=False)  # per Z: [M, *Z.shape]
        return Columns(list(stacked), True, method="pfor")
    except (ValueError, NotImplementedError, TypeError) as err:   # an op pfor cannot convert
        reason = ("pfor could not vectorize the backward pass "
                  f"({str(err).splitlines()[0]})")
    finally:
        logger.setLevel(level)
    arrays = [tf.TensorArray(Z.dtype, size=M, element_shape=Z.shape) for Z in outputs]

    def body(m, arrays):
        grads = loop_fn(m)
        return m + 1, [a.write(m, g) for a, g in zip(arrays, grads)]

    _, arrays = tf.while_loop(lambda m, _: m < M, body, [tf.constant(0), arrays])
    return Columns([a.stack() for a in arrays], False, reason, "while loop")

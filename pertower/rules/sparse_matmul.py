"""Rule for SparseMatMul: `tf.matmul(a, b, a_is_sparse=..., b_is_sparse=...)` (tf_keras'
LocallyConnected1D/2D with implementation=2 multiply the flattened input by the masked
kernel this way).

Identity: SparseMatMul computes the same product as MatMul (its `a_is_sparse` and
`b_is_sparse` only choose the kernel's algorithm; `transpose_a` and `transpose_b` as in
MatMul), so Z = A W and grad_i(W) = sum_t a_it ⊗ dz_it: `matmul.MatMulRule`, whose ways
read only A, dZ and the transpose attributes. The batch-axis analysis treats it as
MatMul (`_batch_axis.transfer_compute`).
"""

from pertower.rules import matmul

__all__ = ["register"]


def register(registry):
    """Adds the MatMul rule to `registry` for SparseMatMul."""
    registry.register("SparseMatMul", matmul.MatMulRule())

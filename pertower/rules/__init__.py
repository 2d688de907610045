"""Per-op rules for method="rules": one file per op, collected in a `RuleRegistry`.

    registry = pertower.rules.default_registry()       # a new registry each call
    registry.register("MyOp", MyRule())                # add or replace a rule
    pertower.per_example_gradients(ys, xs, rules=registry)

Built-in rules (each file states its identity and reference):
    matmul.py            MatMul
    sparse_matmul.py     SparseMatMul (the same product; LocallyConnected implementation=2)
    batch_matmul.py      BatchMatMul, BatchMatMulV2, BatchMatMulV3
    einsum.py            Einsum
    bias_add.py          BiasAdd
    broadcast.py         a broadcast weight in Add, AddV2, Sub, Mul, RealDiv, Maximum,
                         Minimum, SquaredDifference, Pow, SelectV2, ... (one rule)
    conv2d.py            Conv2D (also Conv1D's lowering; NCHW; a SpaceToBatchND's blocks;
                         groups = channels through the depthwise rule,
                         `pertower/_convolution/views.py`)
    conv2d_transpose.py  Conv2DBackpropInput (transposed convolutions)
    conv3d.py            Conv3D (NDHWC; a SpaceToBatchND's blocks; channel groups),
                         Conv3DBackpropInputV2
    depthwise_conv2d.py  DepthwiseConv2dNative
    gather.py            GatherV2, ResourceGather (embedding lookups)
    partitioned_gather.py  the same on a partitioned table's parts (DynamicPartition ids)
    sparse_segment.py    SparseSegmentSum/Mean/SqrtN of a SparseTensor of the batch's ids
    fused_batch_norm.py  FusedBatchNorm, FusedBatchNormV2, FusedBatchNormV3 (inference)
    function_call.py     PartitionedCall, StatefulPartitionedCall whose body applies one
                         covered op to the weight, its arguments and output possibly
                         re-laid-out (`_call_layouts.py`; tf_keras' jit-compiled grouped
                         Conv1D/2D/3D)

Writing a rule (the names an extension needs are all here): derive from `Rule`, define
`match` (return `Rule.example_use(op, slot, analysis)`, a `Use` whose `rows` are the
activation's `Rows`, or a string saying why not) and `per_group`; define the other
quantities of `Rule` (squared norms, clipped sum, sum of squares, K-FAC rows, row
layouts) where the op has a cheaper form (`batch_gradient_clipped_sum` is one).

A weight read through ops of the weights alone (Cast, Transpose, ConcatV2, tanh, g·v/||v||,
a non-fused batch norm's scale and shift) gets the rule of the op after them, pulled back
through them (`_weight_functions.py`, used by the engine for every rule).
"""

from pertower.rules import batch_matmul
from pertower.rules import bias_add
from pertower.rules import broadcast
from pertower.rules import conv2d
from pertower.rules import conv2d_transpose
from pertower.rules import conv3d
from pertower.rules import depthwise_conv2d
from pertower.rules import einsum
from pertower.rules import function_call
from pertower.rules import fused_batch_norm
from pertower.rules import gather
from pertower.rules import matmul
from pertower.rules import partitioned_gather
from pertower.rules import sparse_matmul
from pertower.rules import sparse_segment
from pertower.rules.registry import FormedNorms
from pertower.rules.registry import Rule
from pertower.rules.registry import RuleRegistry
from pertower.rules.registry import Use
from pertower.rules.registry import batch_gradient_clipped_sum
from pertower._batch_axis import INDEPENDENT
from pertower._batch_axis import Rows
from pertower._batch_axis import SIZE

__all__ = ["Rule", "RuleRegistry", "Use", "default_registry", "FormedNorms", "Rows",
           "INDEPENDENT", "SIZE", "batch_gradient_clipped_sum"]

_BUILT_IN = (matmul, batch_matmul, einsum, bias_add, broadcast, conv2d, conv2d_transpose,
             conv3d, depthwise_conv2d, gather, partitioned_gather, sparse_segment,
             fused_batch_norm, function_call, sparse_matmul)


def default_registry():
    """A new `RuleRegistry` holding every built-in rule."""
    registry = RuleRegistry()
    for module in _BUILT_IN:
        module.register(registry)
    return registry

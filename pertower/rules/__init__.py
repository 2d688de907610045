"""Per-op rules for method="rules": one file per op, collected in a `RuleRegistry`.

    registry = pertower.rules.default_registry()       # a new registry each call
    registry.register("MyOp", MyRule())                # add or replace a rule
    pertower.per_example_gradients(ys, xs, rules=registry)

Built-in rules (each file states its identity and reference):
    matmul.py            MatMul, SparseMatMul, BatchMatMul(V2/V3) with a weight matrix
    einsum.py            Einsum
    bias_add.py          BiasAdd
    broadcast.py         a broadcast weight in Add, Mul, Maximum, Pow, SelectV2, ...,
                         and BroadcastTo to a shape that follows the batch
    conv2d.py            Conv2D (also Conv1D's lowering; NCHW; a SpaceToBatchND's blocks)
    conv2d_transpose.py  Conv2DBackpropInput (transposed convolutions)
    conv3d.py            Conv3D, Conv3DBackpropInputV2
    depthwise_conv2d.py  DepthwiseConv2dNative
    gather.py            GatherV2, ResourceGather (embedding lookups, partitioned tables,
                         the unique ids of a sparse lookup)
    sparse_segment.py    SparseSegmentSum/Mean/SqrtN of a SparseTensor of the batch's ids
    fused_batch_norm.py  FusedBatchNorm(V2/V3) in inference mode
    function_call.py     PartitionedCall, StatefulPartitionedCall whose body applies one
                         covered op to the weight (`_call_layouts.py`)

Writing a rule: derive from `Rule`, define `match` (return `Rule.example_use(op, slot,
analysis)`, a `Use` whose `rows` are the activation's `Rows`, or a string saying why not)
and `per_group`, and the other quantities of `Rule` where the op has a cheaper form.

A weight read through ops of the weights alone (Cast, Transpose, ConcatV2, tanh, g·v/||v||,
a gather of rows every example reads) gets the rule of the op after them, pulled back
through them (`_weight_functions.py`).
"""

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

_BUILT_IN = (matmul, einsum, bias_add, broadcast, conv2d, conv2d_transpose, conv3d,
             depthwise_conv2d, gather, sparse_segment, fused_batch_norm, function_call)


def default_registry():
    """A new `RuleRegistry` holding every built-in rule."""
    registry = RuleRegistry()
    for module in _BUILT_IN:
        module.register(registry)
    return registry

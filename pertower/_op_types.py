"""The catalog of op types: every set of TensorFlow op types the library tells apart,
each named once, here, with what its ops have in common (tables giving each op type its
own meaning live with that meaning). This module imports nothing of pertower.
"""

__all__ = ["BATCH_SOURCE_OP_TYPES", "VARIABLE_READ_OP_TYPES", "HANDLE_GATHER_OP_TYPES",
           "HANDLE_FORWARDING_OP_TYPES", "WHILE_OP_TYPES", "IF_OP_TYPES", "FUNCTION_CALL_OP_TYPES",
           "CALL_OP_TYPES", "V1_ENTER_OP_TYPES", "V1_EXIT_OP_TYPES", "V1_NEXT_ITERATION_OP_TYPES",
           "V1_LOOP_COND_OP_TYPES", "V1_LOOP_OP_TYPES", "V1_SWITCH_OP_TYPES", "V1_MERGE_OP_TYPES",
           "V1_BOUND_PLUMBING_OP_TYPES", "TENSOR_ARRAY_FLOW_OP_TYPES", "FLOW_PASSING_OP_TYPES",
           "TENSOR_ARRAY_OP_TYPES", "PYTHON_OP_TYPES", "GRADIENT_OVERRIDE_ATTR", "RANDOM_OP_TYPES",
           "SHAPE_OP_TYPES", "FIXED_CANDIDATE_SAMPLER_OP_TYPES", "FILL_OP_TYPES",
           "SHAPED_BY_SIZE_OP_TYPES", "ELEMENTWISE_OP_TYPES", "REDUCTION_OP_TYPES", "POOL_OP_TYPES",
           "BATCH_NORM_OP_TYPES", "BATCH_MATMUL_OP_TYPES", "BOUND_ARITHMETIC_OP_TYPES",
           "WEIGHT_LAYOUT_OP_TYPES", "SPACE_TO_BATCH_OP_TYPES", "BATCH_TO_SPACE_OP_TYPES",
           "ROW_WISE_CONVOLUTION_OP_TYPES"]

# -- where the batch and the weights enter --------------------------------------------

# Ops whose outputs carry a batch on axis 0 when `batch` is not given.
BATCH_SOURCE_OP_TYPES = frozenset({
    "Placeholder", "PlaceholderV2", "PlaceholderWithDefault", "IteratorGetNext",
    "IteratorGetNextSync", "OptionalGetValue"})
# Ops that read a resource variable's whole value through its handle.
VARIABLE_READ_OP_TYPES = frozenset({"ReadVariableOp"})
# Ops that read rows of a resource variable through its handle (a tower replays them as
# GatherV2 / GatherNd of its copy).
HANDLE_GATHER_OP_TYPES = frozenset({"ResourceGather", "ResourceGatherNd"})
# Ops that pass a resource handle on unchanged.
HANDLE_FORWARDING_OP_TYPES = frozenset({"Identity", "IdentityN"})

# -- functional (v2) control flow and function calls ------------------------------------

# While loops (tf.while_loop, Keras RNNs under control flow v2): functions cond and body.
WHILE_OP_TYPES = frozenset({"While", "StatelessWhile"})
# Conditionals (tf.cond under control flow v2): functions then_branch and else_branch.
IF_OP_TYPES = frozenset({"If", "StatelessIf"})
# Calls of one function f (tf.function, Keras layers built as functions).
FUNCTION_CALL_OP_TYPES = frozenset({"PartitionedCall", "StatefulPartitionedCall"})
# Every op that runs functions of the graph's library on its inputs.
CALL_OP_TYPES = WHILE_OP_TYPES | IF_OP_TYPES | FUNCTION_CALL_OP_TYPES

# -- TF1 (v1) control flow: loops are frames of ops in the graph ----------------------

# Ops that take a value into a v1 while loop's frame.
V1_ENTER_OP_TYPES = frozenset({"Enter", "RefEnter"})
# Ops that take a value out of a v1 while loop's frame.
V1_EXIT_OP_TYPES = frozenset({"Exit", "RefExit"})
# Ops that hand a v1 loop variable back to the next iteration (the back edge).
V1_NEXT_ITERATION_OP_TYPES = frozenset({"NextIteration", "RefNextIteration"})
# The op that holds a v1 while loop's predicate.
V1_LOOP_COND_OP_TYPES = frozenset({"LoopCond"})
# Ops of v1 while loops: their gradients need the Python-side WhileContext that
# tf.while_loop attached to its ops (which ops added by import_graph_def lack); each
# passes its (first) input on unchanged.
V1_LOOP_OP_TYPES = (V1_ENTER_OP_TYPES | V1_EXIT_OP_TYPES | V1_NEXT_ITERATION_OP_TYPES
                    | V1_LOOP_COND_OP_TYPES)
# v1 conditional ops that send their data to one of two outputs.
V1_SWITCH_OP_TYPES = frozenset({"Switch", "RefSwitch"})
# v1 ops that forward whichever input arrives (a cond's join, a loop's head).
V1_MERGE_OP_TYPES = frozenset({"Merge", "RefMerge"})
# v1 loop ops through which an integer may flow and still only bound a loop.
V1_BOUND_PLUMBING_OP_TYPES = (V1_ENTER_OP_TYPES | V1_EXIT_OP_TYPES
                              | V1_NEXT_ITERATION_OP_TYPES | V1_MERGE_OP_TYPES)
# Ops whose output is a v1 TensorArray's flow (a scalar standing for its elements).
TENSOR_ARRAY_FLOW_OP_TYPES = frozenset({"TensorArrayScatterV3", "TensorArrayWriteV3"})
# Ops that create a v1 TensorArray (its handle and initial flow).
TENSOR_ARRAY_OP_TYPES = frozenset({"TensorArrayV3"})
# Ops that hand a TensorArray flow on (v1 loop and cond plumbing).
FLOW_PASSING_OP_TYPES = (V1_LOOP_OP_TYPES | V1_SWITCH_OP_TYPES | V1_MERGE_OP_TYPES
                         | {"Identity"})

# -- ops with Python code or random draws ------------------------------------------------

# Ops that run a Python function (tf.py_func, tf.numpy_function, tf.py_function): their
# gradient is Python code, and a run is keyed by their `token` attribute.
PYTHON_OP_TYPES = frozenset({"PyFunc", "PyFuncStateless", "EagerPyFunc"})
# The node attribute naming a gradient that overrides an op's registered one
# (gradient_override_map, tf.custom_gradient).
GRADIENT_OVERRIDE_ATTR = "_gradient_op_type"
# Random draws whose first input is the shape of the result (dropout's mask).
RANDOM_OP_TYPES = frozenset({
    "RandomUniform", "RandomStandardNormal", "TruncatedNormal", "RandomUniformInt",
    "StatelessRandomUniform", "StatelessRandomUniformV2", "StatelessRandomNormal",
    "StatelessRandomNormalV2", "StatelessTruncatedNormal", "StatelessTruncatedNormalV2",
    "StatelessRandomUniformInt", "StatelessRandomUniformIntV2"})
# Candidate samplers of a fixed distribution (tf.nn.sampled_softmax_loss, nce_loss): one
# draw of classes per run for the whole batch, read from the true classes' shape only.
# Outputs sampled_candidates [S], true_expected_count [B, num_true] (row i from row i),
# sampled_expected_count [S]. (Not the learned unigram samplers.)
FIXED_CANDIDATE_SAMPLER_OP_TYPES = frozenset({
    "UniformCandidateSampler", "LogUniformCandidateSampler", "FixedUnigramCandidateSampler",
    "AllCandidateSampler"})

# -- shapes and values shaped by them --------------------------------------------------

# Ops whose outputs describe a tensor's shape rather than its values.
SHAPE_OP_TYPES = frozenset({"Shape", "ShapeN", "Size", "Rank", "BroadcastGradientArgs",
                            "TensorListLength", "TensorListElementShape"})
# Ops that fill a tensor of the shape given by their first input with one value.
FILL_OP_TYPES = frozenset({"Fill"})
# Ops whose values are shaped by a shape argument (their layout follows that shape).
SHAPED_BY_SIZE_OP_TYPES = FILL_OP_TYPES | RANDOM_OP_TYPES

# -- computations -------------------------------------------------------------------------

# Ops that compute each output entry from the entries at the same position of their
# inputs (after broadcasting), with no other coupling of positions.
ELEMENTWISE_OP_TYPES = frozenset("""
Abs Acos Acosh Add AddN AddV2 Angle ApproximateEqual Asin Asinh Atan Atan2 Atanh
BesselI0e BesselI1e Betainc BiasAdd BroadcastTo Cast Ceil CheckNumerics ClipByValue
ComplexAbs Conj Cos Cosh DebugIdentity DebugIdentityV2 Digamma Div DivNoNan Elu EluGrad
EnsureShape Equal Erf Erfc Erfinv Exp Expm1 Floor FloorDiv FloorMod Greater
GreaterEqual Identity Igamma Igammac Imag Inv Invert IsFinite IsInf IsNan LeakyRelu
LeakyReluGrad Less LessEqual Lgamma Log Log1p LogicalAnd LogicalNot LogicalOr Maximum
Minimum Mod Mul MulNoNan Ndtri Neg NotEqual PlaceholderWithDefault Polygamma Pow
PreventGradient Real RealDiv Reciprocal ReciprocalGrad Relu Relu6 Relu6Grad ReluGrad
Rint Round Rsqrt RsqrtGrad SelectV2 Selu SeluGrad Sigmoid SigmoidGrad Sign Sin
Sinh Snapshot Softplus SoftplusGrad Softsign SoftsignGrad Sqrt SqrtGrad Square
SquaredDifference StopGradient Sub Tan Tanh TanhGrad TruncateDiv TruncateMod Xdivy
Xlog1py Xlogy Zeta
""".split())
# Losses that pair their inputs row by row: logits and labels must have the same axis 0
# (no broadcasting).
ROW_PAIRED_OP_TYPES = frozenset({"SoftmaxCrossEntropyWithLogits",
                                 "SparseSoftmaxCrossEntropyWithLogits"})
# Reductions over the axes given by their second input (tf.reduce_*).
REDUCTION_OP_TYPES = frozenset({"Sum", "Mean", "Max", "Min", "Prod", "All", "Any",
                                "EuclideanNorm"})
# Pools and local normalizations over spatial windows of each image.
POOL_OP_TYPES = frozenset({"MaxPool", "AvgPool", "MaxPoolV2", "MaxPool3D", "AvgPool3D",
                           "MaxPoolWithArgmax", "LRN"})
# Fused batch normalization (over the batch when training).
BATCH_NORM_OP_TYPES = frozenset({"FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"})
# Ops that move spatial blocks into the batch axis and back (TensorFlow builds a dilated
# convolution without oneDNN as SpaceToBatchND -> convolution -> BatchToSpaceND).
SPACE_TO_BATCH_OP_TYPES = frozenset({"SpaceToBatchND"})
BATCH_TO_SPACE_OP_TYPES = frozenset({"BatchToSpaceND"})
# Convolutions whose output row n is computed from input row n alone (input 0 the data,
# input 1 the filter).
ROW_WISE_CONVOLUTION_OP_TYPES = frozenset({"Conv2D", "DepthwiseConv2dNative", "Conv3D"})
# Batched matrix products (tf.linalg.matmul of rank > 2).
BATCH_MATMUL_OP_TYPES = frozenset({"BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"})
# Integer and boolean ops through which a reduction's result may flow and still only
# size shapes or bound loops.
BOUND_ARITHMETIC_OP_TYPES = frozenset({
    "Identity", "Cast", "Add", "AddV2", "Sub", "Mul", "Maximum", "Minimum", "FloorDiv",
    "FloorMod", "Pack", "ConcatV2", "Range", "ExpandDims", "Reshape", "Squeeze",
    "StridedSlice", "Less", "LessEqual", "Greater", "GreaterEqual", "Equal", "NotEqual",
    "LogicalAnd", "LogicalOr", "LogicalNot"})
# Ops that only re-lay-out a weight's value (same elements, same order) on its way to
# the op that uses it (Conv1D's filter is ExpandDims(W)).
WEIGHT_LAYOUT_OP_TYPES = frozenset({"Identity", "Snapshot", "ExpandDims", "Squeeze",
                                    "Reshape"})

"""Issue 19, item 7: the formed convolution norms' paths (`_convolution.norms`) with a
static group count: the rows built in chunks of whole groups (`chunk_sizes`, split along
the groups), each group's product one MatMul (G <= FEW_GROUPS, oneDNN off) or one
batched matmul per chunk (G > FEW_GROUPS, or oneDNN on), and one chunk (the defaults on a
small model); σ = 0 DP gradients (clipped sums) and the per-example norms against the
one-example loop `pertower.oracle`, on several layer shapes (3x3 SAME, 3x3 stride 2
VALID, 2x3 SAME, and 3x3 on two images per example).
"""

import numpy as np
import pytest
import tensorflow as tf

import pertower
from pertower._convolution import norms as _conv_norms
from pertower.rules import conv2d
from tests import common

B = 4
CLIP = 7.0   # between the model's per-example norms (5.5-9)
# the formed-norm convolutions of the model (the 1x1 one takes the engine's path)
FORMED = 4
# (name, CHUNK_FLOATS, FEW_GROUPS) while the DP step is built: the defaults (one chunk
# here), chunks of 1-2 groups (1800 floats: 4, 2, 2 and 3 chunks of the convolutions)
# with one MatMul per group, and the same chunks with one batched matmul each
# (FEW_GROUPS below G)
VARIANTS = [("defaults", _conv_norms.CHUNK_FLOATS, _conv_norms.FEW_GROUPS),
            ("chunks", 1800, _conv_norms.FEW_GROUPS),
            ("batched_chunks", 1800, 1)]


def _scope_ops(graph, scope, op_type):
    return [op for op in graph.get_operations()
            if op.type == op_type and op.name.startswith(scope + "/")]


@pytest.fixture(scope="module")
def model(request):
    """One graph: a σ = 0 DP step (rules alone, batch_size=B so that G is static) per
    variant of VARIANTS, per-example norms with static B, and the loop's per-example
    gradients."""
    rng = np.random.RandomState(7)
    graph = tf.Graph()
    with graph.as_default():
        x, pairs, ws, loss = common.formed_norm_convs(rng)
        means, scopes = {}, {}
        saved = _conv_norms.CHUNK_FLOATS, _conv_norms.FEW_GROUPS
        try:
            for name, chunk, few in VARIANTS:
                _conv_norms.CHUNK_FLOATS, _conv_norms.FEW_GROUPS = chunk, few
                with tf.name_scope(name) as scope:
                    dp = pertower.DPOptimizer(
                        tf.compat.v1.train.GradientDescentOptimizer(0.1), l2_norm_clip=CLIP,
                        noise_multiplier=0.0, method="rules")
                    means[name] = [gr for gr, _ in dp.compute_gradients(
                        loss, var_list=ws, batch_size=B)]
                scopes[name] = scope.rstrip("/")
            _conv_norms.CHUNK_FLOATS = 1800
            with tf.name_scope("norms") as scope:
                norms = pertower.per_example_norms(loss, ws, batch_size=B, method="rules")
            scopes["norms"] = scope.rstrip("/")
        finally:
            _conv_norms.CHUNK_FLOATS, _conv_norms.FEW_GROUPS = saved
    (got_means, got_norms), per_example = common.run_formed_norm_convs(
        graph, x, pairs, ws, loss, [means, norms], B, rng)
    return dict(graph=graph, scopes=scopes, means=got_means, norms=got_norms,
                per_example=per_example)


def test_chunk_sizes_cover_the_groups_within_the_budget():
    for G, floats in [(64, 288 * 256), (64, 576 * 64), (7, 10), (5, 2 ** 21), (3, 1)]:
        sizes = _conv_norms.chunk_sizes(G, floats)
        assert sum(sizes) == G and min(sizes) >= 1, (G, floats, sizes)
        assert max(sizes) - min(sizes) <= 1, sizes                   # near-equal
        assert max(sizes) == 1 or max(sizes) * floats <= _conv_norms.CHUNK_FLOATS, sizes
        fewer = len(sizes) - 1                                        # would not fit
        assert fewer == 0 or -(-G // fewer) * floats > _conv_norms.CHUNK_FLOATS, sizes
    G = tf.constant(3)
    assert _conv_norms.chunk_sizes(G, 10) == [G]
    assert _conv_norms.chunk_sizes(3, None) == [3]


@pytest.mark.parametrize("name", [v[0] for v in VARIANTS])
def test_formed_norm_paths_clip_as_the_loop(model, name):
    norms, means = common.loop_clipped_mean(model["per_example"], CLIP)
    assert (norms > CLIP).any() and (norms < CLIP).any(), norms       # some clipped
    graph, scope = model["graph"], model["scopes"][name]
    squares = [op for op in _scope_ops(graph, scope, "Sum")     # `_conv_norms.squares_of`
               if op.name.split("/")[-1].startswith("formed_squares")]
    assert len(squares) == FORMED, [op.name for op in squares]
    splits = _scope_ops(graph, scope, "SplitV")
    one_by_one = [op for op in _scope_ops(graph, scope, "MatMul")
                  if op.inputs[0].op.type == "Unpack"]
    batched = _scope_ops(graph, scope, "BatchMatMulV2")
    if name == "defaults":      # one chunk, one MatMul per group
        assert not splits, [op.name for op in splits]
    else:                       # every formed convolution's input and dZ split in chunks
        assert len(splits) == 2 * FORMED, [op.name for op in splits]
    if name == "batched_chunks" or conv2d.onednn_enabled():
        # one batched matmul per chunk (11 chunks; with oneDNN on, always batched)
        least = FORMED if name == "defaults" else 4 + 2 + 2 + 3
        assert not one_by_one and len(batched) >= least, [op.name for op in batched]
    else:
        assert len(one_by_one) == B * FORMED, [op.name for op in one_by_one]
    common.assert_all_close(model["means"][name], means, what=f"{name}: clipped mean",
                            kind="deep")


def test_chunked_per_example_norms_equal_the_loop(model):
    norms, _ = common.loop_clipped_mean(model["per_example"], CLIP)
    assert len(_scope_ops(model["graph"], model["scopes"]["norms"], "SplitV")) == 2 * FORMED
    common.assert_all_close([model["norms"]], [norms], what="norms", kind="deep")

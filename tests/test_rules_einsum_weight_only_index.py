"""The Einsum rule on equations that sum a weight index alone (issue 32, item 5).

A weight index in neither the activation nor the output ("bkj,ij->bk") is summed over W
alone, so the gradient is broadcast along it (pertower/rules/einsum.py): the rules'
per-example gradients, sum of squares, norms and a σ = 0 DP step against the one-example
loop, for that index of size 1 and of size > 1, in the middle or at either end of W.
"""

import numpy as np
import pytest
import tensorflow as tf

import pertower
from pertower import oracle
from tests import cases
from tests import common

B, CLIP = 4, 0.5

# (equation, activation shape without the batch, weight shape)
EQUATIONS = [
    ("bkj,ij->bk", (5, 3), (1, 3)),
    ("bkj,ij->bk", (5, 3), (4, 3)),
    ("btd,die->bte", (5, 3), (3, 2, 4)),
    ("bd,dei->be", (3,), (3, 2, 1)),
    ("bd,idj->b", (3,), (2, 3, 2)),
]


@pytest.fixture(scope="module", params=EQUATIONS, ids=lambda p: f"{p[0]}-{p[2]}")
def model(request):
    """The rules' per-example gradients (batch size from the feed and static), sum of
    squares, norms and σ = 0 DP mean, and the loop's per-example gradients."""
    equation, a_shape, w_shape = request.param
    rng = np.random.RandomState(3)
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(0)
        x = tf.compat.v1.placeholder(tf.float32, [None, *a_shape], name="x")
        w = cases.random_normal_variable(w_shape, "w")
        z = tf.einsum(equation, tf.tanh(x), w)
        loss = tf.reduce_sum(tf.sin(z) * z, axis=list(range(1, z.shape.rank)))     # [B]
        grads = pertower.per_example_gradients(loss, [w], method="rules")
        static = pertower.per_example_gradients(loss, [w], batch_size=B, method="rules")
        squares = pertower.sum_grad_squared(loss, [w], method="rules")
        norms = pertower.per_example_norms(loss, [w], method="rules")
        dp = pertower.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                  l2_norm_clip=CLIP, noise_multiplier=0.0, method="rules")
        means = [g for g, _ in dp.compute_gradients(loss, var_list=[w], batch_size=B)]
        loop = oracle.SliceLoop(loss, [w])
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            feed = {x: rng.randn(B, *a_shape).astype(np.float32)}
            got = sess.run(dict(grads=grads, static=static, squares=squares, norms=norms,
                                  means=means), feed)
            got["loop"] = loop.run(sess, feed, B)                       # [B, *w.shape]
    return got


def test_per_example_gradients_match_the_loop(model):
    common.assert_all_close(model["grads"][0], model["loop"][0], what="per-example grads")
    common.assert_all_close(model["static"][0], model["loop"][0], what="static batch size")
    common.assert_all_close(model["squares"][0], np.sum(model["loop"][0] ** 2, axis=0),
                            what="sum of squared per-example grads")


def test_norms_and_dp_mean_match_the_loop(model):
    norms, means = common.loop_clipped_mean(model["loop"], CLIP)
    common.assert_all_close(model["norms"], norms, what="per-example norms")
    common.assert_all_close(model["means"][0], means[0], what="clipped mean")


def test_an_unsafe_equation_is_still_refused_with_its_reason():
    # a repeated weight index (W's diagonal) is not covered by the identity
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        w = cases.random_normal_variable([3, 3], "w")
        loss = tf.einsum("bj,jj->b", x, w)                               # [B]
        with pytest.raises(ValueError, match="repeats an index within an operand"):
            pertower.per_example_gradients(loss, [w], method="rules")

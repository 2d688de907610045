"""The DP modes of issue 19 and per-weight norms, against the one-example loop
`pertower.oracle` or a stated statistical bound.

Per-weight norms (`per_example_norms(..., per_weight=True)`), Poisson batches and the
empty batch, adaptive clipping (Andrew et al. 2021), per-layer clipping (McMahan et
al. 2018), gradient accumulation over several `sess.run` calls, a batch held in a
`tf.Variable`, and the PLD accountant. The noiseless steps are compared with NumPy
references built on the loop's per-example gradients; the noise with chi-square
bounds on its variance.
"""

import numpy as np
import pytest
import scipy.stats
import tensorflow as tf

import pertower
from pertower import oracle
from tests import cases
from tests import common


def _loop_weight_norms(case):
    """[B, K]: the loop's per-example gradient norm of each weight."""
    ys, _, feed = case.oracle()
    grads = common.run_oracle(oracle.loop_per_example_gradients, case.sess, ys, case.xs,
                              feed)                                   # [B, *x.shape] each
    return np.stack([np.sqrt(np.sum(g.reshape(case.B, -1) ** 2, axis=1)) for g in grads],
                    axis=1)


# rules with a cheap squared norm (dense, conv, embedding), formed ones, and weights
# left to towers (mixed_fallback: k2 and scale; mixing_op: every weight)
# (two fast representatives; the others are heavy)
_PER_WEIGHT_MODELS = ["mlp", "mixed_fallback"] + [
    pytest.param(name, marks=pytest.mark.heavy)
    for name in ("cnn", "embedding", "dense_sequence", "layer_norm", "mixing_op")]


def _build(name):
    if name in cases.BUILDERS:
        return cases.BUILDERS[name]()
    build, shapes, options, _ = cases.RULE_MODELS[name]
    return cases.build_case(name, build, shapes, **options)


@pytest.mark.filterwarnings("ignore:.*could not prove")
@pytest.mark.parametrize("name", _PER_WEIGHT_MODELS)
def test_per_weight_norms_equal_the_loop(name):
    case = _build(name)
    with case.graph.as_default():
        results = {}
        for method in ("auto", "towers"):
            per_weight = pertower.per_example_norms(
                case.ys, case.xs, batch=case.batch, batch_size=case.B, method=method,
                per_weight=True)                                          # [B, K]
            assert per_weight.shape.as_list()[1:] == [len(case.xs)]
            results[method] = (per_weight, pertower.per_example_norms(
                case.ys, case.xs, batch=case.batch, batch_size=case.B, method=method))
        results = case.sess.run(results, case.feed)
        want = _loop_weight_norms(case)
    for method, (got, total) in results.items():
        common.assert_all_close([got], [want], kind="deep",
                                what=f"{name} {method} per-weight norms")
        # the [B] norms are the rows' root sum of squares
        common.assert_all_close([np.sqrt(np.sum(got ** 2, axis=1))], [total], kind="deep",
                                what=f"{name} {method} [B] norms")
    case.sess.close()


def test_per_weight_must_be_a_bool(mlp):
    with mlp.graph.as_default(), pytest.raises(TypeError, match="`per_weight` must be True"):
        pertower.per_example_norms(mlp.ys, mlp.xs, per_weight="yes")

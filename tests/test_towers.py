"""Towers on graphs that compute values from the batch's size.

`ys = (net(x) - y) ** 2 / tf.cast(tf.shape(x)[0], tf.float32)` divides every row by
B, the size of the whole batch. Its per-example gradients are those of the rows of
`ys` as computed on the whole batch (`common.loop_rows_of_batch`): they sum to the
gradient of sum(ys). A tower replays the graph on B/T examples, so it must read B
from the whole batch where B enters a value, and keep its own size where it shapes a
tensor (`tf.reshape(h, [tf.shape(x)[0], -1])`).
"""

import warnings

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import pertower
from pertower import _graph_walk as graph_walk
from pertower import _batch_axis
from tests import common

B, D = 4, 3


class _Model:
    """One small Keras MLP read by three per-example costs, in one graph and session:
    on a static batch [4, 3], on a None batch, and with a reshape by tf.shape."""

    def __init__(self):
        self.graph = tf.Graph()
        with self.graph.as_default():
            common.seed_weights(3)
            self.net = keras.Sequential([keras.layers.Dense(4, activation="tanh"),
                                         keras.layers.Dense(2)])
            self.xs = None
            self.ys, self.feeds = {}, {}
            rng = np.random.RandomState(4)
            x_values = rng.randn(B, D).astype(np.float32)
            y_values = rng.randn(B, 2).astype(np.float32)
            for kind, rows in [("static", B), ("none", None)]:
                x = tf.compat.v1.placeholder(tf.float32, [rows, D], name=f"x_{kind}")
                y = tf.compat.v1.placeholder(tf.float32, [rows, 2], name=f"y_{kind}")
                # [B, 2] / B
                self.ys[kind] = (self.net(x) - y) ** 2 / tf.cast(tf.shape(x)[0], tf.float32)
                self.feeds[kind] = {x: x_values, y: y_values}
                if kind == "none":
                    h = self.net(x) - y                                   # [B, 2]
                    # [B, 2] -> [B, 2] by a shape from the batch; the mean over 2 * B
                    flat = tf.reshape(h ** 2, [tf.shape(x)[0], -1])
                    self.ys["reshape"] = tf.reduce_sum(flat, axis=1) / tf.cast(
                        tf.size(h), tf.float32)                           # [B]
                    self.feeds["reshape"] = self.feeds["none"]
            self.xs = list(self.net.trainable_weights)
            self.sess = tf.compat.v1.Session(graph=self.graph)
            self.sess.run(tf.compat.v1.global_variables_initializer())

    def definition(self, kind):
        """Per-example gradients by definition, and the gradient of sum(ys)."""
        with self.graph.as_default():
            rows = common.loop_rows_of_batch(self.sess, self.ys[kind], self.xs,
                                             self.feeds[kind])
            whole = self.sess.run(tf.gradients(tf.reduce_sum(self.ys[kind]), self.xs),
                                  self.feeds[kind])
        return rows, whole


@pytest.fixture(scope="module")
def model():
    built = _Model()
    yield built
    built.sess.close()


@pytest.mark.parametrize("kind", ["static", "none", "reshape"])
def test_towers_gradients_are_the_rows_of_ys_on_the_whole_batch(model, kind):
    with model.graph.as_default():
        towers = pertower.build_towers(model.ys[kind], model.xs, batch_size=B)
        got, stacked, ys = model.sess.run(
            [towers.gradients(), towers.stacked, model.ys[kind]], model.feeds[kind])
    rows, whole = model.definition(kind)
    np.testing.assert_allclose(stacked, ys, rtol=1e-5, atol=1e-6)
    common.assert_all_close(got, rows, kind="tight", what=f"{kind}: towers vs rows of ys")
    common.assert_all_close([g.sum(axis=0) for g in got], whole, kind="tight",
                            what=f"{kind}: sum of per-example gradients vs batch gradient")


@pytest.mark.parametrize("kind", ["static", "none"])
def test_microbatch_towers_sum_the_rows_of_each_half(model, kind):
    with model.graph.as_default():
        got = pertower.microbatch_gradients(model.ys[kind], model.xs, num_microbatches=2,
                                            batch_size=B, method="towers")
        got = model.sess.run(got, model.feeds[kind])
    rows, _ = model.definition(kind)
    want = [r.reshape((2, B // 2) + r.shape[1:]).sum(axis=1) for r in rows]
    common.assert_all_close(got, want, kind="tight", what=f"{kind}: microbatches vs rows")


@pytest.mark.parametrize("kind", ["static", "none", "reshape"])
def test_check_independence_and_validate_pass_on_size_values(model, kind):
    with model.graph.as_default():
        check = pertower.check_independence(model.ys[kind], batch_size=B)
        validated = pertower.per_example_gradients(model.ys[kind], model.xs, batch_size=B,
                                                   method="towers", validate=True)
        independent, difference, _ = model.sess.run(
            [check.independent, check.max_difference, validated], model.feeds[kind])
    assert independent, f"{kind}: max difference {difference}"


def test_size_data_edges_are_value_uses_not_shape_uses(model):
    """In the reshape cost, B enters a value through the Cast of tf.size and shapes
    the Reshape; only the Cast is a size-data edge."""
    ys = model.ys["reshape"]
    batch = list(model.feeds["reshape"])
    with model.graph.as_default():
        edges = _batch_axis.analyze(ys, batch, graph_walk.upstream_ops([ys])).size_data_edges
    assert [(op.type, i) for op, i in edges] == [("Cast", 0)]
    (cast, _), = edges
    assert cast.inputs[0].op.type == "Size"
    assert not any(op.type == "Reshape" for op, _ in edges)


def test_num_towers_is_a_deprecated_alias_of_num_microbatches(model):
    ys = model.ys["none"]
    with model.graph.as_default():
        with pytest.warns(DeprecationWarning, match="num_microbatches=2"):
            old = pertower.build_towers(ys, model.xs, batch_size=B, num_towers=2)
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            new = pertower.build_towers(ys, model.xs, batch_size=B, num_microbatches=2)
        assert old.num_towers == new.num_towers == 2
        with pytest.raises(TypeError, match="num_towers.*num_microbatches"):
            pertower.build_towers(ys, model.xs, batch_size=B, num_microbatches=2,
                                  num_towers=2)
        with pytest.warns(DeprecationWarning, match="num_towers"):
            check = pertower.check_independence(ys, batch_size=B, num_towers=4)
        assert check.towers.num_towers == 4
        with pytest.raises(TypeError, match="check_independence"):
            pertower.check_independence(ys, batch_size=B, num_microbatches=4, num_towers=4)
        got = model.sess.run([old.gradients(), new.gradients()], model.feeds["none"])
    common.assert_all_close(got[0], got[1], 1e-6, 1e-7, "num_towers vs num_microbatches")

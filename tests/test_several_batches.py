"""`ys` that joins several batches along axis 0: ys = tf.concat([f(s1), f(s2)], 0).

The rows of such a `ys` are the examples of s1, then those of s2 (each batch may have
several batch tensors fed the same examples: features and labels). Every result is
compared with `pertower.oracle.loop_several_batches_gradients`: tf.gradients of sum(ys)
fed one example (or one microbatch) of one batch and an empty [0, ...] batch for the
others. That this definition is the per-example gradient of ys's rows is checked
against the gradient of each row on the whole batch (`common.loop_rows_of_batch`).
"""


import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import pertower
from pertower import oracle
from tests import cases
from tests import common

B1, B2 = 2, 3


class _TwoBatches:
    """A shared two-layer network f on two batches of different sizes, each with its
    features and labels: ys = concat([(f(x1) - y1)^2, (f(x2) - y2)^2], 0), [B1 + B2]."""

    def __init__(self, static=False):
        self.graph = tf.Graph()
        with self.graph.as_default():
            common.seed_weights(7)
            sizes = (B1, B2) if static else (None, None)
            self.x1, self.x2 = (tf.compat.v1.placeholder(tf.float32, [n, 4], name=f"x{j}")
                                for j, n in zip((1, 2), sizes))
            self.y1, self.y2 = (tf.compat.v1.placeholder(tf.float32, [n], name=f"y{j}")
                                for j, n in zip((1, 2), sizes))
            net = keras.Sequential([keras.layers.Dense(5, activation="tanh"),
                                    keras.layers.Dense(1)])
            losses = [tf.square(net(x)[:, 0] - y) for x, y in ((self.x1, self.y1),
                                                               (self.x2, self.y2))]
            self.ys = tf.concat(losses, 0)                                # [B1 + B2]
            self.xs = net.trainable_weights
            self.batch = [self.x1, self.y1, self.x2, self.y2]
            rng = np.random.RandomState(3)
            self.feed = {self.x1: rng.randn(B1, 4), self.y1: rng.randn(B1),
                         self.x2: rng.randn(B2, 4), self.y2: rng.randn(B2)}
            self.sess = tf.compat.v1.Session(graph=self.graph)
            self.sess.run(tf.compat.v1.global_variables_initializer())

    def oracle(self, num_microbatches=None):
        """The loop's per-example (or per-microbatch) gradients of `self.feed`; computed
        once per argument (the tests of the module share them)."""
        cache = self.__dict__.setdefault("_oracle", {})
        if num_microbatches not in cache:
            with self.graph.as_default():
                cache[num_microbatches] = oracle.loop_several_batches_gradients(
                    self.sess, self.ys, self.xs, self.feed,
                    [[self.x1, self.y1], [self.x2, self.y2]], num_microbatches)
        return cache[num_microbatches]


@pytest.fixture(scope="module")
def two():
    case = _TwoBatches()
    yield case
    case.sess.close()


@pytest.fixture(scope="module")
def two_gradients(two):
    """pertower.per_example_gradients of `two` (method auto), built once."""
    with two.graph.as_default():
        return pertower.per_example_gradients(two.ys, two.xs, batch=two.batch,
                                              batch_size=[B1, B1, B2, B2])


def test_scenario_2_in_two_placeholders_is_exact():
    cases.check_scenario_2_two_placeholders_case()


def test_the_oracle_is_each_rows_gradient_on_the_whole_batch(two):
    """The definition (one batch fed one example, the others empty) equals
    d sum(ys[r]) / dx run on the whole joined batch, for every row r."""
    with two.graph.as_default():
        common.assert_all_close(two.oracle(),
                                common.loop_rows_of_batch(two.sess, two.ys, two.xs, two.feed),
                                what="oracle vs rows of the whole batch")


# method auto (which picks the towers for joined batches, see the plan below); asking
# for the towers by name builds the same, heavy
@pytest.mark.parametrize("method", ["auto", pytest.param("towers", marks=pytest.mark.heavy)])
def test_per_example_gradients_of_batches_of_different_sizes(two, two_gradients, method):
    with two.graph.as_default():
        grads = (two_gradients if method == "auto" else pertower.per_example_gradients(
            two.ys, two.xs, batch=two.batch, batch_size=[B1, B1, B2, B2], method=method))
        got = two.sess.run(grads, two.feed)
        assert [g.shape[0] for g in got] == [B1 + B2] * len(two.xs)
        common.assert_all_close(got, two.oracle(), what=f"per-example ({method})")


def test_per_example_norms_of_batches_of_different_sizes(two):
    with two.graph.as_default():
        norms = pertower.per_example_norms(two.ys, two.xs, batch=two.batch,
                                           batch_size=[B1, B1, B2, B2])
        want = np.sqrt(sum(np.sum(g.reshape(B1 + B2, -1) ** 2, axis=1)
                           for g in two.oracle()))                      # [B1 + B2]
        common.assert_all_close([two.sess.run(norms, two.feed)], [want], what="norms")


def test_a_fed_batch_of_another_size_fails_at_run_time(two, two_gradients):
    with two.graph.as_default():
        feed = dict(two.feed)
        feed[two.x2], feed[two.y2] = feed[two.x2][:2], feed[two.y2][:2]
        with pytest.raises(tf.errors.InvalidArgumentError, match=r"built for a batch of 3 "
                                                                 r"examples.*(x2|y2):0 has 2"):
            two.sess.run(two_gradients, feed)


def test_static_batches_of_different_sizes_need_no_batch_size():
    case = _TwoBatches(static=True)
    with case.graph.as_default():
        grads = pertower.per_example_gradients(case.ys, case.xs, batch=case.batch)
        got = case.sess.run(grads, case.feed)
        # the oracle feeds slices, which static placeholders refuse: compare with the
        # same network on None-batch placeholders (the same seeded weights)
    case.sess.close()
    other = _TwoBatches()
    values = dict(zip((other.x1, other.y1, other.x2, other.y2),
                      (case.feed[case.x1], case.feed[case.y1], case.feed[case.x2],
                       case.feed[case.y2])))
    other.feed = values
    common.assert_all_close(got, other.oracle(), what="static batch axes")
    other.sess.close()


def test_microbatches_at_the_batch_boundaries():
    """num_microbatches = number of batches gives each batch's gradient (equal sizes);
    smaller groups work too when none straddles two batches."""
    with tf.Graph().as_default() as graph:
        common.seed_weights(1)
        s1 = tf.compat.v1.placeholder(tf.float32, [None, 3], name="s1")
        s2 = tf.compat.v1.placeholder(tf.float32, [None, 3], name="s2")
        dense = keras.layers.Dense(2, activation="tanh")
        ys = tf.concat([dense(s1), dense(s2) * 3.0], 0)                  # [8, 2]
        xs = dense.trainable_weights
        rng = np.random.RandomState(0)
        feed = {s1: rng.randn(4, 3), s2: rng.randn(4, 3)}
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for M in (2, 4):
                grads = pertower.microbatch_gradients(ys, xs, num_microbatches=M,
                                                      batch_size=4)
                want = oracle.loop_several_batches_gradients(sess, ys, xs, feed,
                                                             [[s1], [s2]], M)
                common.assert_all_close(sess.run(grads, feed), want, what=f"M={M}")


def test_microbatches_that_straddle_batches_are_refused(two):
    with two.graph.as_default():
        with pytest.raises(ValueError, match=r"`num_microbatches` \(2\) does not split the "
                                             r"rows of `ys` .* at the boundaries of the "
                                             r"batches .*x1:0 and y1:0 with 2 examples, then "
                                             r"x2:0 and y2:0 with 3 examples.*Valid values "
                                             r"here: 5 "):
            pertower.microbatch_gradients(two.ys, two.xs, batch=two.batch,
                                          batch_size=[B1, B1, B2, B2], num_microbatches=2)


def test_missing_or_contradicting_sizes_are_refused(two):
    with two.graph.as_default():
        with pytest.raises(ValueError, match=r"joins several batches along axis 0 .*"
                                             r"batch_size=\[B_1, B_2, \.\.\.\]"):
            pertower.per_example_gradients(two.ys, two.xs, batch=two.batch)
        with pytest.raises(ValueError, match=r"`batch_size` has 2 entries, but there are 4 "
                                             r"batch tensors"):
            pertower.per_example_gradients(two.ys, two.xs, batch=two.batch,
                                           batch_size=[B1, B2])
        with pytest.raises(ValueError, match=r"x1:0 has 2, y1:0 has 3 examples.*same number"):
            pertower.per_example_gradients(two.ys, two.xs, batch=two.batch,
                                           batch_size=[B1, B2, B2, B2])
        with pytest.raises(ValueError, match=r"`batch_size\[1\]` must be a positive integer"):
            pertower.per_example_gradients(two.ys, two.xs, batch=two.batch,
                                           batch_size=[B1, 0, B2, B2])


def test_a_size_list_for_one_batch_is_refused():
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        y = tf.compat.v1.placeholder(tf.float32, [None], name="y")
        w = tf.compat.v1.get_variable("w", [3])
        ys = tf.reduce_sum(x * w, axis=1) - y
        with pytest.raises(ValueError, match=r"`batch_size` is the list \[2, 3\].*the rows "
                                             r"of `ys` are the examples of one batch"):
            pertower.per_example_gradients(ys, [w], batch=[x, y], batch_size=[2, 3])
        # a list of equal sizes is the one size
        plan = pertower.explain(ys, [w], batch=[x, y], batch_size=[2, 2])
        assert plan.request.batch_size == 2 and plan.request.segments is None


def test_explain_shows_the_joined_batches_and_strict_rules_refuse(two):
    with two.graph.as_default():
        plan = pertower.explain(two.ys, two.xs, batch=two.batch, batch_size=[B1, B1, B2, B2])
        text = str(plan)
        assert "x1:0 and y1:0 (2 examples), then x2:0 and y2:0 (3 examples)" in text
        assert "B = 5" in text and plan.verdict == "independent"
        assert all(w.method == "towers" and "joins several batches" in w.reason
                   for w in plan.weights)
        with pytest.raises(ValueError, match=r"method='rules' is strict.*joins several "
                                             r"batches along axis 0"):
            pertower.per_example_gradients(two.ys, two.xs, batch=two.batch,
                                           batch_size=[B1, B1, B2, B2], method="rules")


def test_rows_of_joined_batches_mixed_with_one_batch_are_not_proven():
    """concat([f(s1), f(s2)]) + concat([g(s2), g(s1)]): the two joins put the batches in
    another order, so the rows are not proven and the call is refused as before."""
    with tf.Graph().as_default():
        s1 = tf.compat.v1.placeholder(tf.float32, [None, 3], name="s1")
        s2 = tf.compat.v1.placeholder(tf.float32, [None, 3], name="s2")
        w = tf.compat.v1.get_variable("w", [3, 1])
        ys = tf.concat([s1 @ w, s2 @ w], 0) + tf.concat([s2 @ w, s1 @ w], 0)
        plan = pertower.explain(ys, [w], batch_size=2)
        assert plan.verdict == "unproven"
        assert "combines the rows of several batches" in str(plan)


def test_three_batches_nested_joins():
    with tf.Graph().as_default() as graph:
        common.seed_weights(2)
        ss = [tf.compat.v1.placeholder(tf.float32, [None, 2], name=f"s{j}") for j in range(3)]
        dense = keras.layers.Dense(2, activation="tanh")
        ys = tf.concat([tf.concat([dense(ss[0]), dense(ss[1])], 0), dense(ss[2])], 0)
        xs = dense.trainable_weights
        grads = pertower.per_example_gradients(ys, xs, batch=ss, batch_size=[1, 2, 3])
        rng = np.random.RandomState(5)
        feed = {s: rng.randn(n, 2) for s, n in zip(ss, (1, 2, 3))}
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            want = oracle.loop_several_batches_gradients(sess, ys, xs, feed,
                                                         [[s] for s in ss])
            common.assert_all_close(sess.run(grads, feed), want, what="three batches")

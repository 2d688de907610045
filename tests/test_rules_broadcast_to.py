"""A weight spread over the batch's shape by BroadcastTo (rules/broadcast.py): TF-models'
PositionEmbedding, `tf.broadcast_to(table[:T] as [1, T, d], tf.shape(inputs))`, every
example reading every row. The output's rows follow the target shape (as a tf.zeros of
that shape), so grad_i(w) is dZ summed over example i's rows and the broadcast axes,
pulled back through the slice; no batch_size. A sum of the broadcast over the batch axis
is B times the weight in the batch and once alone: refused as a coupling.

The checks run in graph mode here and under `disable_v2_behavior()` in
tests/legacy/test_rules_broadcast_to.py, against the one-example loop.
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import pertower
from pertower import oracle
from tests import common
from tests import test_rules_weight_functions as weight_functions

B, T, V, D = 4, 6, 11, 8


class _PositionEmbedding(keras.layers.Layer):
    """TF-models' PositionEmbedding (official/nlp/modeling/layers/position_embedding.py):
    the first T rows of a [max_length, D] table, [T, D] -> [1, T, D], broadcast to the
    input's shape [B, T, D]; the caller adds it to the token embeddings."""

    def __init__(self, max_length, **kwargs):
        super().__init__(**kwargs)
        self.max_length = max_length

    def build(self, input_shape):
        self.table = self.add_weight(
            "embeddings", [self.max_length, input_shape[-1]],
            initializer=keras.initializers.RandomUniform(-0.5, 0.5))

    def call(self, inputs):                                      # [B, T, D]
        input_shape = tf.shape(inputs)
        rows = self.table[:input_shape[1], :]                     # [T, D]
        rows = tf.reshape(rows, [1, input_shape[1], self.table.shape[-1]])   # [1, T, D]
        return tf.broadcast_to(rows, input_shape)                 # [B, T, D]


def check_encoder(static_length):
    """Token embedding + PositionEmbedding, one MultiHeadAttention and a feed-forward
    block (LayerNormalization and Dense with T static; an EinsumDense with T dynamic,
    as in tests/test_rules_position_embedding.py), mean-pooled to ys [B]: every weight
    on the rules without batch_size, the table through its BroadcastTo; per-example
    gradients, norms, microbatches and a DP step (noise 0) equal to the loop's."""
    with tf.Graph().as_default() as graph:
        common.seed_weights(80)
        tokens = tf.compat.v1.placeholder(tf.int32, [None, T if static_length else None],
                                          name="tokens")
        embedding = keras.layers.Embedding(V, D)
        positions = _PositionEmbedding(10)
        attention = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)
        if static_length:
            norm1, norm2 = keras.layers.LayerNormalization(), keras.layers.LayerNormalization()
            dense = keras.layers.Dense(D, activation="tanh")
        else:
            norm1 = norm2 = keras.layers.Identity()
            dense = keras.layers.EinsumDense("btd,de->bte", (None, D), activation="tanh")
        h = embedding(tokens)                                           # [B, T, D]
        h = h + positions(h)                                            # [B, T, D]
        h = norm1(h + attention(h, h))                                  # [B, T, D]
        h = norm2(h + dense(h))                                         # [B, T, D]
        ys = tf.reduce_sum(tf.sin(tf.reduce_mean(h, axis=1)), axis=1)  # [B]
        layers = [embedding, positions, attention, norm1, norm2, dense]
        xs = [w for layer in layers for w in layer.trainable_weights]
        plan, through = weight_functions._plan_through(ys, xs)
        table = through[positions.table.name]
        assert "(BroadcastTo) through" in table and "(StridedSlice)" in table, table
        sess = weight_functions._session(graph)
        feed = {tokens: np.random.RandomState(81).randint(0, V, size=(B, T))}
        what = f"PositionEmbedding (T {'static' if static_length else 'dynamic'})"
        weight_functions._check_against_loop(sess, ys, xs, feed, what, micro=True)
        weight_functions._check_dp_step_against_loop(sess, ys, xs, feed, what)
        return str(plan)


def check_scale_broadcast_by_hand():
    """A learned scale [U] broadcast to the shape of a Dense output [B, U] (rank below
    the output's) and a bias [1, U] (a leading 1): on the rules, equal to the loop."""
    with tf.Graph().as_default() as graph:
        common.seed_weights(82)
        x = tf.compat.v1.placeholder(tf.float32, [None, 5], name="x")
        w = tf.compat.v1.get_variable("w", [5, 3])
        scale = tf.compat.v1.get_variable("scale", [3])
        bias = tf.compat.v1.get_variable("bias", [1, 3])
        h = tf.matmul(x, w)                                               # [B, 3]
        h = tf.tanh(h * tf.broadcast_to(tf.exp(scale), tf.shape(h))
                    + tf.broadcast_to(bias, tf.shape(h)))                 # [B, 3]
        ys = tf.reduce_sum(h ** 2, axis=1)                                # [B]
        _, through = weight_functions._plan_through(ys, [w, scale, bias])
        assert "(BroadcastTo) through" in through[scale.name], through
        assert through[bias.name].endswith("(BroadcastTo)"), through
        feed = {x: np.random.RandomState(83).randn(B, 5)}
        weight_functions._check_against_loop(weight_functions._session(graph), ys,
                                             [w, scale, bias], feed, "broadcast by hand")


def check_broadcast_in_a_loop_body():
    """tf.while_loop whose body scales h_t by broadcast_to(v, tf.shape(h_t)): the rule
    per step (the target shape is dZ's), equal to the loop without batch_size."""
    with tf.Graph().as_default() as graph:
        common.seed_weights(84)
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        w = tf.compat.v1.get_variable("w", [3, 3])
        v = tf.compat.v1.get_variable("v", [3])

        def body(i, h):                                                   # h [B, 3]
            return i + 1, tf.tanh(h @ w) * tf.broadcast_to(v, tf.shape(h))

        h = tf.while_loop(lambda i, h: i < 3, body, [0, x])[1]            # [B, 3]
        ys = tf.reduce_sum(h, axis=1)                                     # [B]
        _, through = weight_functions._plan_through(ys, [w, v])
        assert "(BroadcastTo) in" in through[v.name], through
        # (built before the session first runs the loop: TensorFlow adds the While's
        # outputs its gradients need when they are built)
        grads = pertower.per_example_gradients(ys, [w, v], method="rules")
        norms = pertower.per_example_norms(ys, [w, v], method="rules")
        sess = weight_functions._session(graph)
        feed = {x: np.random.RandomState(85).randn(B, 3)}
        got, got_norms = sess.run([grads, norms], feed)
        want = oracle.loop_per_example_gradients(sess, ys, [w, v], feed)
        common.assert_all_close(got, want, what="BroadcastTo in a loop body", kind="deep")
        want_norms = np.sqrt(sum(np.sum(g.reshape(B, -1) ** 2, axis=1) for g in want))
        common.assert_all_close([got_norms], [want_norms], what="its norms", kind="deep")


def check_sum_over_the_broadcast_batch_is_refused():
    """sum over axis 0 of broadcast_to(v, [B, U]) is B*v in the batch, v for one example
    alone: a coupling, refused with the op that sums."""
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        v = tf.compat.v1.get_variable("v", initializer=tf.ones([3]))
        spread = tf.broadcast_to(v, tf.shape(x))                          # [B, 3]
        ys = tf.reduce_sum(x * tf.reduce_sum(spread, axis=0, name="over_rows"), axis=1)
        plan = pertower.explain(ys, [v], batch_size=3)
        assert plan.verdict == "coupled", str(plan)
        with pytest.raises(ValueError, match=r"'over_rows' \(Sum\).*couples the examples"):
            pertower.per_example_gradients(ys, [v], batch_size=3)


@pytest.mark.parametrize("static_length", [
    False, pytest.param(True, marks=pytest.mark.heavy)], ids=["dynamic T", "static T"])
def test_position_embedding_encoder_is_on_the_rules_and_matches_the_loop(static_length):
    check_encoder(static_length)


def test_a_scale_and_bias_broadcast_by_hand_match_the_loop():
    check_scale_broadcast_by_hand()


def test_a_broadcast_in_a_loop_body_matches_the_loop():
    check_broadcast_in_a_loop_body()


def test_a_sum_over_the_broadcast_batch_axis_is_refused():
    check_sum_over_the_broadcast_batch_is_refused()

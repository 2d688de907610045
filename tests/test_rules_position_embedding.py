"""Learned position tables (issue 32, item 4): `tf.gather(table, tf.range(T))` and the
slice `table[:T]`, T = tf.shape(tokens)[1], broadcast-added to the token embeddings.
Every example reads the same rows, so the gather is a function of the weight alone
(rules/_weight_functions.py): the table is on the rules, pulled back from the Add's
broadcast rule, with no batch_size; the token table's lookups by the batch's ids stay
the gather rule's.

`check_transformer_block` builds a small Transformer-style encoder block of tf_keras
layers on int tokens ([None, None] or [None, 6]: the sequence length dynamic or static)
and compares it with the one-example loop. The tests here run in graph mode (TF2
behaviour); tests/legacy/test_rules_position_embedding.py runs them under
`tf.compat.v1.disable_v2_behavior()`.
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import pertower
from tests import common
from tests import test_rules_weight_functions as weight_functions

B, T, V, D = 4, 6, 11, 8


class _PositionTable(keras.layers.Layer):
    """A learned position embedding: rows [0, T) of a [max_length, D] table, by
    `tf.gather(table, tf.range(T))` ("gather") or `table[:T]` ("slice")."""

    def __init__(self, max_length, how, **kwargs):
        super().__init__(**kwargs)
        self.max_length, self.how = max_length, how

    def build(self, input_shape):
        self.table = self.add_weight(
            "table", [self.max_length, input_shape[-1]],
            initializer=keras.initializers.RandomUniform(-0.5, 0.5))

    def call(self, embedded):                                    # [B, T, D]
        length = tf.shape(embedded)[1]
        if self.how == "gather":
            return embedded + tf.gather(self.table, tf.range(length))            # [T, D]
        return embedded + self.table[:length]                                    # [T, D]


def check_transformer_block(static_length, how):
    """Token embedding + learned positions, one self-attention layer and a dense
    feed-forward with LayerNormalization, mean-pooled to ys [B]. (With T dynamic, the
    batch-axis analysis loses tf_keras' LayerNormalization and a Dense on [B, T, D],
    which reshape by products of tf.shape(x): that block has an EinsumDense and no
    normalization.)"""
    with tf.Graph().as_default() as graph:
        common.seed_weights(70)
        tokens = tf.compat.v1.placeholder(tf.int32, [None, T if static_length else None],
                                          name="tokens")
        embedding = keras.layers.Embedding(V, D)
        positions = _PositionTable(10, how)
        attention = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)
        if static_length:
            norm1, norm2 = keras.layers.LayerNormalization(), keras.layers.LayerNormalization()
        else:
            norm1 = norm2 = keras.layers.Identity()
        if static_length:
            dense = keras.layers.Dense(D, activation="tanh")
        else:
            dense = keras.layers.EinsumDense("btd,de->bte", (None, D), activation="tanh")
        h = positions(embedding(tokens))                                # [B, T, D]
        h = norm1(h + attention(h, h))                                  # [B, T, D]
        h = norm2(h + dense(h))                                         # [B, T, D]
        ys = tf.reduce_sum(tf.sin(tf.reduce_mean(h, axis=1)), axis=1)  # [B]
        layers = [embedding, positions, attention, norm1, norm2, dense]
        xs = [w for layer in layers for w in layer.trainable_weights]
        plan, through = weight_functions._plan_through(ys, xs)
        op_type = "ResourceGather" if how == "gather" else "StridedSlice"
        table = through[positions.table.name]
        assert "through" in table and f"({op_type})" in table, table
        lookups = through[embedding.embeddings.name]
        assert "(ResourceGather)" in lookups and "through" not in lookups, lookups
        sess = weight_functions._session(graph)
        feed = {tokens: np.random.RandomState(71).randint(0, V, size=(B, T))}
        what = f"position table ({how}, T {'static' if static_length else 'dynamic'})"
        weight_functions._check_against_loop(sess, ys, xs, feed, what, micro=True)
        # a DP step (noise 0): the clipped sum, pulled back through the gather or slice
        weight_functions._check_dp_step_against_loop(sess, ys, xs, feed, what)
        return str(plan)


def check_tied_table():
    """One table read by the batch's ids and by the rows [2, T + 2) (tf.nn.embedding_lookup,
    whose Identity follows the gather), T dynamic: the two reads' gradients added."""
    with tf.Graph().as_default() as graph:
        x = tf.compat.v1.placeholder(tf.int32, [None, None], name="x")
        table = tf.compat.v1.get_variable("table", initializer=np.random.RandomState(
            72).uniform(-1, 1, [V, D]).astype(np.float32))
        rows = tf.nn.embedding_lookup(table, tf.range(tf.shape(x)[1]) + 2)   # [T, D]
        h = tf.nn.embedding_lookup(table, x) + rows                          # [B, T, D]
        ys = tf.reduce_sum(tf.sin(h) * tf.range(D, dtype=tf.float32), axis=[1, 2])  # [B]
        _, through = weight_functions._plan_through(ys, [table])
        assert "through" in through[table.name], through
        feed = {x: np.random.RandomState(73).randint(0, V, size=(B, T))}
        weight_functions._check_against_loop(weight_functions._session(graph), ys, [table],
                                             feed, "tied table")


def check_batch_dependent_rows_are_not_weight_side():
    """`tf.gather(table, tf.range(tf.shape(x)[0]))` reads row i for example i (ids that
    follow B): not a function of the weight alone, so not pulled back as one."""
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        table = tf.compat.v1.get_variable("table", initializer=tf.ones([8, 3]))
        rows = tf.gather(table, tf.range(tf.shape(x)[0]))              # [B, 3]
        ys = tf.reduce_sum(x * rows, axis=1)                           # [B]
        plan = pertower.explain(ys, [table], batch_size=3)
        assert not any("through" in op for op in plan.weights[0].ops), str(plan)
        said = plan.weights[0].reason or ", ".join(plan.weights[0].ops)
        assert "Gather" in said and "through" not in said, str(plan)


@pytest.mark.parametrize("static_length", [False, True], ids=["dynamic T", "static T"])
@pytest.mark.parametrize("how", ["gather", "slice"])
def test_learned_position_table_is_on_the_rules_and_matches_the_loop(static_length, how):
    check_transformer_block(static_length, how)


def test_a_table_read_by_ids_and_by_positions_matches_the_loop():
    check_tied_table()


def test_rows_that_follow_the_batch_are_not_a_weight_function():
    check_batch_dependent_rows_are_not_weight_side()

"""Weights read inside TF1 (v1) while frames on the rules (`pertower._loops.frames`):
`tf.compat.v1.nn.dynamic_rnn` with LSTMCell, GRUCell and BasicRNNCell (sequence_length
given or not, batch- or time-major), a hand-written tf.while_loop over reference
variables, without batch_size, against the one-example loop; a frame the copy cannot
reproduce keeps its row passes. v1 control flow exists only under
tf.compat.v1.disable_v2_behavior(), so those tests are in tests/legacy/test_rules_recurrent_v1.py.
Here: a Keras GRU behind a mask (its bias
read through Unpack outside its TF2 loop and inside) on the rules; towers on a TF2 loop
imported from a meta graph.
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import pertower
from pertower import oracle
from tests import common


def _masked_gru(masking):
    """Embedding (mask_zero) or Embedding -> Masking, then a Keras GRU (a TF2 loop whose
    bias [2, 3u] is read through Unpack both outside the loop and inside it); ys is each
    example's sum of squared outputs, [B]."""
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(9)
        ids = tf.compat.v1.placeholder(tf.int32, [None, 4], name="ids")
        if masking == "mask_zero":
            embedded = keras.layers.Embedding(11, 3, mask_zero=True)(ids)
        else:
            embedded = keras.layers.Masking()(keras.layers.Embedding(11, 3)(ids))
        hidden = keras.layers.GRU(5, return_sequences=True)(embedded)       # [B, 4, 5]
        ys = tf.reduce_sum(tf.square(hidden), axis=[1, 2])                  # [B]
    return graph, ys, ids


@pytest.mark.parametrize("masking", [
    "mask_zero", pytest.param("Masking", marks=pytest.mark.heavy)])
def test_masked_gru_bias_on_the_rules(masking):
    """The masked GRU's bias is read through Unpack outside the loop and inside it:
    every weight on the rules without batch_size, the loop's per step, against the loop
    at two batch sizes (padded sequences of different lengths)."""
    graph, ys, ids = _masked_gru(masking)
    with graph.as_default():
        xs = tf.compat.v1.trainable_variables()
        plan = pertower.explain(ys, xs, batch=[ids])
        assert all(row.method == "rules" for row in plan.weights), str(plan)
        bias = next(row for row in plan.weights if row.name.endswith("gru_cell/bias:0"))
        assert any("per step" in op for op in bias.ops) and any(
            "Unpack" in op for op in bias.ops), str(plan)
        grads = pertower.per_example_gradients(ys, xs, batch=[ids])
        loop = oracle.SliceLoop(ys, xs)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for B in (3, 4):
                rows = np.random.RandomState(B).randint(1, 11, size=(B, 4))
                rows[np.arange(4) >= np.arange(B)[:, None] % 4 + 1] = 0   # padding
                feed = {ids: rows.astype(np.int32)}
                common.assert_all_close(sess.run(grads, feed),
                                        loop.run(sess, feed, B, batch=[ids]),
                                        kind="deep", what=f"GRU {masking} B={B}")


@pytest.mark.parametrize("layer", ["SimpleRNN", pytest.param("LSTM", marks=pytest.mark.heavy)])
def test_towers_on_a_while_loop_imported_from_a_meta_graph(layer):
    """A Keras SimpleRNN (an LSTM with -m heavy; a TF2 While either way) exported with
    export_meta_graph and imported into a new graph: its functions come back from the
    library with the resource arguments' handle data, which the towers' rewritten copies
    drop (the copy takes the weight's value).
    The rules (planned first: a gradient through an imported loop rewrites its body
    without the variables' shapes, and the rules then leave its weights to the towers)
    and towers (asked for) both match the loop."""
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(4)
        ids = tf.compat.v1.placeholder(tf.int32, [None, 4], name="ids")
        hidden = getattr(keras.layers, layer)(5, return_sequences=True)(
            keras.layers.Embedding(11, 3)(ids))
        tf.reduce_sum(tf.square(hidden), axis=[1, 2], name="ys")
        meta = tf.compat.v1.train.export_meta_graph()
    imported = tf.Graph()
    with imported.as_default():
        tf.compat.v1.train.import_meta_graph(meta)
        ys, ids = imported.get_tensor_by_name("ys:0"), imported.get_tensor_by_name("ids:0")
        assert any(op.type in ("While", "StatelessWhile") for op in imported.get_operations())
        xs = tf.compat.v1.trainable_variables()
        plan = pertower.explain(ys, xs, batch=[ids])
        assert all(row.method == "rules" for row in plan.weights), str(plan)
        rules = pertower.per_example_gradients(ys, xs, batch=[ids])
        towers = pertower.per_example_gradients(ys, xs, batch=[ids], batch_size=3,
                                                method="towers")
        loop = oracle.SliceLoop(ys, xs)
        with tf.compat.v1.Session(graph=imported) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            feed = {ids: np.array([[1, 2, 0, 0], [3, 4, 5, 6], [7, 0, 0, 0]], np.int32)}
            want = loop.run(sess, feed, 3, batch=[ids])
            common.assert_all_close(sess.run(towers, feed), want, kind="deep",
                                    what=f"imported {layer}, towers")
            common.assert_all_close(sess.run(rules, feed), want, kind="deep",
                                    what=f"imported {layer}, rules")

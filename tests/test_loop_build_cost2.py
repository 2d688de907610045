"""What building per-example gradients does to, and around, a user's TF2 while loop
(no timing).

- `_towers.later_gradients` edits the user's While op exactly as a `tf.gradients`
  through it does (same inputs, outputs, attributes and body), without building the
  backward op; a training op built after pertower's tensors have run then works
  (checked against the one-example loop and the batch gradient);
- the loop's copy reads each ε by popping it and writes each A_t by pushing it, and
  reads the weights it receives unchanged once, before the loop: its backward pass
  accumulates no per-step list shape, list length or weight value.
"""

import collections

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import pertower
from pertower import oracle
from tests import common

B, T, VOCAB, UNITS = 3, 4, 11, 5
WHILE = ("While", "StatelessWhile")


def _language_model(layer, seed):
    """(ys [B], xs, batch, the While op) of Embedding -> `layer` -> Dense in the default graph."""
    common.seed_weights(seed)
    ids = tf.compat.v1.placeholder(tf.int32, [None, T], name="ids")
    labels = tf.compat.v1.placeholder(tf.int32, [None, T], name="labels")
    hidden = getattr(keras.layers, layer)(UNITS, return_sequences=True)(
        keras.layers.Embedding(VOCAB, 3)(ids))                                # [B, T, U]
    logits = keras.layers.Dense(VOCAB)(hidden)                                 # [B, T, V]
    ys = tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=labels, logits=logits), axis=1)                                 # [B]
    loop = next(op for op in tf.compat.v1.get_default_graph().get_operations()
                if op.type in WHILE)
    return ys, tf.compat.v1.trainable_variables(), [ids, labels], loop


def _functions(graph):
    return {f.signature.name: f for f in graph.as_graph_def().library.function}


def _edit(graph, loop):
    """What an edit of `loop` decides, names apart: its input and output counts and
    types, output shapes, `_num_original_outputs`, and its body's and condition's node
    types, argument and result counts."""
    functions = _functions(graph)
    summary = [len(loop.inputs), len(loop.outputs), loop.get_attr("T"),
               [str(s) for s in loop.get_attr("output_shapes")],
               loop.get_attr("_num_original_outputs")]
    for attr in ("body", "cond"):
        function = functions[loop.get_attr(attr).name]
        summary.append((sorted(collections.Counter(n.op for n in function.node_def).items()),
                        len(function.signature.input_arg), len(function.signature.output_arg)))
    return summary


class Edited:
    """The same model in two graphs: `pertower` built per-example gradients, `reference`
    a tf.gradients of sum(ys) (so the user's loop is edited by TensorFlow)."""

    def __init__(self, layer):
        self.layer = layer
        self.pertower_graph, self.reference_graph = tf.Graph(), tf.Graph()
        with self.reference_graph.as_default():
            ys, xs, _, loop = _language_model(layer, 3)
            self.before = len(loop.outputs)
            tf.gradients(tf.reduce_sum(ys), xs)
            self.reference = _edit(self.reference_graph, loop)
        with self.pertower_graph.as_default():
            self.ys, self.xs, self.batch, self.loop = _language_model(layer, 3)
            ops = set(self.pertower_graph.get_operations())
            self.grads = pertower.per_example_gradients(self.ys, self.xs, batch=self.batch)
            self.added = [op for op in self.pertower_graph.get_operations() if op not in ops]
            self.edited = _edit(self.pertower_graph, self.loop)


@pytest.fixture(scope="module", params=["LSTM", pytest.param("GRU", marks=pytest.mark.heavy)])
def edited(request):
    return Edited(request.param)


def test_the_users_loop_is_edited_as_by_tf_gradients(edited):
    assert edited.reference[1] > edited.before, (edited.layer, edited.reference[1])
    assert edited.edited == edited.reference, edited.layer
    # no backward op of the user's loop (pertower's copy and its backward only)
    assert len([op for op in edited.added if op.type in WHILE]) == 2, (
        [op.name for op in edited.added if op.type in WHILE])


def test_a_training_op_built_after_the_first_run_works(edited):
    """pertower's tensors run first; then a tf.gradients through the user's loop (which
    finds every accumulator it reads, so edits nothing) builds and runs."""
    graph = edited.pertower_graph
    rng = np.random.RandomState(2)
    feed = {t: rng.randint(0, VOCAB, size=(B, T)).astype(np.int32) for t in edited.batch}
    with graph.as_default(), tf.compat.v1.Session(graph=graph) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        got = sess.run(edited.grads, feed)
        body = edited.loop.get_attr("body").name
        later = tf.gradients(tf.reduce_sum(edited.ys), edited.xs)
        assert edited.loop.get_attr("body").name == body, edited.layer
        batch_gradient = sess.run([tf.convert_to_tensor(g) for g in later], feed)
        loop = oracle.SliceLoop(edited.ys, edited.xs)
        common.assert_all_close(got, loop.run(sess, feed, B, batch=edited.batch),
                                kind="deep", what=f"{edited.layer} per-example")
    common.assert_all_close([g.sum(axis=0) for g in got], batch_gradient, kind="deep",
                            what=f"{edited.layer} training op built after the first run")


def test_the_copys_backward_accumulates_no_list_shape_or_weight(edited):
    """The copy's forward body, as its backward pass left it: the tensors it pushes for
    the backward are the cell's own intermediates, not a TensorList's shape or length
    per ε read (a pop needs neither) nor a weight's value (read once, before the loop)."""
    functions = _functions(edited.pertower_graph)
    copies = [op for op in edited.added if op.type in WHILE and op.name.endswith("copy")]
    assert len(copies) == 1, [op.name for op in edited.added if op.type in WHILE]
    body = functions[copies[0].get_attr("body").name]
    assert body.signature.name.endswith("_rewritten"), body.signature.name
    by_name = {n.name: n for n in body.node_def}
    pushed = [by_name[n.input[1].split(":")[0]].op for n in body.node_def
              if n.op == "TensorListPushBack" and n.input[1].split(":")[0] in by_name]
    user_reads = sum(n.op == "TensorListGetItem"
                     for n in functions[edited.loop.get_attr("body").name].node_def)
    shapes = [op for op in pushed if op in ("TensorListElementShape", "TensorListLength")]
    assert len(shapes) <= 2 * user_reads, (edited.layer, collections.Counter(pushed))
    assert "ReadVariableOp" not in pushed, (edited.layer, collections.Counter(pushed))
    assert "ReadVariableOp" not in {n.op for n in body.node_def}, edited.layer

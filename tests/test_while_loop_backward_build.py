"""What the rules build for weights read inside a TF2 while loop (no timing).

`pertower._loops` builds one backward pass of the loop (`pertower._loops.backward`:
TensorFlow's own, run from a duplicate of the user's op, with each covered read's dZ_t
and A_t pushed); every gradient the rules need, those of the weights before the loop
included, comes from that one backward pass (`pertower._loops.uses.output_gradients`). Checked:

- the build adds two While ops per covered loop (the duplicate and its backward loop),
  reads no output the edit adds to the user's loop, and leaves a loop that a gradient
  already went through unedited;
- the backward body has at most a bounded number of nodes per node of the loop's body
  and per covered read (`BACKWARD_BOUND`), and no forward body is built;
- gradients reaching a tensor before a loop by several paths (through the loop and
  around it; through two stacked loops) add up: against the one-example loop.
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import pertower
from pertower import oracle
from tests import cases
from tests import common

B, T, VOCAB, UNITS = 3, cases.LM_T, cases.LM_VOCAB, cases.LM_UNITS
WHILE = cases.WHILE_OP_TYPES


def BACKWARD_BOUND(n, J):
    """Nodes of the loop's backward body: TensorFlow's gradient of each forward node
    (the pop of its accumulator and a few nodes: 5 per node; `tf.gradients` builds the
    same, tests/test_while_loop_edit.py), plus, per covered read, the pushes of dZ_t and A_t
    and their output identities, plus the counter and plumbing."""
    return 5 * n + 10 * J + 20


def _library(graph):
    return {f.signature.name: len(f.node_def) for f in graph.as_graph_def().library.function}


class Built:
    """A language model on one Keras recurrent layer, per-example gradients built (after
    a tf.gradients through the loop when `differentiated_first`), and what the build added."""

    def __init__(self, layer, differentiated_first):
        self.graph = tf.Graph()
        with self.graph.as_default():
            ys, xs, batch, self.loop = cases.language_model(layer, 3)
            self.body_nodes = _library(self.graph)[self.loop.get_attr("body").name]
            self.differentiated_first = differentiated_first
            self.original = len(self.loop.outputs)
            if differentiated_first:
                tf.gradients(tf.reduce_sum(ys), xs)
            self.before = (len(self.loop.outputs), self.loop.get_attr("body").name)
            functions, ops = _library(self.graph), set(self.graph.get_operations())
            self.plan = pertower.explain(ys, xs, batch=batch)
            self.grads = pertower.per_example_gradients(ys, xs, batch=batch)
            self.functions = {k: v for k, v in _library(self.graph).items() if k not in functions}
            self.ops = [op for op in self.graph.get_operations() if op not in ops]
            self.reads = sum(len(row.ops) for row in self.plan.weights
                             if any("per step" in o for o in row.ops))
            self.loss, self.xs, self.batch = ys, xs, batch


@pytest.fixture(scope="module", params=[("LSTM", True), ("GRU", False)],
                ids=["LSTM-differentiated-first", "GRU"])
def built(request):
    return Built(*request.param)


def test_one_backward_reading_no_output_the_edit_adds(built):
    assert built.reads >= 3, str(built.plan)
    assert len([op for op in built.ops if op.type in WHILE]) == 2, (
        [op.name for op in built.ops if op.type in WHILE])
    readers = [op.name for op in built.ops for t in op.inputs
               if t.op is built.loop and t.value_index >= built.original]
    assert not readers, readers


def test_a_loop_already_differentiated_is_left_as_it_is(built):
    after = (len(built.loop.outputs), built.loop.get_attr("body").name)
    if built.differentiated_first:
        assert after == built.before
    else:   # edited as a gradient through it would (`_towers.later_gradients`)
        assert after[1].endswith("_rewritten") and after != built.before, after


def test_the_backward_is_bounded_by_the_loop_body(built):
    n, J = built.body_nodes, built.reads
    forward_body = built.loop.get_attr("body").name
    bodies = {k: v for k, v in built.functions.items() if "body" in k}
    backward = [v for k, v in bodies.items() if "_grad_" in k]
    # no forward body but the user's edited one (when pertower made the edit)
    assert set(bodies) - {forward_body} == {k for k in bodies if "_grad_" in k}, sorted(bodies)
    assert len(backward) == 1, sorted(bodies)
    assert backward[0] <= BACKWARD_BOUND(n, J), (backward, n, J)


def _feed(batch, seed):
    rng = np.random.RandomState(seed)
    return {t: rng.randint(0, VOCAB, size=(B, T)).astype(np.int32) for t in batch}


@pytest.mark.parametrize("layers", [
    ("SimpleRNN", "SimpleRNN"), pytest.param(("LSTM", "GRU"), marks=pytest.mark.heavy)],
    ids="-".join)
def test_paths_around_and_through_stacked_loops_add_up(layers):
    """Embedding -> a recurrent layer -> a second one (LSTM -> GRU with -m heavy), plus
    the embedding added to the second's output (a path around both loops) -> Dense: the
    embedding's gradient is the sum over three kinds of path, the first layer's weights'
    over the paths through the second; each loop is copied and differentiated once."""
    graph = tf.Graph()
    with graph.as_default():
        common.seed_weights(5)
        ids = tf.compat.v1.placeholder(tf.int32, [None, T], name="ids")
        labels = tf.compat.v1.placeholder(tf.int32, [None, T], name="labels")
        embedded = keras.layers.Embedding(VOCAB, UNITS)(ids)                   # [B, T, U]
        first = getattr(keras.layers, layers[0])(UNITS, return_sequences=True)(embedded)
        second = getattr(keras.layers, layers[1])(UNITS, return_sequences=True)(first)
        logits = keras.layers.Dense(VOCAB)(second + embedded)                 # [B, T, V]
        ys = tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=labels, logits=logits), axis=1)                             # [B]
        xs = tf.compat.v1.trainable_variables()
        ops = set(graph.get_operations())
        plan = pertower.explain(ys, xs, batch=[ids, labels])
        grads = pertower.per_example_gradients(ys, xs, batch=[ids, labels])
        added = [op for op in graph.get_operations() if op not in ops and op.type in WHILE]
        loop = oracle.SliceLoop(ys, xs)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            feed = _feed([ids, labels], 1)
            common.assert_all_close(sess.run(grads, feed),
                                    loop.run(sess, feed, B, batch=[ids, labels]),
                                    kind="deep", what=f"stacked {layers} with a skip")
    assert all(row.method == "rules" for row in plan.weights), str(plan)
    assert len(added) == 4, [op.name for op in added]   # two copies and their backward loops

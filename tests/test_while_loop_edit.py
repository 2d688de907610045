"""What building per-example gradients does to, and around, a user's TF2 while loop
(no timing).

- `_towers.later_gradients` edits the user's While op exactly as a `tf.gradients`
  through it does (same inputs, outputs, attributes and body), without building the
  backward op; a training op built after pertower's tensors have run then works
  (checked against the one-example loop and the batch gradient);
- pertower builds ONE backward of the loop (`pertower._loops.backward`): TensorFlow's own
  backward body plus the pushes of each covered read's dZ_t and A_t, run from a
  duplicate of the user's op, so that no tensor of pertower's reads an output the edit
  added to the user's op; where that backward cannot be built, the loop's copy
  (`pertower._loops.copy`) gives the same results.
"""

import collections

import numpy as np
import pytest
import tensorflow as tf

import pertower
from pertower import oracle
from tests import cases
from tests import common

B, T, VOCAB = 3, cases.LM_T, cases.LM_VOCAB


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
            ys, xs, _, loop = cases.language_model(layer, 3)
            self.before = len(loop.outputs)
            tf.gradients(tf.reduce_sum(ys), xs)
            self.reference = _edit(self.reference_graph, loop)
        with self.pertower_graph.as_default():
            self.ys, self.xs, self.batch, self.loop = cases.language_model(layer, 3)
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
    # one forward (the duplicate of the user's op) and one backward
    assert len([op for op in edited.added if op.type in cases.WHILE_OP_TYPES]) == 2, (
        [op.name for op in edited.added if op.type in cases.WHILE_OP_TYPES])


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


def _backward_body(graph, ops):
    """The node types of the body of the one backward While op among `ops`."""
    loops = [op for op in ops if op.type in cases.WHILE_OP_TYPES and "grad" in op.get_attr("body").name]
    assert len(loops) == 1, [op.name for op in loops]
    return collections.Counter(
        n.op for n in _functions(graph)[loops[0].get_attr("body").name].node_def)


def test_one_backward_tensorflows_own_body_plus_the_pushes(edited):
    """pertower's backward body is the one `tf.gradients` builds for the same loop, plus
    one push of dZ_t per covered read and one of A_t per read whose rule reads A (the
    LSTM's and GRU's bias, a BiasAdd, reads only dZ), and the Identity of each extra
    output; nothing else (no copy of the forward body, no second backward)."""
    reference = _backward_body(edited.reference_graph,
                               edited.reference_graph.get_operations())
    own = _backward_body(edited.pertower_graph, edited.added)
    assert not reference - own, (edited.layer, reference - own)
    assert set(own - reference) <= {"TensorListPushBack", "Identity"}, own - reference
    # LSTM: 3 covered reads (kernel, recurrent kernel, bias): 3 dZ_t and 2 A_t pushed;
    # GRU: 4 (its bias [2, 3u] is read as two slices, by two BiasAdds): 4 dZ_t, 2 A_t
    pushes = {"LSTM": 5, "GRU": 6}[edited.layer]
    stacks = [op for op in edited.added if op.type == "TensorListStack"
              and op.inputs[0].op.inputs[0].op.name.endswith("/backward")]
    assert own["TensorListPushBack"] - reference["TensorListPushBack"] == pushes, edited.layer
    assert len(stacks) == pushes, (edited.layer, [op.name for op in stacks])


def test_no_tensor_of_pertowers_reads_an_output_the_edit_added(edited):
    """The outputs the edit adds to the user's op (its accumulators) are read by no op
    pertower built: a session that ran the graph before the pertower call keeps the op
    unedited and still runs pertower's tensors."""
    readers = [op.name for op in edited.added for t in op.inputs
               if t.op is edited.loop and t.value_index >= edited.before]
    assert edited.edited[1] > edited.before and not readers, readers


def test_op_count_bounded_by_tf_gradients(edited):
    """pertower's build adds at most 1.75 times the ops `tf.gradients` adds to the same
    model (the one backward, the duplicate, the stacks, and the rules' products; the
    GRU's sliced bias adds the most: 226 ops against 140)."""
    with tf.Graph().as_default() as graph:
        ys, xs, _, _ = cases.language_model(edited.layer, 3)
        before = len(graph.get_operations())
        tf.gradients(tf.reduce_sum(ys), xs)
        reference = len(graph.get_operations()) - before
    assert len(edited.added) <= 1.75 * reference, (edited.layer, len(edited.added), reference)


@pytest.mark.heavy
@pytest.mark.parametrize("how", ["helpers", "unread_activation"])
def test_the_copy_where_the_backward_cannot_be_built(monkeypatch, how):
    """Where TensorFlow's private helpers differ (one missing), or the backward body
    does not read a covered op's A_t (BiasAdd's stand-in disabled: found while building
    the body, after the forward body graph got accumulators), the loop's copy gives the
    per-example gradients; they match the loop, and the user's op is still edited as by
    `tf.gradients` (a training op built after the first run works)."""
    import contextlib  # pylint: disable=import-outside-toplevel
    from pertower import _tf  # pylint: disable=import-outside-toplevel
    from pertower._loops import backward as _loop_backward
    if how == "unread_activation":
        monkeypatch.setattr(_loop_backward, "_DZ_ONLY_OP_TYPES", frozenset())
    # "helpers": as on a TensorFlow without one of them (the seam's switch)
    with _tf.forced_fallback("loop_backward") if how == "helpers" else contextlib.nullcontext():
        copy_test = Edited("LSTM")
    assert copy_test.edited == copy_test.reference
    assert not any(op.name.endswith("/backward") for op in copy_test.added), how
    monkeypatch.undo()
    test_a_training_op_built_after_the_first_run_works(copy_test)

"""Refusals that lead with the likely fix (issue 32, items 7 and 8): a `ys` with the
batch on axis 1, labels left out of `batch=`, and one reason said once for many weights
(class weights taken for a batch input: tests/test_batch_inputs.py,
`test_side_input_gathered_by_label_suggests_batch`). Each refusal is checked by its
words, and the fix it names is checked against the one-example loop."""

import re

import numpy as np
import pytest
import tensorflow as tf

import pertower
from pertower import oracle
from tests import common


@pytest.fixture
def classifier():
    """x [None, 3] @ W [3, 2] + b, labels [None]."""
    with tf.Graph().as_default() as graph:
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        labels = tf.compat.v1.placeholder(tf.int32, [None], name="labels")
        W = tf.Variable(np.arange(6, dtype=np.float32).reshape(3, 2) / 7, name="W")
        b = tf.Variable(np.array([0.1, -0.2], np.float32), name="b")
        loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels,
                                                              logits=x @ W + b)
        rng = np.random.default_rng(0)
        feed = {x: rng.standard_normal((4, 3)).astype(np.float32),
                labels: np.array([0, 1, 1, 0], np.int32)}
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            yield dict(graph=graph, sess=sess, x=x, labels=labels, W=W, b=b, loss=loss,
                       feed=feed)


def _assert_matches_the_loop(c, grads):
    """`grads` of W, fetched on the classifier's feed, against the one-example loop."""
    got = c["sess"].run(grads, c["feed"])
    want = common.run_oracle(oracle.loop_per_example_gradients, c["sess"], c["loss"],
                             [c["W"]], c["feed"], batch=[c["x"], c["labels"]])
    common.assert_all_close(got, want)


def test_ys_with_the_examples_on_axis_1_says_to_transpose_it(classifier):
    c = classifier
    with c["graph"].as_default():
        ys = tf.transpose(c["loss"][:, None])   # [1, B]
        with pytest.raises(ValueError) as refused:
            pertower.per_example_gradients(ys, [c["W"]])
        message = str(refused.value)
        assert re.match(r"pertower.per_example_gradients: `ys` \(transpose:0, shape "
                        r"\(1, None\)\) must have the examples on axis 0, but they were "
                        r"found on axis 1\. .*tf\.transpose\(ys\) or ys\[0\]", message)
        assert "Rows(" not in message and "batch_size" not in message
        assert len(message) < 300
        # with the batch size given it is still refused (the rows of `ys` are counted)
        with pytest.raises(ValueError, match=r"has 1 row on axis 0, but the batch has 4 "
                                             r"examples.*transposed"):
            pertower.per_example_gradients(ys, [c["W"]], batch_size=4)
        grads = pertower.per_example_gradients(tf.transpose(ys)[:, 0], [c["W"]])
    _assert_matches_the_loop(c, grads)


def test_labels_left_out_of_batch_are_named_first(classifier):
    c = classifier
    with c["graph"].as_default():
        with pytest.raises(ValueError, match=r"^pertower.per_example_gradients: `ys` reads "
                           r"labels:0 \(None,\), which is not in `batch=` \(x:0\).*must be "
                           r"in `batch=` \(batch=\[x:0, labels:0\]\).* Otherwise, the batch "
                           r"axis is not static"):
            pertower.per_example_gradients(c["loss"], [c["W"]], batch=[c["x"]],
                                           method="towers")
        grads = pertower.per_example_gradients(c["loss"], [c["W"]],
                                               batch=[c["x"], c["labels"]],
                                               method="towers", batch_size=4)
    _assert_matches_the_loop(c, grads)


def test_one_reason_for_many_weights_is_said_once(classifier):
    c = classifier
    with c["graph"].as_default():
        with pytest.raises(ValueError) as refused:
            pertower.per_example_gradients(c["loss"], [c["W"], c["b"]], method="towers")
    message = str(refused.value)
    assert "(W:0, b:0: method='towers' was asked for)" in message
    assert message.count("was asked for") == 1


def test_towers_given_labels_left_out_of_batch_name_them_at_run_time():
    """With `batch_size` the towers are built; the run-time check of their rows names
    the placeholder left out of `batch=`."""
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        targets = tf.compat.v1.placeholder(tf.float32, [None, 2], name="targets")
        W = tf.Variable(np.ones((3, 2), np.float32), name="W")
        ys = tf.reduce_sum(tf.square(x @ W - targets), 1)
        feed = {x: np.ones((4, 3), np.float32), targets: np.zeros((4, 2), np.float32)}
        grads = pertower.per_example_gradients(ys, [W], batch=[x], method="towers",
                                               batch_size=4)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            with pytest.raises(tf.errors.InvalidArgumentError,
                               match=r"does not follow the batch \(x:0\).* `ys` also reads "
                                     r"targets:0, not in `batch=`: if it carries the "
                                     r"examples too, pass batch=\[x:0, targets:0\]"):
                sess.run(grads, feed)
            grads = pertower.per_example_gradients(ys, [W], batch=[x, targets],
                                                   method="towers", batch_size=4)
            got = sess.run(grads, feed)
            want = common.run_oracle(oracle.loop_per_example_gradients, sess, ys, [W], feed,
                                     batch=[x, targets])
    common.assert_all_close(got, want)



@pytest.mark.parametrize("loss", ["sparse", "dense"])
@pytest.mark.parametrize("function", ["per_example_gradients", "microbatch_gradients"])
def test_towers_given_labels_left_out_of_batch_a_loss_pairs_name_them_before_building(
        classifier, loss, function):
    """With `batch_size` given, a softmax cross-entropy pairing the labels row by row
    with the examples refuses before the towers are built (TensorFlow would fail at run
    time: "logits and labels must have the same first dimension")."""
    c = classifier
    with c["graph"].as_default():
        if loss == "sparse":
            labels, feed, ys = c["labels"], c["feed"], c["loss"]
        else:
            labels = tf.compat.v1.placeholder(tf.float32, [None, 2], name="one_hot")
            feed = {c["x"]: c["feed"][c["x"]],
                    labels: np.eye(2, dtype=np.float32)[c["feed"][c["labels"]]]}
            ys = tf.nn.softmax_cross_entropy_with_logits(labels=labels,
                                                         logits=c["x"] @ c["W"] + c["b"])
        xs = [c["W"], c["b"]]
        options = dict(method="towers", batch_size=4)
        if function == "microbatch_gradients":
            options["num_microbatches"] = 2
        with pytest.raises(ValueError, match=(
                rf"^pertower.{function}: `ys` reads {labels.name} \(None,.*\), which is not "
                r"in `batch=` \(x:0\), but '.*' \(\w*SoftmaxCrossEntropyWithLogits\) "
                r"pairs it row by row with the examples: .* must be in `batch=` "
                rf"\(batch=\[x:0, {labels.name}\]\)\.$")):
            getattr(pertower, function)(ys, xs, batch=[c["x"]], **options)
        got = c["sess"].run(getattr(pertower, function)(ys, xs, batch=[c["x"], labels],
                                                        **options), feed)
    if function == "microbatch_gradients":
        want = common.run_oracle(oracle.loop_microbatch_gradients, c["sess"], ys, xs, feed,
                                 2, batch=[c["x"], labels])
    else:
        want = common.run_oracle(oracle.loop_per_example_gradients, c["sess"], ys, xs, feed,
                                 batch=[c["x"], labels])
    common.assert_all_close(got, want)


def test_towers_read_a_side_input_left_out_of_batch_whole(classifier):
    """A [None] placeholder left out of `batch=` that only maps the batch's labels (a
    side input read whole, not paired row by row with the examples) is not refused."""
    c = classifier
    with c["graph"].as_default():
        label_map = tf.compat.v1.placeholder(tf.int32, [None], name="label_map")
        ys = tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=tf.gather(label_map, c["labels"]), logits=c["x"] @ c["W"] + c["b"])
        feed = {**c["feed"], label_map: np.array([1, 0], np.int32)}
        batch = [c["x"], c["labels"]]
        got = c["sess"].run(pertower.per_example_gradients(
            ys, [c["W"]], batch=batch, method="towers", batch_size=4), feed)
    want = common.run_oracle(oracle.loop_per_example_gradients, c["sess"], ys, [c["W"]],
                             feed, batch=batch)
    common.assert_all_close(got, want)

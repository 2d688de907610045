"""`pertower explain MODEL.meta ...` (pertower/tools/explain_command.py) on a small
model saved as a meta graph and a checkpoint in a temporary directory, run through the
command's `main` in this process: the plan it prints, the --run check against the
one-example loop (and that the check fails when the gradients are off), its errors."""

import os
import re

import numpy as np
import pytest
import tensorflow as tf

import pertower
from pertower.tools import cli
from tests import common

B = 3


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A conv net with batch normalization (inference mode), a dense head and a v2
    while loop over a weight of its own, saved as model.meta + a checkpoint with
    non-initial values; feeds.npz with one batch. Returns the paths."""
    directory = tmp_path_factory.mktemp("explain")
    rng = np.random.RandomState(3)
    with tf.Graph().as_default() as graph:
        images = tf.compat.v1.placeholder(tf.float32, [None, 6, 6, 2], name="images")
        labels = tf.compat.v1.placeholder(tf.int32, [None], name="labels")
        with tf.compat.v1.variable_scope("net"):
            kernel = tf.compat.v1.get_variable("conv", [3, 3, 2, 4])
            scale = tf.compat.v1.get_variable("bn_scale", initializer=tf.ones([4]))
            offset = tf.compat.v1.get_variable("bn_offset", initializer=tf.zeros([4]))
            dense = tf.compat.v1.get_variable("dense", [64, 5])
            recurrent = tf.compat.v1.get_variable("recurrent", [5, 5])
        h = tf.nn.conv2d(images, kernel, 1, "VALID")                        # [B, 4, 4, 4]
        h = tf.compat.v1.nn.fused_batch_norm(
            h, scale, offset, mean=tf.constant([0.1, -0.1, 0.2, 0.0]),
            variance=tf.constant([0.5, 1.5, 1.0, 2.0]), is_training=False)[0]
        logits = tf.reshape(tf.nn.relu(h), [-1, 64]) @ dense                # [B, 5]
        # a v2 while loop imported from a meta graph can be differentiated only if it
        # was built to output its intermediates (TensorFlow's own limitation)
        tf.compat.v1.experimental.output_all_intermediates(True)
        try:
            logits = tf.while_loop(lambda i, z: i < 2,
                                   lambda i, z: (i + 1, tf.tanh(z @ recurrent)),
                                   [0, logits])[1]
        finally:
            tf.compat.v1.experimental.output_all_intermediates(None)
        tf.identity(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=labels, logits=logits), name="loss")                     # [B]
        saver = tf.compat.v1.train.Saver()
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run([tf.compat.v1.assign(v, rng.uniform(0.5, 1.2, v.shape).astype(np.float32))
                      for v in tf.compat.v1.global_variables()])
            prefix = saver.save(sess, os.path.join(directory, "model"))
    feeds = os.path.join(directory, "feeds.npz")
    np.savez(feeds, **{"images:0": rng.randn(B, 6, 6, 2).astype(np.float32),
                       "labels:0": rng.randint(0, 5, B).astype(np.int32)})
    return {"meta": prefix + ".meta", "prefix": prefix, "feeds": feeds}


def _explain(capsys, *argv):
    code = cli.main(["explain", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_explain_prints_the_plan_of_a_saved_graph(saved, capsys):
    code, out, _ = _explain(capsys, saved["meta"], "--ys", "loss", "--batch", "images,labels",
                            "--batch-size", str(B))
    assert code == 0
    assert "pertower plan for explain" in out
    rows = {cells[0]: cells[2] for cells in (re.split(r"\s{2,}", line.strip())
                                             for line in out.splitlines()
                                             if line.startswith("  net/"))}
    assert rows == {"net/conv:0": "rules", "net/bn_scale:0": "rules",
                    "net/bn_offset:0": "rules", "net/dense:0": "rules",
                    "net/recurrent:0": "rules"}, out
    assert "model.meta: 5 weights: 5 rules, 0 towers, 0 passes" in out
    assert "in 'while' per step" in out and "FusedBatchNormV3" in out


def test_explain_run_restores_the_checkpoint_and_agrees_with_the_loop(saved, capsys):
    code, out, err = _explain(capsys, saved["meta"], "--ys", "loss:0", "--batch",
                              "images:0,labels:0", "--xs", "net/conv,net/bn_scale,net/dense",
                              "--run", saved["feeds"], "--checkpoint", saved["prefix"])
    assert code == 0, out + err
    assert "model.meta: 3 weights: 3 rules, 0 towers" in out
    line = next(line for line in out.splitlines() if line.startswith("--run:"))
    assert line.startswith(f"--run: B={B}, 3 weights,") and line.endswith("agrees"), line
    difference = float(line.split("max relative difference ")[1].split()[0])
    assert difference <= 1e-5, line


def test_explain_run_reports_gradients_that_differ_from_the_loop(saved, capsys, monkeypatch):
    """The check can fail: gradients scaled by 1.01 are reported, exit code 1."""
    original = pertower.per_example_gradients
    monkeypatch.setattr(pertower, "per_example_gradients",
                        lambda *a, **k: [g * 1.01 for g in original(*a, **k)])
    code, out, _ = _explain(capsys, saved["meta"], "--ys", "loss", "--batch",
                            "images,labels", "--xs", "net/conv", "--run", saved["feeds"])
    assert code == 1
    assert "DISAGREES (tolerance 0.001)" in out and "max relative difference 1.0" in out


@pytest.mark.parametrize("argv, message", [
    (["--ys", "no_such_loss"], "--ys 'no_such_loss': no such tensor in the imported graph"),
    (["--ys", "loss", "--xs", "net/nothing"],
     "--xs 'net/nothing': no such variable in the meta graph; choose from net/bn_offset"),
    (["--ys", "loss", "--checkpoint", "x"], "--checkpoint is read only with --run"),
])
def test_explain_names_the_wrong_option(saved, capsys, argv, message):
    code, _, err = _explain(capsys, saved["meta"], "--batch", "images,labels", *argv)
    assert code == 2 and message in err, err


def test_explain_of_a_missing_file_says_so(capsys, tmp_path):
    code, _, err = _explain(capsys, str(tmp_path / "none.meta"), "--ys", "y", "--batch", "x")
    assert code == 2 and "no such file" in err


@pytest.fixture(scope="module")
def saved_lstm(tmp_path_factory):
    """A tf_keras LSTM (then a dense head) built in graph mode, exported with
    tf.compat.v1.train.export_meta_graph; feeds.npz with one batch. Returns the paths."""
    import tf_keras  # pylint: disable=import-outside-toplevel
    directory = tmp_path_factory.mktemp("explain_lstm")
    rng = np.random.RandomState(5)
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 4, 3], name="x")
        labels = tf.compat.v1.placeholder(tf.int32, [None], name="labels")
        h = tf_keras.layers.LSTM(6, name="lstm")(x)                          # [B, 6]
        logits = tf_keras.layers.Dense(5, name="head")(h)                    # [B, 5]
        tf.identity(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=labels, logits=logits), name="loss")                     # [B]
        meta = os.path.join(directory, "model.meta")
        tf.compat.v1.train.export_meta_graph(meta)
    feeds = os.path.join(directory, "feeds.npz")
    np.savez(feeds, **{"x:0": rng.randn(B, 4, 3).astype(np.float32),
                       "labels:0": rng.randint(0, 5, B).astype(np.int32)})
    return {"meta": meta, "feeds": feeds}


def test_explain_run_of_a_keras_lstm_agrees_with_the_loop(saved_lstm, capsys):
    """The loop's tf.gradients are built before pertower edits the While op (issue 32,
    item 10: 'Connecting to invalid output 47 of source node lstm/while')."""
    code, out, err = _explain(capsys, saved_lstm["meta"], "--ys", "loss", "--batch",
                              "x,labels", "--run", saved_lstm["feeds"])
    assert code == 0, out + err
    line = next(line for line in out.splitlines() if line.startswith("--run:"))
    assert line.startswith(f"--run: B={B}, 5 weights,") and line.endswith("agrees"), line
    difference = float(line.split("max relative difference ")[1].split()[0])
    assert difference <= 1e-5, line


@pytest.fixture(scope="module")
def saved_tf1(tmp_path_factory):
    """The paths of `common.save_tf1_classifier`'s checkpoint and feeds."""
    prefix, feeds = common.save_tf1_classifier(tmp_path_factory.mktemp("explain_tf1"), 7)
    return {"meta": prefix + ".meta", "prefix": prefix, "feeds": feeds}


@pytest.mark.parametrize("batch", [["--batch", "x:0,y:0"], ["--batch", "x:0", "--batch", "y:0"]])
def test_explain_of_a_tf1_checkpoint_with_two_batch_options(saved_tf1, capsys, batch):
    """Issue 32, item 9: `--batch x:0 --batch y:0` names both inputs (a second --batch
    used to replace the first: every weight then fell to the towers, 'read by
    SparseSoftmaxCrossEntropyWithLogits ... no rule', and --run failed in TensorFlow)."""
    code, out, err = _explain(capsys, saved_tf1["meta"], "--ys", "loss", *batch,
                              "--run", saved_tf1["feeds"], "--checkpoint", saved_tf1["prefix"])
    assert code == 0, out + err
    assert "batch x:0, y:0," in out, out
    assert "model.meta: 4 weights: 4 rules, 0 towers, 0 passes" in out, out
    line = next(line for line in out.splitlines() if line.startswith("--run:"))
    assert line.startswith("--run: B=5, 4 weights,") and line.endswith("agrees"), line

"""`pertower explain MODEL.meta --run` (pertower/tools/explain_command.py) on a TF1
model saved under disable_v2_behavior(): reference variables, tf.compat.v1.layers,
two batch placeholders x:0 and y:0 given by two --batch options (issue 32, item 9)."""

import os

import numpy as np
import tensorflow as tf

from pertower.tools import cli


def test_explain_run_of_a_tf1_checkpoint_agrees_with_the_loop(tmp_path, capsys):
    rng = np.random.RandomState(11)
    with tf.Graph().as_default() as graph:
        x = tf.compat.v1.placeholder(tf.float32, [None, 4], name="x")
        y = tf.compat.v1.placeholder(tf.int32, [None], name="y")
        h = tf.compat.v1.layers.dense(x, 8, activation=tf.nn.relu)
        logits = tf.compat.v1.layers.dense(h, 3)                             # [B, 3]
        tf.identity(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=y, logits=logits), name="loss")                          # [B]
        saver = tf.compat.v1.train.Saver()
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            prefix = saver.save(sess, os.path.join(tmp_path, "model"))
    feeds = os.path.join(tmp_path, "feeds.npz")
    np.savez(feeds, **{"x:0": rng.randn(5, 4).astype(np.float32),
                       "y:0": rng.randint(0, 3, 5).astype(np.int32)})
    code = cli.main(["explain", prefix + ".meta", "--ys", "loss", "--batch", "x:0",
                     "--batch", "y:0", "--run", feeds, "--checkpoint", prefix])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert "model.meta: 4 weights: 4 rules, 0 towers, 0 passes" in out, out
    line = next(line for line in out.splitlines() if line.startswith("--run:"))
    assert line.startswith("--run: B=5, 4 weights,") and line.endswith("agrees"), line

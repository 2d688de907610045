"""`pertower explain MODEL.meta --run` (pertower/tools/explain_command.py) on a TF1
model saved under disable_v2_behavior(): reference variables, tf.compat.v1.layers,
two batch placeholders x:0 and y:0 given by two --batch options (issue 32, item 9)."""

from pertower.tools import cli
from tests import common


def test_explain_run_of_a_tf1_checkpoint_agrees_with_the_loop(tmp_path, capsys):
    prefix, feeds = common.save_tf1_classifier(tmp_path, 11)
    code = cli.main(["explain", prefix + ".meta", "--ys", "loss", "--batch", "x:0",
                     "--batch", "y:0", "--run", feeds, "--checkpoint", prefix])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert "model.meta: 4 weights: 4 rules, 0 towers, 0 passes" in out, out
    line = next(line for line in out.splitlines() if line.startswith("--run:"))
    assert line.startswith("--run: B=5, 4 weights,") and line.endswith("agrees"), line

"""The digits examples run with --quick, check themselves against the one-example loop,
print their figures and write their PNGs into tmp_path.

They run in this process through their `main(argv)` (each builds its graphs inside
`with tf.Graph().as_default()`), which saves a TensorFlow import per script; the
scripts set the same environment as tests/conftest.py.
"""

import importlib.util
import pathlib
import re

import pytest

import pertower

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def _run(script, capsys, *args):
    spec = importlib.util.spec_from_file_location(script[:-3], EXAMPLES / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    capsys.readouterr()
    code = module.main(["--quick", *args])
    out = capsys.readouterr().out
    assert code == 0, out
    return out


def _is_png(path):
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_dp_sgd_digits_prints_accuracy_epsilon_and_step_times(capsys):
    out = _run("dp_sgd_digits.py", capsys)
    plain = re.search(r"SGD     test accuracy (\d\.\d+)   epsilon = inf", out)
    private = re.search(r"DP-SGD  test accuracy (\d\.\d+)   epsilon = (\d+\.\d+) at delta = "
                        r"1e-05 \(5 steps, q = 0\.0333, noise multiplier 1\.1", out)
    assert plain and private, out
    want = pertower.compute_epsilon(5, 1.1, 50 / 1500, 1e-5)
    assert float(private.group(2)) == pytest.approx(want, abs=0.006), out
    assert re.search(r"median step time: SGD \d+\.\d ms, DP-SGD \d+\.\d ms", out), out


def test_dp_fit_digits_prints_accuracy_epsilon_and_the_flipped_labels_found(capsys):
    out = _run("dp_fit_digits.py", capsys)
    private = re.search(r"DP fit  test accuracy (\d\.\d+)   epsilon = (\d+\.\d+) at delta = "
                        r"1e-05 \(5 steps, q = 0\.0333, noise multiplier 1\.1", out)
    assert private, out
    want = pertower.compute_epsilon(5, 1.1, 50 / 1500, 1e-5)
    assert float(private.group(2)) == pytest.approx(want, abs=0.006), out
    found = re.search(r"flipped labels among the 75 largest self-influences: (\d+)/75 "
                      r"\(precision \d\.\d\d; at random 0\.05\); (\d+) examples trained on",
                      out)
    assert found and 0 < int(found.group(2)) <= 5 * 150, out   # 5 steps of about 50


def test_tracin_digits_writes_the_grid(tmp_path, capsys):
    # --top 1: one proponent and one opponent per test digit (12 panels to draw, not 36)
    output = tmp_path / "tracin.png"
    out = _run("tracin_digits.py", capsys, "--output", str(output), "--top", "1")
    assert "OK: TracIn scores match the one-example loop (6 training x 4 test images)" in out
    assert len(re.findall(r"test digit \d: proponents are \[\d\], opponents are \[\d\]",
                          out)) == 4, out
    assert re.search(r"proponents sharing the test digit's label: \d/4", out), out
    assert f"saved {output}" in out and _is_png(output)


def test_gradient_similarity_digits_writes_the_heatmap(tmp_path, capsys):
    output = tmp_path / "similarity.png"
    out = _run("gradient_similarity_digits.py", capsys, "--output", str(output))
    assert "OK: gradient cosines match the one-example loop (6 images)" in out, out
    assert re.search(r"mean cosine within a class -?\d\.\d+, between classes -?\d\.\d+", out)
    assert f"saved {output}" in out and _is_png(output)

"""`python -m benchmarks --peers` at B=4: every peer (torch.func, Opacus hooks and ghost
clipping, JAX, the TensorFlow and pertower DP-SGD steps), run in its own child process
with the TensorFlow model's weights, agrees with the loop of `pertower.oracle`; a peer
whose result differs is marked WRONG and fails the command; a framework that is not
installed shows as n/a. Skipped where PyTorch or JAX is not installed (CI: the peers
are an optional extra). No timing thresholds."""

# pytest fixtures are arguments of the same name
# pylint: disable=redefined-outer-name,unused-argument

import importlib.util
import json
import os
import shutil

import numpy as np
import pytest

from benchmarks import command
from benchmarks import peers
from benchmarks import records
from benchmarks import report

# find_spec, not importorskip: the peers are never imported in the test process
_ABSENT = [name for name in ("torch", "jax", "jaxlib")
           if importlib.util.find_spec(name) is None]
if _ABSENT:
    pytest.skip(f"the peers need {', '.join(_ABSENT)} "
                "(pip install -r benchmarks/requirements-peers.txt)", allow_module_level=True)
HAVE_OPACUS = importlib.util.find_spec("opacus") is not None

B = 4
MODELS = ("mlp", "cnn", "cifar")


@pytest.fixture(scope="module")
def children_env():
    """One thread per child (the peers' thread pools wait on each other on a machine
    shared with other test processes) and XLA's cheaper compilation (JAX compiles two
    functions per model; the results are the same, only their speed differs)."""
    patch = pytest.MonkeyPatch()
    patch.setenv("OMP_NUM_THREADS", "1")
    patch.setenv("XLA_FLAGS", " ".join(filter(None, [
        os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0",
        "--xla_llvm_disable_expensive_passes=true"])))
    yield
    patch.undo()


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """A job folder per model at B=4 (the loop's reference, the weights, the batch)."""
    folder = tmp_path_factory.mktemp("peers")
    made = []
    for model in MODELS:
        job_folder = str(folder / f"{model}-{B}")
        P, _, scale = peers.prepare_job(model, B, job_folder)
        assert scale > 0, model             # the loop's gradients are not all zeros
        made.append((model, B, P, job_folder))
    return made


@pytest.fixture(scope="module")
def run(jobs, children_env):
    """One round of every framework's child on every job: (entries, info)."""
    info = {}
    entries = peers.run_jobs(jobs, repeats=1, rounds=1, report=lambda line: None, info=info)
    return entries, info


def test_every_peer_agrees_with_the_loop(run, jobs):
    entries, info = run
    expected = sorted(name for framework in peers.FRAMEWORKS
                      for name, _ in records.PEER_ENTRIES[framework])
    problems = []
    for model, _, P, _ in jobs:
        mine = [e for e in entries if e.model == model]
        assert sorted(e.name for e in mine) == expected, model
        for e in mine:
            where = f"{model} {e.name}"
            assert e.batch_size == B and e.parameters == P, where
            if e.name.startswith("dp step: opacus") and not HAVE_OPACUS:
                assert e.status == "n/a" and "opacus" in e.reason, where
                continue
            if e.status != "ok" or e.agrees is not True:
                problems.append(f"{where}: {e.status} {e.reason} max|diff| "
                                f"{e.max_abs_diff} of {e.max_abs_reference}")
                continue
            assert e.max_abs_reference > 0, where      # something was compared
            assert len(e.runs_ms) == 1 and e.median_ms > 0, where
            assert e.build_seconds >= 0 and e.first_run_seconds > 0, where
    assert not problems, "\n".join(problems)
    assert set(info) == set(peers.FRAMEWORKS)
    assert "torch" in info["torch"] and "jax" in info["jax"]
    # the torch child computes in exact float32 (no TF32 / bfloat16 passes)
    assert info["torch"]["fp32"]["matmul"] == "highest", info["torch"]
    assert info["torch"]["fp32"].get("mkldnn_conv", "ieee") == "ieee", info["torch"]
    assert "tensorflow" in info["tf"] and "pertower" in info["tf"]


def test_each_child_loads_only_its_framework(run):
    _, info = run
    own = {"tf": "tensorflow", "torch": "torch", "jax": "jax"}
    for framework in peers.FRAMEWORKS:
        assert info[framework]["loaded"] == [own[framework]], (framework, info[framework])


@pytest.fixture(scope="module")
def wrong(jobs, children_env, tmp_path_factory):
    """The torch child on a copy of the cifar job whose reference was shifted by 0.5
    in one example's first weight (per-example and clipped mean): its entries."""
    model, _, P, folder = next(job for job in jobs if job[0] == "cifar")
    copy = str(tmp_path_factory.mktemp("wrong") / "cifar")
    shutil.copytree(folder, copy)
    for name in ("g0.npy", "clipped0.npy"):
        path = os.path.join(copy, name)
        values = np.load(path)
        values[0] += 0.5
        np.save(path, values)
    return peers.run_jobs([(model, B, P, copy)], repeats=1, rounds=1,
                          report=lambda line: None, frameworks=("torch",))


def test_a_peer_that_disagrees_is_marked_wrong(wrong):
    checked = [e for e in wrong if e.status == "ok"]
    assert {e.name for e in checked} >= {records.TORCH_VMAP}
    for e in checked:
        assert e.agrees is False and e.max_abs_diff >= 0.4, (e.name, e.max_abs_diff)
        # the shift sits in weight 0; the per-example entry names example 0 too, and
        # its second run on the same inputs differs from the loop by as much
        assert e.note.startswith("w0"), (e.name, e.note)
        if e.computes == "gradients":
            assert e.note.startswith("w0 example 0;") and "(same)" in e.note, e.note
    table = report.format_table(wrong)
    assert table.count("WRONG") == 2 * len(checked), table     # row and its note
    assert f"{records.TORCH_VMAP} WRONG: largest difference at w0 example 0" in table


def test_the_plot_marks_a_wrong_peer(wrong, monkeypatch, tmp_path):
    """A peer that disagrees keeps its time in the plot, its legend entry marked."""
    figure_module = pytest.importorskip("matplotlib.figure")
    labels = []

    def savefig(figure, *args, **kwargs):
        labels.extend(text.get_text() for ax in figure.axes if ax.get_legend()
                      for text in ax.get_legend().get_texts())

    monkeypatch.setattr(figure_module.Figure, "savefig", savefig)
    report.plot(wrong, str(tmp_path / "wrong.png"))
    assert f"{records.TORCH_VMAP} (WRONG at some B)" in labels, labels


def test_the_command_fails_on_a_wrong_peer(wrong, monkeypatch, tmp_path):
    """`python -m benchmarks --peers` prints the peers' rows, writes them to the JSON and
    exits with 1 when one of them disagrees (here the rows of the shifted reference,
    on the cifar model)."""
    monkeypatch.setattr(peers, "run_peers", lambda keys, *args, **kwargs: list(wrong))
    lines = []
    monkeypatch.setattr("builtins.print",
                        lambda *a, **k: lines.append(" ".join(map(str, a))))
    json_path = tmp_path / "figures.json"
    code = command.main(["--onednn", "as-is", "--peers", "--models", "cifar", "--batch-sizes", str(B),
                     "--repeats", "1", "--json", str(json_path)])
    out = "\n".join(lines)
    assert code == 1, out
    assert "WRONG" in out and "FAILED" in out and records.TORCH_VMAP in out
    with open(json_path, encoding="utf-8") as handle:
        figures = json.load(handle)
    assert {e.name for e in wrong} <= {e["name"] for e in figures["entries"]}
    assert "peers" in figures["notes"] and "peers" in figures["settings"]


def test_a_missing_framework_is_not_available(jobs, monkeypatch):
    monkeypatch.setattr(peers, "missing_frameworks",
                        lambda: {"torch": "torch not installed (pip install -r "
                                          "benchmarks/requirements-peers.txt)"})
    entries = peers.run_jobs(jobs[:1], repeats=1, rounds=1, report=lambda line: None,
                             frameworks=("torch",))
    assert [e.name for e in entries] == [n for n, _ in records.PEER_ENTRIES["torch"]]
    for e in entries:
        assert e.status == "n/a" and "requirements-peers.txt" in e.reason
        assert e.agrees is None and e.median_ms is None


def test_the_peers_run_the_bench_models():
    from benchmarks import models  # pylint: disable=import-outside-toplevel
    assert peers.PEER_MODELS == models.MODEL_NAMES

"""Every ```python block of README.md and docs/*.md runs as pasted.

Convention: a block that is not meant to run (it needs hardware or servers the tests do
not have) is marked by the HTML comment `<!-- fragment: why -->` on the line just
before its opening fence; it is still compiled. Every other block must run on its own,
in a fresh Python process, with its own imports, data and session.

Scheme: starting one Python process with TensorFlow per block would take far too long,
so all blocks run in ONE subprocess (tests/scripts/run_doc_blocks.py, run by
`common.run_python`), each in a fresh namespace and on a fresh default graph; a missing import or name fails as it would
pasted. What a shared process could hide is process-wide state set by an earlier block:
the Keras version (TF_USE_LEGACY_KERAS, read when TensorFlow is imported) and graph
mode. So every runnable block must set both itself, which is checked on its text:
`os.environ["TF_USE_LEGACY_KERAS"] = "1"` before its first TensorFlow import, and a
`tf.compat.v1.disable_eager_execution()` call (blocks that switch other process-wide
modes, such as disable_v2_behavior, are refused). The subprocess starts without
TF_USE_LEGACY_KERAS and with no TensorFlow imported, as a user's process does.

A failure names the block's file and line; the traceback points into the document.

The same process first checks what only a fresh one can (FRESH_PROCESS_CHECK, before any
block, so that no TensorFlow start-up is spent on it alone): `import pertower` imports
no TensorFlow, pertower's own code writes no environment variable (TensorFlow's import
sets some of its own: each write is traced to the file that made it), and every public
name then loads.
It sets TF_USE_LEGACY_KERAS=1 first, as the blocks do, so the blocks then share a
process where TensorFlow is imported; their own order (the variable before TensorFlow)
is checked on their text.

Also checked on the documents' text: every relative link names a file (and heading) that
exists, and the README names no private module (`pertower/_x`, `pertower._x`), which
move between versions.
"""

import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
FRAGMENT = re.compile(r"^\s*<!--\s*fragment\b.*-->\s*$")
OPENING = re.compile(r"^(\s*)```\s*python\s*$")
LEGACY_KERAS = 'os.environ["TF_USE_LEGACY_KERAS"] = "1"'
GRAPH_MODE = "tf.compat.v1.disable_eager_execution()"
TF_IMPORT = re.compile(r"^\s*(import tensorflow\b|from tensorflow\b|import .*\btensorflow\b)",
                       re.M)


def _blocks(path):
    """(line of the first code line, code, is_fragment) per ```python block of `path`."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found, k = [], 0
    while k < len(lines):
        opening = OPENING.match(lines[k])
        if not opening:
            k += 1
            continue
        indent = len(opening.group(1))
        fragment = k > 0 and bool(FRAGMENT.match(lines[k - 1]))
        end = k + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        assert end < len(lines), f"{path.name}:{k + 1}: unclosed ```python block"
        code = "\n".join(line[indent:] for line in lines[k + 1:end]) + "\n"
        found.append((k + 2, code, fragment))
        k = end + 1
    return found


ALL_BLOCKS = [(path.relative_to(ROOT).as_posix(), line, code, fragment)
              for path in DOCUMENTS for line, code, fragment in _blocks(path)]
RUNNABLE = [(path, line, code) for path, line, code, fragment in ALL_BLOCKS if not fragment]
IDS = [f"{path}:{line}" for path, line, _ in RUNNABLE]


def test_the_documents_have_python_blocks():
    assert len(RUNNABLE) >= 10, [f"{p}:{line}" for p, line, _, _ in ALL_BLOCKS]


@pytest.mark.parametrize("path, line, code, fragment", ALL_BLOCKS,
                         ids=[f"{p}:{line}" for p, line, _, _ in ALL_BLOCKS])
def test_every_block_compiles(path, line, code, fragment):
    del fragment
    compile("\n" * (line - 1) + code, path, "exec")


@pytest.mark.parametrize("path, line, code", RUNNABLE, ids=IDS)
def test_runnable_block_sets_its_own_process_wide_modes(path, line, code):
    where = f"{path}:{line}"
    first_import = TF_IMPORT.search(code)
    assert first_import, f"{where}: the block does not import TensorFlow (mark a block " \
                         "that is not meant to run with <!-- fragment: why -->)"
    legacy = code.find(LEGACY_KERAS)
    assert 0 <= legacy < first_import.start(), \
        f"{where}: set {LEGACY_KERAS} before the first TensorFlow import"
    assert GRAPH_MODE in code, f"{where}: call {GRAPH_MODE}"
    assert "disable_v2_behavior" not in code and "enable_eager_execution" not in code, \
        f"{where}: other process-wide modes cannot share the docs' test process"


# Run first in the blocks' process (a fresh interpreter: no TensorFlow imported yet).
# TF_CPP_MIN_LOG_LEVEL is removed while pertower loads, so that setting it counts as a
# change; jax, which TensorFlow imports where it is installed, sets variables of its own
# (not pertower's doing), so it is kept out while pertower loads.
FRESH_PROCESS_CHECK = """\
import os, sys
os.environ["TF_USE_LEGACY_KERAS"] = "1"
log_level = os.environ.pop("TF_CPP_MIN_LOG_LEVEL", None)
sys.modules.setdefault("jax", None)
before = dict(os.environ)
writes = []    # (variable, file of the code that wrote it) for every os.environ write
_environ = type(os.environ)
_set, _delete = _environ.__setitem__, _environ.__delitem__
def _writer():
    frame = sys._getframe(2)
    while frame.f_code.co_filename.startswith("<frozen") or frame.f_code.co_filename in (
            os.__file__, getattr(sys.modules.get("_collections_abc"), "__file__", "")):
        frame = frame.f_back
    return frame.f_code.co_filename
def _recording_set(self, key, value):
    writes.append((key, _writer()))
    _set(self, key, value)
def _recording_delete(self, key):
    writes.append((key, _writer()))
    _delete(self, key)
_environ.__setitem__, _environ.__delitem__ = _recording_set, _recording_delete
try:
    import pertower
    assert "tensorflow" not in sys.modules
    assert set(pertower.__all__) <= set(dir(pertower))
    gradients = pertower.per_example_gradients
    from pertower._api.gradients import per_example_gradients
    assert gradients is per_example_gradients
    assert "tensorflow" in sys.modules
    namespace = {}
    exec("from pertower import *", namespace)
    missing = set(pertower.__all__) - set(namespace)
    assert not missing, missing
    assert pertower.oracle.SliceLoop is not None
    try:
        pertower.no_such_name
    except AttributeError as error:
        assert "no_such_name" in str(error)
    else:
        raise AssertionError("no AttributeError")
    # pertower's own code writes no environment variable (TensorFlow's import may set
    # its own, such as TF2_BEHAVIOR: those writes come from TensorFlow's files), and
    # nothing changed the environment unseen
    package = os.path.dirname(pertower.__file__)
    assert not [w for w in writes if w[1].startswith(package)], writes
    changed = {key for key in set(os.environ) | set(before)
               if os.environ.get(key) != before.get(key)}
    assert changed <= {key for key, _ in writes}, (changed, writes)
finally:
    _environ.__setitem__, _environ.__delitem__ = _set, _delete
    if sys.modules.get("jax", 0) is None:
        del sys.modules["jax"]
    if log_level is not None:
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = log_level
"""
FRESH_PROCESS = "tests/test_docs.py-FRESH_PROCESS_CHECK:1"


@pytest.fixture(scope="module")
def block_results():
    """FRESH_PROCESS_CHECK, then every runnable block, as tests/scripts/run_doc_blocks.py
    ran them in a fresh interpreter without TF_USE_LEGACY_KERAS; ({"path:line": (ok,
    traceback)}, the `subprocess.CompletedProcess`)."""
    from tests import common  # pylint: disable=import-outside-toplevel  (imports TensorFlow)
    process = common.run_python("tests/scripts/run_doc_blocks.py", check=False,
                                env={"TF_USE_LEGACY_KERAS": None})
    results, current = {}, None
    for row in process.stdout.splitlines():
        match = re.match(r"BLOCK (\S+) (OK|FAILED)$", row)
        if match:
            current = match.group(1)
            results[current] = [match.group(2) == "OK", ""]
        elif current is not None and row.startswith("    "):
            results[current][1] += row[4:] + "\n"
    return results, process


@pytest.mark.parametrize("path, line, code", RUNNABLE, ids=IDS)
def test_block_runs_as_pasted(block_results, path, line, code):
    del code
    results, process = block_results
    where = f"{path}:{line}"
    assert where in results, (f"{where} did not run (the runner stopped): exit code "
                              f"{process.returncode}\n{process.stderr[-3000:]}")
    ok, trace = results[where]
    assert ok, f"the python block at {where} failed:\n{trace}"


def test_import_pertower_is_lazy_and_leaves_the_environment_alone(block_results):
    """In a fresh process (the blocks' process, before its first block): `import
    pertower` imports no TensorFlow and sets no environment variable; every name of
    `__all__` loads (`from pertower import *`), submodules too, unknown names raise."""
    results, process = block_results
    assert FRESH_PROCESS in results, (f"the check did not run: exit code "
                                      f"{process.returncode}\n{process.stderr[-3000:]}")
    ok, trace = results[FRESH_PROCESS]
    assert ok, f"in a fresh process:\n{trace}"


LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#+\s+(.*?)\s*$", re.M)
FENCE = re.compile(r"^\s*```.*?^\s*```", re.M | re.S)


def _anchors(path):
    """The GitHub anchors of the headings of markdown file `path`."""
    return {re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
            for title in HEADING.findall(FENCE.sub("", path.read_text(encoding="utf-8")))}


def test_every_relative_link_points_at_a_file_and_heading_that_exist():
    broken, checked = [], 0
    for document in DOCUMENTS:
        text = FENCE.sub("", document.read_text(encoding="utf-8"))
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue                                   # https:, mailto:
            checked += 1
            path, _, anchor = target.partition("#")
            where = f"{document.relative_to(ROOT).as_posix()}: ({target})"
            resolved = (document.parent / path).resolve() if path else document
            if not resolved.exists():
                broken.append(f"{where}: no file {path}")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                broken.append(f"{where}: no heading #{anchor} in {path or document.name}")
    assert checked >= 10, f"only {checked} relative links found: is LINK still right?"
    assert not broken, "broken relative links:\n" + "\n".join(broken)


def test_readme_names_no_private_module():
    # private modules move between versions; the README names public functions only
    private = re.compile(r"\bpertower[/.]_[a-z]")
    lines = [f"README.md:{number}: {line.strip()[:100]}"
             for number, line in enumerate((ROOT / "README.md").read_text(
                 encoding="utf-8").splitlines(), 1) if private.search(line)]
    assert not lines, "the README names private modules:\n" + "\n".join(lines)


# Files outside the repository that text must not cite (built so that this file does
# not contain the names itself).
OUTSIDE_FILES = ["SCEN" + "ARIOS", "NO" + "TES"]


def test_no_tracked_file_cites_files_outside_the_repository():
    listing = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                             check=False)
    if listing.returncode != 0:
        pytest.skip(f"not a git checkout: {listing.stderr.decode(errors='replace')[:200]}")
    pattern = re.compile(r"\b(" + "|".join(OUTSIDE_FILES) + r")(\.md)?\b")
    citations = []
    for name in listing.stdout.decode().split("\0"):
        path = ROOT / name
        if not name or not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue                                  # binary (images)
        for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
            if pattern.search(line):
                citations.append(f"{name}:{number}: {line.strip()[:100]}")
    assert not citations, "these lines cite files that are not in the repository:\n" + \
        "\n".join(citations)

"""Every ```python block of README.md and docs/*.md runs as pasted.

Convention: a block that is not meant to run (it needs hardware or servers the tests do
not have) is marked by the HTML comment `<!-- fragment: why -->` on the line just
before its opening fence; it is still compiled. Every other block must run on its own,
in a fresh Python process, with its own imports, data and session.

Scheme: starting one Python process with TensorFlow per block would take far too long,
so all blocks run in ONE fresh process, the one that runs the example scripts and
`pertower demo` as a user runs them ("scenario_examples" of tests/process_checks.py:
tests/scripts/scenario_examples.py), each block in a fresh namespace, on a fresh default
graph and in an empty working directory (tests/doc_blocks.py `run_block`); a missing
import or name fails as it would pasted. What a shared process could hide is
process-wide state set by an earlier block or script: the Keras version
(TF_USE_LEGACY_KERAS, read when TensorFlow is imported) and graph mode. So every
runnable block must set both itself, which is checked on its text:
`os.environ["TF_USE_LEGACY_KERAS"] = "1"` before its first TensorFlow import, and a
`tf.compat.v1.disable_eager_execution()` call (blocks that switch other process-wide
modes, such as disable_v2_behavior, are refused); and in the process, where
TF_USE_LEGACY_KERAS is removed before each block and must be "1" after it, with eager
execution off. The process starts without TF_USE_LEGACY_KERAS and with no TensorFlow
imported, as a user's process does.

A failure names the block's file and line; the traceback points into the document.

The same process first checks what only a fresh one can (`doc_blocks.FRESH_PROCESS_CHECK`,
before any script or block, so that no TensorFlow start-up is spent on it alone):
`import pertower` imports no TensorFlow and changes no environment variable, and every
public name then loads. It sets TF_USE_LEGACY_KERAS=1 first, as the blocks do, so the
blocks then share a process where TensorFlow is imported; their own order (the variable
before TensorFlow) is checked on their text.

Also checked on the documents' text: every relative link names a file (and heading) that
exists, and the README names no private module (`pertower/_x`, `pertower._x`), which
move between versions.
"""

import re
import subprocess

import pytest

from tests.doc_blocks import ALL_BLOCKS, DOCUMENTS, FRESH_PROCESS, ROOT, RUNNABLE, check_name

LEGACY_KERAS = 'os.environ["TF_USE_LEGACY_KERAS"] = "1"'
GRAPH_MODE = "tf.compat.v1.disable_eager_execution()"
TF_IMPORT = re.compile(r"^\s*(import tensorflow\b|from tensorflow\b|import .*\btensorflow\b)",
                       re.M)
IDS = [check_name(path, line) for path, line, _ in RUNNABLE]
# the process that runs the blocks (tests/scripts/scenario_examples.py)
PROCESS = "scenario_examples"


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


@pytest.mark.process_checks(PROCESS)
@pytest.mark.parametrize("path, line", [(path, line) for path, line, _ in RUNNABLE], ids=IDS)
def test_block_runs_as_pasted(processes, path, line):
    # the check's message: the block's traceback (it points into the document)
    processes.assert_passed(PROCESS, check_name(path, line))


@pytest.mark.process_checks(PROCESS)
def test_import_pertower_is_lazy_and_leaves_the_environment_alone(processes):
    """In a fresh process (the blocks' process, before its first check): `import
    pertower` imports no TensorFlow and sets no environment variable; every name of
    `__all__` loads (`from pertower import *`), submodules too, unknown names raise."""
    processes.assert_passed(PROCESS, FRESH_PROCESS)


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

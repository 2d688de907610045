"""Test set-up: one pytest session per TensorFlow mode.

TensorFlow's execution mode is process-wide and must be chosen before the first graph is
built, so the tests of each mode run as a pytest session of their own:

- tests/          graph mode (`tf.compat.v1.disable_eager_execution()`), tf_keras: set here;
- tests/legacy/   `tf.compat.v1.disable_v2_behavior()` (reference variables, v1 control
                  flow, `Dimension` shapes): set by tests/legacy/conftest.py;
- tests/eager/    TensorFlow 2 as a new user starts it (eager execution, Keras 3, oneDNN
                  on): set by tests/eager/conftest.py.

A folder's conftest.py sets its mode when pytest imports it, before any test module
imports TensorFlow. A session of tests/ leaves the mode folders out (name a folder to run
it); a session that names two modes is refused. The README's test command,
`bash tests/run.sh`, runs the three sessions one after the other. What needs a fresh
interpreter (an environment variable read when
TensorFlow is imported, servers alive until their process ends, the documents' blocks
run as a user runs them) runs in a subprocess (`tests.common.run_python`).

With pytest-xdist (`-n 2 --dist loadfile`) each test module runs in one worker, so its
module-scoped graphs and sessions are built once.
"""

import gc
import os
import pathlib

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
# A full collection traverses every object alive (TensorFlow's, as it is imported, then
# what the tests' graphs keep), so it runs after 100 collections of the middle
# generation, not Python's 10 (~5% less CPU per test process; garbage still goes, later).
gc.set_threshold(gc.get_threshold()[0], gc.get_threshold()[1], 100)

import pytest  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
# the folders whose tests run in a mode of their own (a session each)
MODE_FOLDERS = ("legacy", "eager")
_MODE = pytest.StashKey()


def _session_mode(config):
    """"graph", or the mode folder that every path of the command line is in."""
    modes = set()
    for arg in config.args:
        path = (config.invocation_params.dir / arg.split("::")[0]).resolve()
        try:
            parts = path.relative_to(HERE).parts
        except ValueError:   # a path above tests/ (the repository): graph mode
            parts = ()
        modes.add(parts[0] if parts and parts[0] in MODE_FOLDERS else "graph")
    if len(modes) > 1:
        raise pytest.UsageError(
            f"these paths need {len(modes)} TensorFlow modes ({', '.join(sorted(modes))}): "
            f"run each of tests/, " + ", ".join(f"tests/{m}/" for m in MODE_FOLDERS)
            + " as a pytest session of its own (the README's test command does)")
    return modes.pop() if modes else "graph"


def pytest_configure(config):
    config.stash[_MODE] = _session_mode(config)
    if getattr(config, "workerinput", None) is None and config.getoption("dist", "no") != "no":
        return   # pytest-xdist's controller: it runs no test, so needs no TensorFlow
    if config.stash[_MODE] == "graph":
        # Graph mode for the whole process, before any test module imports TensorFlow.
        import tensorflow as tf  # pylint: disable=import-outside-toplevel
        tf.compat.v1.disable_eager_execution()
    _freeze_what_is_alive()


def pytest_report_header(config):
    mode = config.stash[_MODE]
    if mode == "graph":
        return ("TensorFlow mode: graph (the sessions of "
                + ", ".join(f"tests/{m}/" for m in MODE_FOLDERS) + " run apart)")
    return f"TensorFlow mode: tests/{mode}/conftest.py's"


def pytest_ignore_collect(collection_path, config):
    """A session of tests/ (graph mode) leaves the mode folders out."""
    if config.stash[_MODE] == "graph" and collection_path.parent == HERE \
            and collection_path.name in MODE_FOLDERS:
        return True
    return None


def _freeze_what_is_alive():
    """Moves every object alive now (TensorFlow's ~300,000 once it is imported) out of
    the garbage collector's reach, after collecting what is garbage: its full
    collections (during collection, the tests, and the five at the end of the session
    that pytest makes to report unraisable exceptions) then traverse only the objects
    created later (~2 CPU-s less per test process). An object frozen here that later
    becomes garbage in a reference cycle stays in memory: a few at most."""
    gc.collect()
    gc.freeze()


def pytest_collection_finish(session):
    if getattr(session.config, "workerinput", None) is not None \
            or session.config.getoption("dist", "no") == "no":
        _freeze_what_is_alive()   # the test modules and what they imported


@pytest.fixture(scope="module")
def mlp_batch_size():
    """The number of examples of the `mlp` fixture; a module overrides it with a fixture
    of the same name."""
    return 4


@pytest.fixture(scope="module")
def mlp(mlp_batch_size):  # pylint: disable=redefined-outer-name
    """Scenario 1's MLP (`cases.build_mlp`), one graph and session per test module:
    `mlp.ys` [B, 1], `mlp.outputs` [B, 3], B = `mlp_batch_size`."""
    from tests import cases  # pylint: disable=import-outside-toplevel  (after graph mode)
    case = cases.build_mlp(B=mlp_batch_size)
    yield case
    case.sess.close()

"""Test set-up: graph mode for each test process, before any test imports TensorFlow.

Tests that need another process-wide mode (eager, or disable_v2_behavior), servers or
a fresh interpreter read the checks of a process of tests/process_checks.py: mark them
`@pytest.mark.process_checks("legacy")` and take the `processes` fixture. The processes
that the collected tests name are queued when collection ends and run in the
background, once per session; the tests that read them run after the others.

With pytest-xdist (`-n 2 --dist loadgroup`, the README's command) each module's tests
run in one worker (its module-scoped graphs are built once), the readers one by one;
the workers share the processes' output directory, and each process runs in the first
worker that starts it. The controller imports no TensorFlow.
"""

import gc
import os
import shutil
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import pytest  # noqa: E402

from tests import process_checks  # noqa: E402  (imports no TensorFlow)

_PROCESSES = pytest.StashKey()
_SHARED_DIRECTORY = pytest.StashKey()
_DIRECTORY_KEY = "pertower_processes_directory"   # in an xdist worker's workerinput


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "process_checks(name): the test reads the checks of process `name` of "
                   "tests/process_checks.PROCESSES (started once per session).")
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None and config.getoption("dist", "no") != "no":
        return   # pytest-xdist's controller: it runs no test, so needs no TensorFlow
    # Graph mode for the whole process, before any test module imports TensorFlow.
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    tf.compat.v1.disable_eager_execution()
    _freeze_what_is_alive()
    if workerinput is not None and _DIRECTORY_KEY in workerinput:
        # a pytest-xdist worker: the workers share the directory of the processes
        config.stash[_PROCESSES] = process_checks.Processes(
            directory=workerinput[_DIRECTORY_KEY])
    else:
        config.stash[_PROCESSES] = process_checks.Processes()


def _freeze_what_is_alive():
    """Moves every object alive now (TensorFlow's ~300,000 once it is imported) out of
    the garbage collector's reach, after collecting what is garbage: its full
    collections (during collection, the tests, and the five at the end of the session
    that pytest makes to report unraisable exceptions) then traverse only the objects
    created later (~2 CPU-s less per test process). An object frozen here that later
    becomes garbage in a reference cycle stays in memory: a few at most."""
    gc.collect()
    gc.freeze()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """pytest-xdist's controller, for each worker: one directory for the session's
    processes, shared by the workers (removed when the session ends)."""
    config = node.config
    if _SHARED_DIRECTORY not in config.stash:
        config.stash[_SHARED_DIRECTORY] = tempfile.mkdtemp(prefix="pertower-processes-")
    node.workerinput[_DIRECTORY_KEY] = config.stash[_SHARED_DIRECTORY]


def pytest_unconfigure(config):
    if _SHARED_DIRECTORY in config.stash:
        shutil.rmtree(config.stash[_SHARED_DIRECTORY], ignore_errors=True)


def pytest_itemcollected(item):
    """Under pytest-xdist (`-n 2 --dist loadgroup`): each test module's tests go to one
    worker (an `xdist_group` per module, so that module-scoped graphs and sessions are
    built once); the tests that read a process go one at a time."""
    if getattr(item.config, "workerinput", None) is None:
        return
    if next(item.iter_markers("process_checks"), None) is None:
        item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


@pytest.hookimpl(trylast=True)   # after -k / -m deselection
def pytest_collection_modifyitems(config, items):
    names = list(dict.fromkeys(marker.args[0] for item in items
                               for marker in item.iter_markers("process_checks")))
    # the members of a group first: together they make the longest run
    grouped = {name for group in process_checks.GROUPS for name in group}
    if not config.option.collectonly:   # (--collect-only runs no test)
        config.stash[_PROCESSES].start(*sorted(names, key=lambda name: name not in grouped))
    # The tests that read a process run last (in their order): until then the test
    # process runs the others while the queue runs the processes on the other core.
    items.sort(key=lambda item: next(item.iter_markers("process_checks"), None) is not None)


def pytest_collection_finish(session):
    if _PROCESSES in session.config.stash:   # (not xdist's controller)
        _freeze_what_is_alive()   # the test modules and what they imported


def pytest_sessionfinish(session):
    if _PROCESSES not in session.config.stash:
        return   # xdist's controller
    # An xdist worker waits for the processes it started (another worker may read
    # them), unless the session was stopped early.
    shared = getattr(session.config, "workerinput", None) is not None
    session.config.stash[_PROCESSES].stop(
        wait=shared and not (session.shouldstop or session.shouldfail))


@pytest.fixture(scope="session")
def processes(request):
    """The session's `process_checks.Processes`."""
    return request.config.stash[_PROCESSES]


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

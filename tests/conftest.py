"""Test set-up: graph mode for the whole process, before any test imports TensorFlow.

Tests that need another process-wide mode (eager, or disable_v2_behavior), servers or
a fresh interpreter read the checks of a process of tests/process_checks.py: mark them
`@pytest.mark.process_checks("legacy")` and take the `processes` fixture. The processes
that the collected tests name are queued when collection ends and run one at a time in
the background, once per session; the tests that read them run after the others.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402  (the environment must be set first)

from tests import process_checks  # noqa: E402

tf.compat.v1.disable_eager_execution()

from tests import cases  # noqa: E402  (imports Keras and pertower: after the mode is set)

_PROCESSES = pytest.StashKey()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "process_checks(name): the test reads the checks of process `name` of "
                   "tests/process_checks.PROCESSES (started once per session).")
    config.stash[_PROCESSES] = process_checks.Processes()


@pytest.hookimpl(trylast=True)   # after -k / -m deselection
def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return   # every xdist worker collects every test: start on first use instead
    processes = config.stash[_PROCESSES]
    for item in items:
        for marker in item.iter_markers("process_checks"):
            processes.start(marker.args[0])
    # The tests that read a process run last (in their order): until then the test
    # process runs the others while the queue runs the processes on the other core.
    items.sort(key=lambda item: next(item.iter_markers("process_checks"), None) is not None)


def pytest_sessionfinish(session):
    session.config.stash[_PROCESSES].stop()


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
    case = cases.build_mlp(B=mlp_batch_size)
    yield case
    case.sess.close()

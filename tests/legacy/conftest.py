"""The tests of this folder run as a pytest session of their own under
`tf.compat.v1.disable_v2_behavior()`: graph mode, reference variables, v1 control flow
(Switch/Merge, Enter/Exit frames) and `Dimension` shapes, as TensorFlow 1 code runs
(`python -m pytest tests/legacy`; see tests/conftest.py)."""

import pytest


def pytest_configure(config):
    if getattr(config, "workerinput", None) is None and config.getoption("dist", "no") != "no":
        return   # pytest-xdist's controller: it runs no test, so needs no TensorFlow
    # For the whole process, before any test module imports TensorFlow.
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    tf.compat.v1.disable_v2_behavior()


@pytest.fixture(autouse=True)
def _legacy_mode():
    """Each test starts under disable_v2_behavior(): reference variables, graph mode, v1
    control flow (a test that switches one back restores it)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    assert not tf.compat.v1.resource_variables_enabled() and not tf.executing_eagerly(), \
        "expected disable_v2_behavior(): reference variables, graph mode"
    assert not tf.compat.v1.control_flow_v2_enabled(), "expected control flow v1"

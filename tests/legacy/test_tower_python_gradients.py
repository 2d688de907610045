"""Python-defined gradients and transposed convolutions under the towers
(tests/python_gradient_cases.py) under tf.compat.v1.disable_v2_behavior(), with the
environment's oneDNN setting, against the one-example loop."""

import pytest

from tests import python_gradient_cases as cases


@pytest.mark.parametrize("check", cases.CHECKS, ids=lambda check: check.__name__)
def test_python_gradients_and_transposed_convolutions(check):
    check()

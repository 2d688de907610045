"""The checks of tests/test_conv_ways_at_zoo_shapes.py and tests/test_rules_convs.py
(`CHECKS["legacy"]`) under tf.compat.v1.disable_v2_behavior() (`Dimension` shapes,
reference variables): the convolution ways the zoo networks run on, dilated, transposed
and 3-D convolutions, against the one-example loop."""

import pytest

from tests import test_rules_convs as convs
from tests import test_conv_ways_at_zoo_shapes as zoo_speed


@pytest.mark.heavy   # (as in graph mode, where they run in the default run)
@pytest.mark.parametrize("check", zoo_speed.CHECKS)
def test_zoo_convolution_ways(check):
    getattr(zoo_speed, check)()


# the dilated convolutions: heavy here (the default run checks them in graph mode and
# with oneDNN, and the legacy shape mode on the transposed and 3-D convolutions' rules)
@pytest.mark.parametrize("check", [
    pytest.param(name, marks=pytest.mark.heavy if name == "check_dilated" else ())
    for name in convs.CHECKS["legacy"]])
def test_convolution_rules(check):
    getattr(convs, check)()

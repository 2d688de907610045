"""tests/test_dp_non_float_variables.py's tests under tf.compat.v1.disable_v2_behavior()
(reference variables)."""

# pylint: disable-next=unused-import
from tests.test_dp_non_float_variables import (  # noqa: F401  (collected here too)
    test_dp_optimizer_skips_int64_and_string_variables,
    test_dp_optimizer_refuses_a_var_list_without_float_variables)

"""Run in a process of its own: the checks of tests/test_rules_published.py (the
FusedBatchNorm rule in inference mode, the broadcast elementwise rule, a Keras
BatchNormalization net and a tf_keras.applications network) under
tf.compat.v1.disable_v2_behavior() (legacy shape mode, reference variables), against
the one-example oracle.

Started once per test session by tests/process_checks.py ("published_legacy"); prints
one `pertower-check` line per check and 'published rules checks: N passed, M failed';
exits 1 on failure. With the argument `zoo` ("published_legacy_zoo", heavy), it runs
the zoo's networks instead (tests/test_zoo.py): applications, the layers CNN and the
recurrent language models; and the broadcast rule on every op type.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import tensorflow as tf  # noqa: E402

tf.compat.v1.disable_v2_behavior()

from tests import process_checks  # noqa: E402
from pertower.tools import zoo  # noqa: E402
from tests import test_rules_published as published  # noqa: E402
from tests import test_zoo  # noqa: E402


def check_every_broadcast_op():
    process_checks.require_legacy_mode()
    published.check_every_broadcast_op()


def check_broadcast_pow_and_select_v2():
    """Two of the broadcast ops (Pow: each operand a weight in its turn; SelectV2: the
    two value inputs) on reference variables; every op type of the rule in this mode:
    `check_every_broadcast_op` (heavy, process "published_legacy_zoo"), and each in
    graph mode in tests/test_rules_published.py."""
    process_checks.require_legacy_mode()
    for op_type in ("Pow", "SelectV2"):
        published.check_broadcast_op(op_type)


def check_raw_fused_batch_norms():
    process_checks.require_legacy_mode()
    for op_type in ("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"):
        for data_format in ("NHWC", "NCHW"):
            published.check_raw_fused_batch_norm(op_type, data_format)


def check_keras_batch_norm_net():
    process_checks.require_legacy_mode()
    published.check_keras_batch_norm_net()


def check_zoo_applications():
    process_checks.require_legacy_mode()
    return "\n".join(published.check_application(name)
                     for name in ("mobilenet_v2", "resnet50"))


def check_zoo_fast():
    process_checks.require_legacy_mode()
    return "\n".join(published.check_application(name) for name in zoo.FAST)


def check_zoo_recurrent():
    """The recurrent zoo networks by whatever method their plan picks (batch_size given
    when it falls back), against the loop."""
    process_checks.require_legacy_mode()
    summaries = []
    for name in zoo.RECURRENT:
        built = test_zoo.Built(name, batch_size=2, seed=7)
        try:
            summaries.append(test_zoo.check_network(built))
        finally:
            built.close()
    return "\n".join(summaries)


def check_broadcast_dp_step():
    process_checks.require_legacy_mode()
    published.check_broadcast_dp_step()


if __name__ == "__main__":
    if sys.argv[1:] == ["zoo"]:
        sys.exit(process_checks.run_checks(
            [check_zoo_fast, check_zoo_applications, check_zoo_recurrent,
             check_every_broadcast_op],
            "zoo checks (legacy mode)"))
    sys.exit(process_checks.run_checks(
        [check_broadcast_pow_and_select_v2, check_raw_fused_batch_norms,
         check_keras_batch_norm_net, check_broadcast_dp_step], "published rules checks"))

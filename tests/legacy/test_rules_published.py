"""The checks of tests/test_rules_published.py (the
FusedBatchNorm rule in inference mode, the broadcast elementwise rule, a Keras
BatchNormalization net and a tf_keras.applications network) under
tf.compat.v1.disable_v2_behavior() (legacy shape mode, reference variables), against
the one-example oracle.
"""

import pytest

from benchmarks import zoo
from tests import test_rules_published as published
from tests import test_zoo


@pytest.mark.heavy
def test_every_broadcast_op():
    published.check_every_broadcast_op()


def test_broadcast_pow_and_select_v2():
    """Two of the broadcast ops (Pow: each operand a weight in its turn; SelectV2: the
    two value inputs) on reference variables; every op type of the rule in this mode:
    `test_every_broadcast_op` (heavy, process "published_legacy_zoo"), and each in
    graph mode in tests/test_rules_published.py."""
    for op_type in ("Pow", "SelectV2"):
        published.check_broadcast_op(op_type)


def test_raw_fused_batch_norms():
    for op_type in ("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"):
        for data_format in ("NHWC", "NCHW"):
            published.check_raw_fused_batch_norm(op_type, data_format)


def test_keras_batch_norm_net():
    published.check_keras_batch_norm_net()


@pytest.mark.heavy
def test_zoo_applications():
    print("\n".join(published.check_application(name)
                     for name in ("mobilenet_v2", "resnet50")))


@pytest.mark.heavy
def test_zoo_fast():
    print("\n".join(published.check_application(name) for name in zoo.FAST))


@pytest.mark.heavy
def test_zoo_recurrent():
    """The recurrent zoo networks by whatever method their plan picks (batch_size given
    when it falls back), against the loop."""
    summaries = []
    for name in zoo.RECURRENT:
        built = test_zoo.Built(name, batch_size=2, seed=7)
        try:
            summaries.append(test_zoo.check_network(built))
        finally:
            built.close()
    print("\n".join(summaries))


def test_broadcast_dp_step():
    published.check_broadcast_dp_step()

"""tests/test_vgg_paths.py's `check_forward_form` (the
input gradients as forward convolutions, and a dense layer of `MUL_MIN_COLUMNS`
outputs: the broadcast-Mul outer products) under tf.compat.v1.disable_v2_behavior()
(legacy shape mode, reference variables), against the one-example oracle.
"""


from tests import test_vgg_paths


def test_vgg_paths_legacy():
    test_vgg_paths.check_forward_form(batch=2)

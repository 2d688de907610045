"""A weight read inside a TF1 (v1) tf.compat.v1.cond (Switch and Merge ops) under
tf.compat.v1.disable_v2_behavior(): a reference variable's value, or a resource variable's
value read before the cond, passes a Switch that no rule covers, and the towers give
each branch's gradients (the taken branch's, zeros for the other); a resource variable
whose handle goes to the Switch is refused with the op and the ways out.
"""

import numpy as np
import pytest
import tensorflow as tf

import pertower
from pertower import oracle
from tests import common

B = 4


def _cond_model(variables):
    """ys [B] = sum(tanh(x W)) if flag else sum(sin(x V)), W and V [3, 3] reference
    variables ("ref"), resource variables read before the cond ("read"), or resource
    variables whose handles the branches read ("handle")."""
    common.seed_weights(95)
    x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
    flag = tf.compat.v1.placeholder_with_default(True, [], name="flag")
    resource = variables != "ref"
    w = tf.compat.v1.get_variable("w", [3, 3], use_resource=resource)
    v = tf.compat.v1.get_variable("v", [3, 3], use_resource=resource)
    w_in, v_in = (w.read_value(), v.read_value()) if variables == "read" else (w, v)
    h = tf.compat.v1.cond(flag, lambda: tf.tanh(x @ w_in), lambda: tf.sin(x @ v_in))
    return x, flag, tf.reduce_sum(h, axis=1), [w, v]


@pytest.mark.parametrize("variables", ["ref", "read"])
def test_a_weight_read_in_a_v1_cond_gets_each_branchs_gradients_from_the_towers(variables):
    with tf.Graph().as_default() as graph:
        x, flag, ys, xs = _cond_model(variables)
        plan = pertower.explain(ys, xs, batch_size=B)
        assert [w.method for w in plan.weights] == ["towers", "towers"], str(plan)
        assert all("(Switch)" in w.reason for w in plan.weights), str(plan)
        grads = pertower.per_example_gradients(ys, xs, batch_size=B)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for taken in (True, False):
                feed = {x: np.random.RandomState(96).randn(B, 3), flag: taken}
                want = oracle.loop_per_example_gradients(sess, ys, xs, feed)
                assert np.any(want[0 if taken else 1]) and not np.any(want[1 if taken else 0])
                common.assert_all_close(sess.run(grads, feed), want,
                                        what=f"v1 cond ({variables}), flag={taken}")


def test_a_resource_handle_read_in_a_v1_cond_is_refused_with_the_ways_out():
    with tf.Graph().as_default():
        _, _, ys, xs = _cond_model("handle")
        for build in (pertower.explain, pertower.per_example_gradients):
            with pytest.raises(NotImplementedError) as caught:
                build(ys, xs, batch_size=B)
            message = str(caught.value)
            assert message.startswith(f"pertower.{build.__name__}: the weight 'w:0' is read "
                                      "inside a TF1 (v1) tf.compat.v1.cond"), message
            assert "(Switch)" in message and "w.read_value()" in message, message
            assert "enable_control_flow_v2()" in message and "`xs`" in message, message

"""Examples that mix: the static scan's refusals (with their words), what it allows
(checked against the oracle), `validate=True` and `check_independence`."""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import pertower
from pertower import _graph_walk as graph_walk
from pertower import _batch_axis
from pertower import oracle
from tests import cases
from tests import common

B = 4


def _hidden(x):
    """A weight-dependent [B, 3] activation of the batch x [B, 3]."""
    w = tf.compat.v1.get_variable("w", [3, 3], initializer=tf.keras.initializers.Orthogonal(seed=1))
    return tf.tanh(tf.matmul(x, w)), w


def _per_example(t):
    """[B, ...] -> [B], summing the non-batch axes."""
    return tf.reduce_sum(t, axis=list(range(1, t.shape.rank))) if t.shape.rank > 1 else t


# (id, f(h) -> [B, ...] built from the [B, 3] activation h, words the refusal must say)
COUPLING_CASES = [
    ("moments_axis_0", lambda h: h - tf.nn.moments(h, axes=[0])[0],
     r"'moments/mean' \(Mean\).*reduces \(Mean\) over axis 0, the batch axis.*training=False"),
    ("reduce_sum_axis_0", lambda h: h - tf.reduce_sum(h, axis=0, keepdims=True),
     r"\(Sum\).*reduces \(Sum\) over axis 0, the batch axis.*non-batch axes"),
    ("reduce_max_after_transpose", lambda h: h[:, 0] - tf.reduce_max(tf.transpose(h), axis=1)[0],
     r"\(Max\).*reduces \(Max\) over axis 1, the batch axis"),
    ("reduce_mean_all_axes", lambda h: h - tf.reduce_mean(h),
     r"\(Mean\).*over axis 0, the batch axis"),
    ("x_transpose_x", lambda h: tf.matmul(h, tf.matmul(h, h, transpose_a=True)),
     r"\(MatMul\).*contracts \(sums over\) axis 0, the batch axis.*x\^T x"),
    ("x_x_transpose", lambda h: tf.matmul(h, h, transpose_b=True),
     r"\(MatMul\).*across examples \(e.g. x x\^T\)"),
    ("einsum_over_batch", lambda h: h * tf.reduce_sum(tf.einsum("bi,bj->ij", h, h)),
     r"\(Einsum\).*sums over the einsum index 'b' of 'bi,bj->ij'"),
    ("softmax_axis_0", lambda h: tf.nn.softmax(h, axis=0),
     r"\(Softmax\).*normalizes \(Softmax\) along its last axis, which is axis 1, the batch axis"),
    ("cumsum_axis_0", lambda h: tf.cumsum(h, axis=0),
     r"\(Cumsum\).*accumulates \(Cumsum\) along axis 0, the batch axis"),
    ("sort_axis_0", lambda h: tf.sort(h, axis=0),
     r"\(TopKV2\).*sorts or ranks"),
    ("top_k_over_batch", lambda h: tf.transpose(tf.math.top_k(tf.transpose(h), k=B).values),
     r"\(TopKV2\).*sorts or ranks.*axis 1, the batch axis"),
    ("reverse_axis_0", lambda h: tf.reverse(h, axis=[0]),
     r"\(ReverseV2\).*reverses the order of the examples"),
    ("roll_axis_0", lambda h: tf.roll(h, shift=1, axis=0),
     r"\(Roll\).*shifts examples to other positions"),
    ("gather_examples", lambda h: tf.gather(h, [3, 2, 1, 0]),
     r"\(GatherV2\).*gathers along axis 0, the batch axis.*picking examples by index"),
    ("minus_first_example", lambda h: h - h[0],
     r"\(StridedSlice\).*indexes axis 0, the batch axis.*takes one example"),
    ("pairwise_differences", lambda h: tf.reduce_sum((h[:, None, :] - h[None, :, :]) ** 2, 1),
     r"\(Sub\).*pairing every example with every other"),
    ("argmax_axis_0", lambda h: h * tf.cast(tf.argmax(h, axis=0), h.dtype),
     r"\(ArgMax\).*ArgMax over axis 0, the batch axis"),
    ("l2_loss", lambda h: h + tf.nn.l2_loss(h),
     r"\(L2Loss\).*sums the squares of every entry"),
    ("slice_first_rows", lambda h: tf.concat([h[:2], h[:2]], axis=0),
     r"\(StridedSlice\).*selects examples by their position"),
    ("batch_mean_inside_cond", lambda h: tf.cond(
        tf.compat.v1.placeholder_with_default(True, []),
        lambda: h - tf.reduce_mean(h, axis=0), lambda: h),
     r"\((Stateless)?If\).*runs the function .*reduces \(Mean\) over axis 0, the batch axis"),
    ("flatten_then_reduce_batch_major_axis",
     lambda h: h - tf.reduce_mean(tf.reshape(h, [-1]), axis=0),
     r"\(Mean\).*over axis 0, the batch axis"),
]


@pytest.mark.parametrize("build,words", [c[1:] for c in COUPLING_CASES],
                         ids=[c[0] for c in COUPLING_CASES])
def test_coupling_op_is_refused_with_its_words(build, words):
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        h, w = _hidden(x)
        ys = _per_example(build(h))
        with pytest.raises(ValueError, match=words) as refusal:
            pertower.per_example_gradients(ys, [w], batch_size=B)
    assert "between the batch and `ys` couples the examples of the batch" in str(refusal.value)


def _image_batch_norm_model(training):
    x = tf.compat.v1.placeholder(tf.float32, [None, 6, 6, 2], name="images")
    model = keras.Sequential([keras.layers.Conv2D(3, 3, input_shape=(6, 6, 2)),
                              keras.layers.BatchNormalization(),
                              keras.layers.Flatten(), keras.layers.Dense(1)])
    out = model(x, training=training)
    return x, model, out


def test_fused_batch_norm_in_training_mode_is_refused():
    with tf.Graph().as_default():
        _, model, out = _image_batch_norm_model(training=True)
        with pytest.raises(ValueError, match=r"\(FusedBatchNormV3\) between the batch and `ys` "
                                             r"couples the examples.*is_training=True.*"
                                             r"training=False.*LayerNormalization"):
            pertower.per_example_gradients(out, model.trainable_weights, batch_size=B)


def test_batch_norm_in_the_learning_phase_is_refused():
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 5], name="x")
        model = keras.Sequential([keras.layers.Dense(4), keras.layers.BatchNormalization(),
                                  keras.layers.Dense(1)])
        out = model(x)  # no training argument: the symbolic learning phase decides
        with pytest.raises(ValueError, match=r"batch_normalization/moments/mean.*reduces "
                                             r"\(Mean\) over axis 0.*training=False"):
            pertower.per_example_gradients(out, model.trainable_weights, batch_size=B)


def test_check_independence_raises_the_scan_refusal():
    with tf.Graph().as_default():
        _, _, out = _image_batch_norm_model(training=True)
        with pytest.raises(ValueError, match=r"pertower.check_independence: .*FusedBatchNormV3"):
            pertower.check_independence(out, batch_size=B)


def test_batch_norm_in_inference_mode_matches_the_oracle():
    with tf.Graph().as_default() as graph:
        x, model, out = _image_batch_norm_model(training=False)
        bn = model.layers[1]
        sess = tf.compat.v1.Session(graph=graph)
        sess.run(tf.compat.v1.global_variables_initializer())
        # moving statistics away from 0 and 1, so inference mode is not an identity
        sess.run([bn.moving_mean.assign([0.3, -0.2, 0.1]),
                  bn.moving_variance.assign([2.0, 0.5, 1.5])])
        xs = model.trainable_weights
        got = pertower.per_example_gradients(out, xs, batch_size=B, validate=True)
        feed = {x: np.random.RandomState(0).randn(B, 6, 6, 2).astype(np.float32)}
        want = oracle.loop_per_example_gradients(sess, out, xs, feed)
        common.assert_all_close(sess.run(got, feed), want, kind="deep", what="BN inference")
        sess.close()


def test_one_microbatch_may_couple_its_examples():
    """With M = 1 the microbatch is the whole batch: coupling changes nothing, so BN in
    training mode is allowed and gives the batch gradient."""
    with tf.Graph().as_default() as graph:
        x, model, out = _image_batch_norm_model(training=True)
        xs = model.trainable_weights
        (got,) = [pertower.microbatch_gradients(out, xs, num_microbatches=1, batch_size=B)]
        want = tf.gradients(tf.reduce_sum(out), xs)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            feed = {x: np.random.RandomState(1).randn(B, 6, 6, 2).astype(np.float32)}
            got_values, want_values = sess.run([got, want], feed)
        common.assert_all_close([g[0] for g in got_values], want_values, kind="deep",
                                what="one microbatch with BN training")


# Graphs the scan must accept: (id, f(h) -> [B, ...]).
ALLOWED_CASES = [
    ("reductions_over_features", lambda h: tf.reduce_max(h, axis=1) - tf.reduce_mean(h, 1)),
    ("softmax_over_features", lambda h: tf.nn.softmax(h) * h),
    ("moments_over_features", lambda h: h - tf.nn.moments(h, axes=[1], keepdims=True)[0]),
    ("x_x_per_example", lambda h: tf.einsum("bi,bj->bij", h, h)),
    ("reshape_and_back", lambda h: tf.reshape(tf.reshape(h, [-1, 1]) * 2.0, [-1, 3])),
    ("transpose_and_back", lambda h: tf.transpose(tf.cumsum(tf.transpose(h), axis=0))),
    ("gather_features", lambda h: tf.gather(h, [2, 0], axis=1)),
    ("stack_and_unstack", lambda h: tf.stack(tf.unstack(h, axis=1)[::-1], axis=1)),
]


@pytest.mark.parametrize("build", [c[1] for c in ALLOWED_CASES],
                         ids=[c[0] for c in ALLOWED_CASES])
def test_per_example_graphs_are_accepted_and_match_the_oracle(build):
    with tf.Graph().as_default() as graph:
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        h, w = _hidden(x)
        ys = _per_example(build(h))
        got = pertower.per_example_gradients(ys, [w], batch_size=B, validate=True)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            feed = {x: np.random.RandomState(2).randn(B, 3).astype(np.float32)}
            want = oracle.loop_per_example_gradients(sess, ys, [w], feed)
            common.assert_all_close(sess.run(got, feed), want, kind="tight", what="allowed graph")


def test_find_couplings_lists_every_coupling_in_graph_order():
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        first = tf.cumsum(x, axis=0, name="first")
        second = tf.reduce_sum(x * 2.0, axis=0, keepdims=True, name="second")
        ys = tf.reduce_sum(first - second, axis=1)
        ops = {op for op in tf.compat.v1.get_default_graph().get_operations()
               if op.type not in ("Placeholder", "Const")}
        couplings = _batch_axis.find_couplings(ops, [x])
        assert [c.op.name for c in couplings] == ["first", "second"]
        assert "accumulates" in couplings[0].reason and "reduces (Sum)" in couplings[1].reason
        del ys


def _mix_rows(h):
    """h - mean of h over the batch, in numpy: the static scan cannot see inside."""
    return h - np.mean(h, axis=0, keepdims=True)


def _py_function_model():
    """ys = sum(w * py_function(mix rows of x)): couples examples behind a py_function."""
    x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
    w = tf.compat.v1.get_variable("w", [3], initializer=tf.ones_initializer())
    mixed = tf.numpy_function(_mix_rows, [x], tf.float32)
    mixed.set_shape([None, 3])
    ys = tf.reduce_sum(w * mixed, axis=1)  # [B]
    return x, w, ys


def _segment_sum_model():
    """ys built with SegmentSum over the batch axis, an op the scan does not list."""
    x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
    w = tf.compat.v1.get_variable("w", [3], initializer=tf.ones_initializer())
    same_segment = tf.zeros_like(x[:, 0], dtype=tf.int32)           # [B] zeros
    batch_sum = tf.math.segment_sum(x * w, same_segment)              # [1, 3]
    ys = tf.reduce_sum(x * w - tf.gather(batch_sum, same_segment), axis=1)  # [B]
    return x, w, ys


@pytest.mark.parametrize("model", [_py_function_model, _segment_sum_model],
                         ids=["numpy_function", "segment_sum"])
def test_validate_catches_coupling_the_scan_cannot_see(model):
    with tf.Graph().as_default() as graph:
        x, w, ys = model()
        got = pertower.per_example_gradients(ys, [w], batch_size=B, validate=True)
        check = pertower.check_independence(ys, batch_size=B)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            feed = {x: np.arange(B * 3, dtype=np.float32).reshape(B, 3)}
            with pytest.raises(tf.errors.InvalidArgumentError,
                               match=r"validate=True\): `ys` .* recomputed one slice of the "
                                     r"batch at a time differs from `ys` by up to"):
                sess.run(got, feed)
            independent, worst, rows = sess.run(
                [check.independent, check.max_difference, check.per_example_difference], feed)
            assert not independent
            assert worst > 1.0 and rows.shape == (B,) and np.all(rows > 0)


def test_check_independence_is_true_for_independent_examples():
    case = cases.build_cnn(B=3)
    with case.graph.as_default():
        check = pertower.check_independence(case.ys, batch_size=case.B)
        two_slices = pertower.check_independence(case.ys, batch_size=case.B, num_microbatches=1)
    independent, worst, bound = case.sess.run(
        [check.independent, check.max_difference, check.bound], case.feed)
    assert independent and worst <= bound and check.tolerance == 1e-4
    assert check.towers.num_towers == 3 and case.sess.run(two_slices.independent, case.feed)
    case.sess.close()


def test_check_independence_with_microbatches_sees_coupling_within_them():
    """A coupling within each microbatch of two shows with num_microbatches=2 (B = 4)."""
    with tf.Graph().as_default() as graph:
        x, _, ys = _py_function_model()
        check = pertower.check_independence(ys, batch_size=B, num_microbatches=2)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            feed = {x: np.arange(B * 3, dtype=np.float32).reshape(B, 3)}
            assert not sess.run(check.independent, feed)


def test_validate_passes_and_matches_the_oracle_on_an_ordinary_model():
    case = cases.build_embedding(B=4)
    with case.graph.as_default():
        got = pertower.per_example_gradients(case.ys, case.xs, batch_size=case.B,
                                             validate=True)
        norms = pertower.per_example_norms(case.ys, case.xs, batch_size=case.B, validate=True)
        jac = pertower.per_example_jacobians(case.outputs, case.xs, batch_size=case.B,
                                             validate=True)
        want = oracle.loop_per_example_gradients(case.sess, case.ys, case.xs, case.feed)
        want_jac = oracle.loop_per_example_jacobians(case.sess, case.outputs, case.xs, case.feed)
    got_values, norm_values, jac_values = case.sess.run([got, norms, jac], case.feed)
    common.assert_all_close(got_values, want, case.rtol, case.atol, "validate=True")
    common.assert_all_close(jac_values, want_jac, case.rtol, case.atol, "validate=True jac")
    want_norms = np.sqrt(sum(np.sum(np.reshape(g, (case.B, -1)) ** 2, axis=1) for g in want))
    np.testing.assert_allclose(norm_values, want_norms, rtol=1e-5)
    case.sess.close()


L = keras.layers
# Keras layer stacks the scan must follow: (id, input shape, layers).
LAYER_STACKS = [
    ("conv_global_pool", [8, 8, 3], lambda: [L.Conv2D(4, 3), L.GlobalAveragePooling2D()]),
    ("upsample_pad_crop_pool", [6, 6, 2], lambda: [
        L.UpSampling2D(), L.ZeroPadding2D(1), L.Cropping2D(1), L.Conv2D(2, 3),
        L.MaxPooling2D(), L.AveragePooling2D(), L.Flatten()]),
    ("separable_transpose_conv", [6, 6, 2], lambda: [
        L.DepthwiseConv2D(3), L.SeparableConv2D(2, 3), L.Conv2DTranspose(2, 3, strides=2),
        L.Flatten()]),
    ("conv1d_global_max", [9, 3], lambda: [L.Conv1D(4, 3), L.GlobalMaxPooling1D()]),
    ("time_distributed", [5, 3], lambda: [L.TimeDistributed(L.Dense(4)), L.Flatten()]),
    ("permute_reshape_repeat", [4, 3], lambda: [L.Permute((2, 1)), L.Reshape((12,)),
                                                L.RepeatVector(2), L.Flatten()]),
    ("group_norm", [6, 6, 4], lambda: [L.GroupNormalization(2), L.Flatten()]),
    ("layer_norms", [5, 4], lambda: [L.LayerNormalization(), L.Dense(3),
                                     L.LayerNormalization(axis=[1, 2]), L.Flatten()]),
    ("lstm_unrolled", [5, 3], lambda: [L.LSTM(4, unroll=True)]),
    ("lstm_while_loop", [5, 3], lambda: [L.LSTM(4)]),
    ("gru_sequences", [5, 3], lambda: [L.GRU(4, return_sequences=True), L.Flatten()]),
    ("dropout_in_learning_phase", [5], lambda: [L.Dense(4), L.Dropout(0.3)]),
    ("attention", [5, 4], None),
]


def _replayed(ys, batch):
    return graph_walk.downstream_ops(batch, graph_walk.upstream_ops([ys]))


@pytest.mark.parametrize("shape,layers", [c[1:] for c in LAYER_STACKS],
                         ids=[c[0] for c in LAYER_STACKS])
def test_the_scan_follows_the_batch_axis_through_keras_layers(shape, layers):
    """No coupling in the stack itself, and a batch mean after it is still found (so
    the scan did not lose the batch axis on the way)."""
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None] + shape, name="x")
        if layers is None:
            out = L.Flatten()(L.MultiHeadAttention(2, 3)(x, x))
        else:
            out = keras.Sequential(layers())(x)
        ys = tf.reduce_sum(out, axis=1)                               # [B]
        assert _batch_axis.find_couplings(_replayed(ys, [x]), [x]) == []
        mixed = ys - tf.reduce_mean(ys, name="batch_mean")
        found = _batch_axis.find_couplings(_replayed(mixed, [x]), [x])
        assert [c.op.name for c in found] == ["batch_mean"]


def test_batch_norm_training_after_an_lstm_loop_is_refused():
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 5, 3], name="x")
        norm = L.BatchNormalization()
        ys = tf.reduce_sum(norm(L.LSTM(4)(x), training=True), axis=1)
        with pytest.raises(ValueError, match=r"batch_normalization/moments/mean.*reduces "
                                             r"\(Mean\) over axis 0.*training=False"):
            pertower.per_example_gradients(ys, norm.trainable_weights, batch_size=B)


def test_a_batch_mean_inside_a_while_loop_is_refused():
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        h, w = _hidden(x)
        _, out = tf.while_loop(lambda i, h: i < 3,
                               lambda i, h: (i + 1, tf.tanh(h - tf.reduce_mean(h, axis=0))),
                               [0, h])
        with pytest.raises(ValueError, match=r"\((Stateless)?While\).*runs the function "
                                             r".*reduces \(Mean\) over axis 0"):
            pertower.per_example_gradients(tf.reduce_sum(out, 1), [w], batch_size=B)


def test_fused_batch_norm_in_the_learning_phase_is_refused_before_its_cond_reads():
    """In the learning phase a fused BatchNormalization is a tf.cond whose branches read
    gamma and beta; the coupling is reported (not the weights read inside the cond)."""
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 6, 6, 2], name="images")
        model = keras.Sequential([keras.layers.Conv2D(3, 3), keras.layers.BatchNormalization(),
                                  keras.layers.Flatten(), keras.layers.Dense(1)])
        out = model(x)
        with pytest.raises(ValueError, match=r"\((Stateless)?If\) between the batch and `ys` "
                                             r"couples.*runs the function .*FusedBatchNormV3.*"
                                             r"is_training=True.*training=False"):
            pertower.per_example_gradients(out, model.trainable_weights, batch_size=B)


def test_v1_select_with_a_row_condition_and_identity_n_keep_the_batch_axis():
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        rows = tf.compat.v1.where(x[:, 0] > 0, x, -x)                # Select: [B] picks rows
        (passed, _) = tf.identity_n([rows, x])
        ys = tf.reduce_sum(passed, axis=1)
        assert _batch_axis.find_couplings(_replayed(ys, [x]), [x]) == []
        mixed = tf.reduce_sum(passed, axis=0, name="over_batch")
        assert [c.op.name for c in _batch_axis.find_couplings(_replayed(mixed, [x]), [x])] == [
            "over_batch"]

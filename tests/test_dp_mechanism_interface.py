"""One noise-mechanism interface (`pertower._dp.mechanism`): `BandedMFNoise` through
pertower.keras' fit against the one-example loop (σ = 0) and across an HDF5 save, Keras
configs holding the mechanism (and refusing one they cannot rebuild), and the refusals
of `DPOptimizer`/`DPSyncReplicasOptimizer` for mechanisms where they do not apply.
(`DPSyncReplicasOptimizer(mechanism=BandedMFNoise)` against the loop: the one-worker
fixture of tests/test_dp_distributed.py.)
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import pertower
import pertower.keras as dp_keras
from pertower._dp import mechanism as mechanism_lib
from pertower._dp import tree as tree_lib
from tests import common
from tests.test_keras_fit import CLIP, LR, _data, _fit_one_step, _model


def test_banded_noise_through_keras_fit_is_sgd_on_the_loops_clipped_mean():
    """σ = 0, 3 bands, 2 accumulated runs make the step (the release in the tf.cond):
    the loop's clipped mean step."""
    before, after, update = _fit_one_step("dense", accumulation_steps=2,
                                          mechanism=pertower.BandedMFNoise(3, seed=1))
    assert any(np.any(g != 0) for g in update)
    common.assert_all_close(after, [w - LR * g for w, g in zip(before, update)],
                            what="weights after one banded fit step", kind="deep")


def test_a_keras_model_saved_mid_run_resumes_the_banded_noise(tmp_path):
    """σ = 1, 3 bands: 2 fit steps, HDF5 save, load_model (the mechanism rebuilt from
    the config, its step and buffer from the optimizer's weights), 1 more step: the
    weights of 3 uninterrupted steps."""
    x, y = _data("dense", np.random.RandomState(5))
    fit = dict(batch_size=2, epochs=1, shuffle=False, verbose=0)

    def model():
        common.seed_weights(5)
        built = _model("dense")
        built.compile(optimizer=dp_keras.DPKerasSGDOptimizer(
            CLIP, 1.0, mechanism=pertower.BandedMFNoise(3, seed=5), learning_rate=LR),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return built

    with tf.Graph().as_default():
        uninterrupted = model()
        uninterrupted.fit(x, y, **fit)
        want = uninterrupted.get_weights()
    with tf.Graph().as_default():
        first = model()
        first.fit(x[:4], y[:4], **fit)
        first.save(str(tmp_path / "model.h5"))
    with tf.Graph().as_default():
        cls = dp_keras.DPKerasSGDOptimizer
        loaded = keras.models.load_model(str(tmp_path / "model.h5"),
                                         custom_objects={cls.__name__: cls})
        loaded.fit(x[4:], y[4:], **fit)
        common.assert_all_close(loaded.get_weights(), want, what="resumed banded run",
                                kind="deep")


@pytest.mark.parametrize("mechanism", [
    pertower.BandedMFNoise(2, seed=4),
    pertower.BandedMFNoise(2, factorization=[[1.0, 0.0, 0.0], [0.5, 2.0, 0.0],
                                             [0.0, 0.25, 1.0]])])
def test_keras_config_round_trips_the_mechanism(mechanism):
    with tf.Graph().as_default():
        optimizer = dp_keras.DPKerasSGDOptimizer(1.0, 1.1, mechanism=mechanism,
                                                 learning_rate=0.1)
        config = optimizer.get_config()
        assert config["seed"] is None
        assert config["mechanism"]["class_name"] == "BandedMFNoise"
        again = dp_keras.DPKerasSGDOptimizer.from_config(config)
    rebuilt = again._dp.mechanism   # pylint: disable=protected-access
    assert type(rebuilt) is pertower.BandedMFNoise and rebuilt is not mechanism
    assert rebuilt.get_config() == mechanism.get_config()
    np.testing.assert_allclose(rebuilt.matrix(3), mechanism.matrix(3), rtol=1e-12)


def test_ftrl_config_keeps_its_tree_and_no_mechanism_entry():
    with tf.Graph().as_default():
        optimizer = dp_keras.DPFTRLTreeAggregationOptimizer(
            1.0, 1.0, None, restart_period=4, restart_warmup=2, noise_seed=9,
            learning_rate=0.1)
        config = optimizer.get_config()
        assert "mechanism" not in config and "seed" not in config
        assert (config["noise_seed"], config["restart_period"], config["restart_warmup"],
                config["efficient_tree"]) == (9, 4, 2, True)
        tree = dp_keras.DPFTRLTreeAggregationOptimizer.from_config(config)._dp.mechanism
    assert isinstance(tree, tree_lib.TreeNoise)
    assert tree.get_config() == dict(seed=9, restart_period=4, restart_warmup=2,
                                     efficient=True)


class _CustomNoise:
    seed = None

    def add(self, gradients, stddevs):
        return list(gradients)

    def key(self):
        return tf.zeros([2], tf.int64)


def test_a_custom_mechanism_trains_but_its_config_is_refused():
    with tf.Graph().as_default():
        optimizer = dp_keras.DPKerasSGDOptimizer(1.0, 1.0, mechanism=_CustomNoise())
        with pytest.raises(ValueError, match=r"a config cannot hold the mechanism "
                                             r"_CustomNoise .*model.save_weights"):
            optimizer.get_config()
    with pytest.raises(ValueError, match=r"`mechanism` as a dict must be"):
        mechanism_lib.from_config({"class_name": "Mine", "config": {}})


def _sgd():
    return tf.compat.v1.train.GradientDescentOptimizer(0.1)


@pytest.mark.parametrize("build, words", [
    (lambda: pertower.DPOptimizer(_sgd(), 1.0, 1.0, clipping="per_layer",
                                  mechanism=tree_lib.TreeNoise(1)),
     r"DPOptimizer: the tree's noise \(DP-FTRL\) needs flat clipping .*per_layer"),
    (lambda: pertower.DPOptimizer(_sgd(), 1.0, 1.0, seed=3,
                                  mechanism=pertower.BandedMFNoise(2)),
     r"DPOptimizer: `seed` \(3\) is for the default Gaussian noise"),
    (lambda: pertower.DPSyncReplicasOptimizer(
        _sgd(), 1.0, 1.0, 2, noise="split", task_index=0,
        mechanism=pertower.BandedMFNoise(2)),
     r"DPSyncReplicasOptimizer: noise=\"split\" adds independent Gaussian shares .*"
     r"BandedMFNoise"),
    (lambda: pertower.DPSyncReplicasOptimizer(
        pertower.DPFTRLOptimizer(1.0, 1.0, 0.1), 1.0, 1.0, 1,
        mechanism=pertower.BandedMFNoise(2)),
     r"DPSyncReplicasOptimizer: with a DPFTRLOptimizer as `optimizer`.*mechanism=None"),
    (lambda: pertower.DPSyncReplicasOptimizer(_sgd(), 1.0, 1.0, 1, seed=2,
                                              mechanism=pertower.BandedMFNoise(2)),
     r"DPSyncReplicasOptimizer: `seed` \(2\) is for the default Gaussian noise")])
def test_mechanisms_are_refused_where_they_do_not_apply(build, words):
    with tf.Graph().as_default():
        with pytest.raises(ValueError, match="^pertower." + words):
            build()

"""The tests of this folder run as a pytest session of their own with TensorFlow 2 as a
new user starts it: eager execution on, `tf.keras` is Keras 3 (TF_USE_LEGACY_KERAS
unset) and TensorFlow's oneDNN kernels on (TF_ENABLE_ONEDNN_OPTS=1: the default on
CPUs with AVX-512, forced here so that the rules' oneDNN paths run on every CPU). Both
variables are read when TensorFlow is imported: this file sets them when pytest imports
it, before any test module imports TensorFlow (`python -m pytest tests/eager`; see
tests/conftest.py). A test that needs graph mode builds its graph in a `tf.Graph` of its
own."""

import os

os.environ.pop("TF_USE_LEGACY_KERAS", None)
os.environ["TF_ENABLE_ONEDNN_OPTS"] = "1"

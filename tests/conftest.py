"""Test set-up: graph mode for the whole process, before any test imports TensorFlow.

Tests that need another process-wide mode (eager, or disable_v2_behavior) run a
script from tests/scripts/ in a subprocess.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import tensorflow as tf  # noqa: E402  (the environment must be set first)

tf.compat.v1.disable_eager_execution()

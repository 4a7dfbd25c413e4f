"""Test set-up shared by every test in this process.

The in-process tests see two logical CPUs so that `"mirrored"` runs two real
replicas with real cross-device reductions. This must happen before
TensorFlow initialises its devices, i.e. at import of this conftest.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    _cpu, [tf.config.LogicalDeviceConfiguration()] * 2
)

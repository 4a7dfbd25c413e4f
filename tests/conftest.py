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


# -- launches shared by several test modules -------------------------------------------

import pytest  # noqa: E402

from helpers import KERAS_FEATURES_WORKER, ZOO_PROCESS_PATTERNS, launch  # noqa: E402

_FEATURE_PROBES = ("metric_objects", "unseeded_shuffle", "load_model", "batch_norm",
                   "seeded_shuffle", "sparse_input", "pydataset_workers", "ragged_input",
                   "metric_aggregation", "adapted_per_worker", "vocabulary_per_worker",
                   "replica_dropout")


@pytest.fixture(scope="session")
def probes(tmp_path_factory):
    """One `keras-distrib launch -n 2` of tests/workers/keras_features.py
    under `multi_worker`: every Keras-feature probe and the model zoo's
    multi-process patterns."""
    out = tmp_path_factory.mktemp("keras_features")
    launch(out, 2, KERAS_FEATURES_WORKER, "--out", str(out),
           "--probes", ",".join(_FEATURE_PROBES + ("zoo",)),
           "--zoo", ",".join(ZOO_PROCESS_PATTERNS["multi_worker"]), timeout=540)
    return out


@pytest.fixture(scope="session")
def horovod_probes(tmp_path_factory):
    """The same under `horovod`, 2 ranks (Gloo): the probes of the
    `BY_STRATEGY` tests and the zoo's patterns."""
    pytest.importorskip("horovod.tensorflow")
    out = tmp_path_factory.mktemp("keras_features_horovod")
    launch(out, 2, KERAS_FEATURES_WORKER, "--out", str(out), "--probes",
           "sparse_input,ragged_input,metric_aggregation,adapted_per_worker,"
           "vocabulary_per_worker,replica_dropout,zoo",
           "--zoo", ",".join(ZOO_PROCESS_PATTERNS["horovod"]),
           "--strategy", "horovod", launch_flags=("--backend", "horovod"), timeout=540)
    return out

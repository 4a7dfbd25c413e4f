"""What the examples share: the digits data, logical CPUs, epoch timing.

The data set is the UCI 8x8 handwritten digits (1797 images) in
`examples/data/digits.csv.gz`, the copy scikit-learn bundles: nothing is
downloaded, and no scikit-learn is needed (Keras imports scikit-learn
whenever it is installed, which costs every process start almost a second).
"""

import gzip
import os
import time

import keras
import numpy as np
import tensorflow as tf


class EpochTimer(keras.callbacks.Callback):
    """Wall time of every training epoch."""

    def __init__(self):
        super().__init__()
        self.seconds = []

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.perf_counter() - self._start)


def split_devices(logical_cpus):
    """With no GPU, splits the CPU into `logical_cpus` logical devices (before
    TensorFlow starts)."""
    if logical_cpus and not tf.config.list_physical_devices("GPU"):
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * logical_cpus
        )


DIGITS_CSV = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "digits.csv.gz")


def digits_arrays():
    """(x, y): the 1797 images as float64 pixels 0..16 (64 columns) and their
    int64 labels, as scikit-learn's `load_digits(return_X_y=True)` gives them."""
    with gzip.open(DIGITS_CSV, "rt") as f:
        data = np.loadtxt(f, delimiter=",")
    return data[:, :-1], data[:, -1].astype("int64")


def load_digits(validation_fraction, seed):
    """((x, y), (x_val, y_val)): pixels scaled to [0, 1], shuffled by `seed`."""
    x, y = digits_arrays()
    x = (x / 16.0).astype("float32")
    y = y.astype("int32")
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    n_val = int(len(x) * validation_fraction)
    return (x[n_val:], y[n_val:]), (x[:n_val], y[:n_val])

"""`tpu`: no TPU build of TensorFlow 2.21 exists, so creating it is a clear
error here; the static-shape input checks it applies are tested directly."""

import numpy as np
import pytest
import tensorflow as tf

import keras_distrib as kd
from keras_distrib.strategies import tpu


@pytest.mark.parametrize("address", [None, "local"])
def test_no_tpu_is_a_one_line_error(address):
    with pytest.raises(tpu.TPUUnavailableError) as raised:
        kd.strategies.get("tpu", tpu=address)
    message = str(raised.value)
    assert "\n" not in message
    assert "found no TPU" in message and "TensorFlow build with TPU support" in message
    assert tf.__version__ in message and "'mirrored'" in message
    assert isinstance(raised.value, ValueError)


def test_listed_with_its_requirement():
    assert "TPU support" in kd.strategies.available()["tpu"]


def test_static_batches_pass():
    x = np.zeros((64, 3), "float32")
    tpu.check_static_batches(x, 32)
    tpu.check_static_batches((x, x[:, 0]), 16)
    tpu.check_static_batches(
        tf.data.Dataset.from_tensor_slices(x).batch(8, drop_remainder=True), None
    )


def test_partial_last_batch_of_arrays_is_an_error():
    with pytest.raises(
        ValueError, match=r"203 samples leave a last batch of 11 with batch_size=32"
    ):
        tpu.check_static_batches(np.zeros((203, 3)), 32)


def test_dynamic_batch_dimension_of_dataset_is_an_error():
    dataset = tf.data.Dataset.from_tensor_slices(np.zeros((10, 3))).batch(4)
    with pytest.raises(ValueError, match="drop_remainder=True"):
        tpu.check_static_batches(dataset, None)

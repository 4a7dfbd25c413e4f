"""Each replica draws its own random numbers (keras_distrib.replica_seeds).

Every replica holds an equal copy of each layer's `SeedGenerator` state and
advanced it equally, so row i of every replica's shard got the same dropout
mask; one device gives each row of the global batch its own. The checks are
statistics one device passes too (its run is the control in each test).
Two workers: tests/test_keras_features_multi_worker.py (probe
`replica_dropout`).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_distrib as kd
from keras_distrib import replica_seeds

FEATURES = 64
REPLICATING = ["single", "mirrored", "central_storage"]  # single: the control


class MCDropout(keras.layers.Dropout):
    """Dropout also in `predict`: Keras's recipe for Monte Carlo dropout."""

    def call(self, inputs, training=None):
        return super().call(inputs, training=True)


def _agreement(rows_a, rows_b) -> float:
    """The fraction of entries where two blocks of rows drop the same inputs."""
    return float(np.mean((rows_a == 0) == (rows_b == 0)))


@pytest.mark.parametrize("strategy", REPLICATING)
def test_monte_carlo_dropout_rows_differ_between_replicas(strategy):
    inputs = keras.Input((FEATURES,))
    model = kd.DistributedModel(inputs, MCDropout(0.5)(inputs), strategy=strategy)
    masks = model.predict(np.ones((32, FEATURES), "float32"), batch_size=32, verbose=0)
    # The two replicas' rows (one device: the two halves of its batch).
    # Independent masks agree on about half the entries (1,024 of them:
    # 0.5 +- 0.016); the same mask on all of them (before: 1.0).
    assert 0.4 < _agreement(masks[:16], masks[16:]) < 0.6
    assert 0.4 < float(np.mean(masks == 0)) < 0.6


@pytest.mark.parametrize("strategy", REPLICATING)
def test_dropout_masks_in_training_differ_between_replicas(strategy):
    """One SGD step (learning rate 1) of the mean absolute output of
    `Dense(1, kernel ones, no bias)` after `Dropout(0.5)` on rows of ones:
    kernel[j] moves by (rows keeping input j) / 16 on the batch of 32. With
    one mask for both replicas every count was twice one replica's, even for
    all 64 inputs (by chance: 2**-64)."""
    inputs = keras.Input((FEATURES,))
    dense = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")
    model = kd.DistributedModel(inputs, dense(keras.layers.Dropout(0.5)(inputs)),
                                strategy=strategy)
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mae")
    model.fit(np.ones((32, FEATURES), "float32"), np.zeros((32, 1), "float32"),
              batch_size=32, epochs=1, shuffle=False, verbose=0)
    kept = np.rint(16 * (1 - model.get_weights()[0][:, 0])).astype(int)
    assert 8 < kept.mean() < 24  # about half of the 32 rows keep each input
    assert np.any(kept % 2 == 1), kept


def test_replica_zero_draws_what_one_device_draws():
    """Replica 0's numbers are Keras's own; another replica's are offset;
    a draw with an explicit integer seed is the user's fixed stream."""
    generator = keras.random.SeedGenerator(5)
    state = np.asarray(generator.state.value)
    plain = keras.random.uniform((4,), seed=generator)
    for index in (0, tf.constant(0)):
        generator.state.assign(state)
        with replica_seeds.as_replica(index):
            np.testing.assert_array_equal(keras.random.uniform((4,), seed=generator), plain)
    generator.state.assign(state)
    with replica_seeds.as_replica(1):
        other = keras.random.uniform((4,), seed=generator)
        fixed = keras.random.uniform((4,), seed=42)
    assert not np.any(np.asarray(other) == np.asarray(plain))
    np.testing.assert_array_equal(fixed, keras.random.uniform((4,), seed=42))
    # The generator's state advanced as Keras advances it, once per draw.
    np.testing.assert_array_equal(generator.state.value, state + [0, 1])

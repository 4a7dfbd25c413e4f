"""Each replica draws its own random numbers (keras_distrib.replica_seeds).

Every replica holds an equal copy of each layer's `SeedGenerator` state and
advanced it equally, so row i of every replica's shard got the same dropout
mask; one device gives each row of the global batch its own. The checks are
statistics one device passes too (its run is the control in each test).
The models and checks are in tests/helpers.py; two workers:
tests/distributed/test_keras_features_multi_worker.py (probe `replica_dropout`).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from helpers import (
    assert_kept_counts_from_own_masks,
    assert_replicas_drop_alike_only_by_chance,
    dropout_kept_counts,
    monte_carlo_dropped,
)
from keras_distrib import replica_seeds

REPLICATING = ["single", "mirrored", "central_storage"]  # single: the control


@pytest.mark.parametrize("strategy", REPLICATING)
def test_monte_carlo_dropout_rows_differ_between_replicas(strategy):
    # The two replicas' rows (one device: the two halves of its batch).
    assert_replicas_drop_alike_only_by_chance(monte_carlo_dropped(strategy))


@pytest.mark.parametrize("strategy", REPLICATING)
def test_dropout_masks_in_training_differ_between_replicas(strategy):
    kept, _ = dropout_kept_counts(strategy)
    assert_kept_counts_from_own_masks(kept)


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

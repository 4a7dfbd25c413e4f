"""The model and data of the overlap test (tests/distributed/test_overlap_packs.py)
and of its worker (tests/workers/overlap_packs.py). No TensorFlow on import."""

import numpy as np

ROWS, BATCH = 32, 16


def build():
    """Input(8) -> Dense(32) -> Dense(8192): the last kernel 1 MiB of float32."""
    import keras

    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(32, activation="relu")(inputs)
    return keras.Model(inputs, keras.layers.Dense(8192)(hidden))


def data():
    rng = np.random.default_rng(7)
    return (
        rng.standard_normal((ROWS, 8)).astype("float32"),
        rng.standard_normal((ROWS, 8192)).astype("float32"),
    )

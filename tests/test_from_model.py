"""Wrapping an existing, compiled and trained Keras model."""

import keras
import numpy as np

import keras_distrib as kd
from helpers import assert_weights_close, make_data, plain_model


def test_from_trained_model_keeps_weights_and_optimizer_state():
    x, y = make_data()
    plain = plain_model()
    plain.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    plain.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)

    wrapped = kd.DistributedModel.from_model(plain, strategy="mirrored")
    assert wrapped.compiled and wrapped.strategy.num_replicas == 2
    assert all(wrapped.strategy.holds(v) for v in wrapped.variables)
    assert_weights_close(wrapped, plain, atol=0)
    assert int(wrapped.optimizer.iterations.numpy()) == int(plain.optimizer.iterations.numpy())
    for a, b in zip(wrapped.optimizer.variables, plain.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # Continuing to train gives what the plain model gives (Adam moments carried).
    plain.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    wrapped.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    assert_weights_close(wrapped, plain, atol=1e-5)
    np.testing.assert_allclose(wrapped.evaluate(x, y, verbose=0), plain.evaluate(x, y, verbose=0),
                               atol=1e-5)


def test_from_sequential_model():
    x, y = make_data()
    seq = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4), keras.layers.Dense(3)])
    wrapped = kd.DistributedModel.from_model(seq, strategy="mirrored")
    assert not wrapped.compiled
    np.testing.assert_allclose(wrapped.predict(x, verbose=0), seq.predict(x, verbose=0), atol=1e-6)

"""Activation checkpointing (`keras.RematScope`, `keras.remat`) in `fit` on
TensorFlow: a rematerialized layer's forward pass runs again in the
backward pass, and training equals training without it.

Plain Keras 3.15 on TensorFlow fails here ("The custom_gradient decorator
currently supports keywords arguments only when eager execution is
enabled"); importing keras_distrib mends its TensorFlow `remat`
(`_compat.remat_in_graphs`), for plain models too.
"""

import contextlib

import keras
import numpy as np
import pytest

import as_reference
import keras_distrib as kd
from helpers import CLASSES, FEATURES, CountedDense, make_data


def _layers():
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    return inputs, keras.layers.Dense(CLASSES)(hidden)


def _model(strategy, scope=None):
    """A model to train one step of SGD (learning rate 1: the update is the
    gradient) from the same initial weights, on one batch of 32.

    One step, so the comparison is of the gradients themselves: over many
    steps a ReLU unit near zero can switch on in one run and not in the
    other, and two runs of the same 14 steps have ended up to 4e-5 apart
    (plain Keras, remat against no remat, in CI). Not Adam: its first steps
    move each weight by about the learning rate times the sign of its
    gradient, so a gradient element near zero whose last bits differ (the
    rematerialized gradient is another graph, which may round differently)
    moves a weight by up to twice the learning rate."""
    keras.utils.set_random_seed(1)
    with contextlib.nullcontext() if scope is None else scope:
        model = (
            keras.Model(*_layers())
            if strategy is None
            else kd.DistributedModel(*_layers(), strategy=strategy)
        )
    model.compile(
        optimizer=keras.optimizers.SGD(1.0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


@pytest.fixture(scope="module")
def without_remat():
    """The step of plain Keras without remat, traced."""
    x, y = make_data(32)
    return as_reference.fit(_model(None), x, y, 32)


@pytest.mark.parametrize(
    "strategy, mode",
    [
        (None, "full"),
        ("single", "full"),
        ("mirrored", "full"),
        ("mirrored", "activations"),
        ("central_storage", "full"),
        ("pipeline", "full"),
        ("tensor_parallel", "full"),
    ],
)
def test_remat_scope_trains_as_without_it(without_remat, strategy, mode):
    # One step at learning rate 1: the weights differ by the gradients'
    # difference, which another graph's rounding (the rematerialized forward
    # pass, the batch split over devices) keeps within the bound of sums of
    # the batch's 32 rows and the layers' dot products in other orders; a
    # gradient 0.1% off, or a lost one, ends far outside it.
    x, y = make_data(32)
    model = _model(strategy, keras.RematScope(mode=mode))
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    as_reference.assert_weights(without_remat, model)


def _forward_passes(scope, strategy):
    keras.utils.set_random_seed(1)
    with scope:
        inputs = keras.Input((FEATURES,))
        model = kd.DistributedModel(inputs, CountedDense(CLASSES)(inputs), strategy=strategy)
    model.compile(optimizer="sgd", loss="mse")
    x, _ = make_data(64)
    CountedDense.calls = 0
    model.fit(x, np.zeros((64, CLASSES), "float32"), batch_size=32, epochs=1, verbose=0)
    return CountedDense.calls


@pytest.mark.parametrize("strategy", ["single", "mirrored"])
def test_a_rematerialized_layer_runs_again_in_the_backward_pass(strategy):
    plain = _forward_passes(contextlib.nullcontext(), strategy)
    remat = _forward_passes(keras.RematScope(mode="full"), strategy)
    assert remat > plain, (remat, plain)  # traced once more, for the gradient


class Checkpointed(keras.layers.Layer):
    """The Keras guide's form: `keras.remat` around a sub-layer's call."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(16, activation="relu")

    def call(self, x):
        return keras.remat(self.inner)(x)


def test_keras_remat_in_a_layer_trains_as_without_it():
    x, y = make_data()

    def compiled(make_layer, strategy):
        # Made after the seed: a Keras initializer draws its seed when made.
        keras.utils.set_random_seed(1)
        inputs = keras.Input((FEATURES,))
        outputs = keras.layers.Dense(CLASSES)(make_layer()(inputs))
        model = (
            keras.Model(inputs, outputs)
            if strategy is None
            else kd.DistributedModel(inputs, outputs, strategy=strategy)
        )
        model.compile(
            optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
        return model

    reference = as_reference.fit(
        compiled(lambda: keras.layers.Dense(16, activation="relu"), None), x, y, 32, 2
    )
    for strategy in (None, "mirrored"):
        model = compiled(Checkpointed, strategy)
        model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        as_reference.assert_weights(reference, model)

"""Wrapping an existing, compiled and trained Keras model."""

import keras
import numpy as np
import pytest

import as_reference
import keras_distrib as kd
from float_bounds import assert_within, outputs_apart
from helpers import make_data, plain_model


def _optimizer_state(model):
    """The optimizer's state as a file holds it (the plain model's layout)."""
    store = {}
    model.optimizer.save_own_variables(store)
    return [store[str(i)] for i in range(len(store))]


def _trained_plain(x, y):
    """The plain model after an epoch of Adam."""
    plain = plain_model()
    plain.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    plain.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    return plain


@pytest.fixture(scope="module")
def continued():
    """(the data, the plain model's weights and Adam's state after an epoch,
    its second epoch traced): what every strategy's continued training is
    compared with."""
    x, y = make_data()
    plain = _trained_plain(x, y)
    start = [*plain.get_weights(), *_optimizer_state(plain)]
    return (x, y), start, as_reference.fit(plain, x, y, 32, outputs=False)


@pytest.mark.parametrize("strategy", ["mirrored", "tensor_parallel", "pipeline"])
def test_from_trained_model_keeps_weights_and_optimizer_state(strategy, continued):
    (x, y), start, reference = continued
    plain = _trained_plain(x, y)

    wrapped = kd.DistributedModel.from_model(plain, strategy=strategy)
    assert wrapped.compiled and wrapped.strategy.name == strategy
    assert all(wrapped.strategy.holds(v) for v in wrapped.variables)
    for a, b in zip(wrapped.get_weights(), plain.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(wrapped.optimizer.iterations.numpy()) == int(plain.optimizer.iterations.numpy())
    # Every slot carried, split like its weight where the strategy splits weights.
    for a, b in zip(_optimizer_state(wrapped), _optimizer_state(plain), strict=True):
        np.testing.assert_array_equal(a, b)

    # Continuing to train gives what the plain model gives (Adam moments carried).
    # The traced run continues from this state (the same first epoch, in
    # this process, with the same kernels: equal).
    for a, b in zip([*plain.get_weights(), *_optimizer_state(plain)], start, strict=True):
        np.testing.assert_array_equal(a, b)
    wrapped.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    as_reference.assert_weights(reference, wrapped)
    as_reference.assert_evaluate(reference, wrapped.evaluate(x, y, verbose=0), x, y)


@pytest.mark.parametrize("strategy", ["single", "mirrored", "pipeline", "tensor_parallel"])
def test_from_a_split_model_takes_its_whole_weights(strategy):
    """A `tensor_parallel` model wrapped under another strategy: the copy of
    its graph used to get the shards' list ("a weight list of length 7, but
    the layer was expecting 4 weights"), and `single` (any per-process
    strategy) kept the split layers, its `get_weights()` listing shards."""
    x, _ = make_data()
    plain = plain_model(seed=31)
    split = kd.DistributedModel.from_model(plain, strategy="tensor_parallel")
    assert len(split.weights) > len(plain.weights)  # really split
    wrapped = kd.DistributedModel.from_model(split, strategy=strategy)
    assert wrapped.strategy.name == strategy
    if strategy != "tensor_parallel":  # whole layers again
        assert len(wrapped.weights) == len(plain.weights)
    for a, b in zip(wrapped.get_weights(), plain.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    # The same weights, other kernels (split layers, a batch over devices).
    assert_within(
        wrapped.predict(x, verbose=0),
        plain.predict(x, verbose=0),
        outputs_apart(plain, x),
        "predict",
    )


def test_optimizer_state_that_does_not_fit_is_a_one_line_error():
    x, y = make_data()
    plain = plain_model()
    plain.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    plain.fit(x, np.eye(3)[y], batch_size=32, epochs=1, verbose=0)
    # A different optimizer in the saved config than in the model: Adam's
    # two slots per weight cannot fill SGD-with-momentum's one.
    config = plain.get_compile_config()
    config["optimizer"] = keras.optimizers.serialize(keras.optimizers.SGD(0.1, momentum=0.9))
    plain.get_compile_config = lambda: config
    with pytest.raises(ValueError, match="Cannot carry the optimizer state over") as error:
        kd.DistributedModel.from_model(plain, strategy="mirrored")
    assert "\n" not in str(error.value) and "compile the copy afresh" in str(error.value)


def test_from_sequential_model():
    x, y = make_data()
    seq = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4), keras.layers.Dense(3)])
    wrapped = kd.DistributedModel.from_model(seq, strategy="mirrored")
    assert not wrapped.compiled
    # The same weights; mirrored predicts on half the rows per device.
    assert_within(
        wrapped.predict(x, verbose=0), seq.predict(x, verbose=0), outputs_apart(seq, x), "predict"
    )

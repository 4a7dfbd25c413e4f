"""A model with several outputs logs each output's loss as plain Keras does.

Keras's compiled loss records `<output>_loss` once per call, weighted by
the batch's static size (1 where unknown); each replica recording its own
mean gave another average (1.4124 against plain Keras's 1.4062 in
`evaluate`) while the total loss was exact. The replicas' values are now
combined and recorded once per global batch (DistributedModel.record_output_losses).
"""

import keras
import numpy as np
import pytest

import keras_distrib as kd

import as_reference
from float_bounds import assert_within, evaluate_apart


def _graph():
    inputs = keras.Input((4,))
    h = keras.layers.Dense(8, activation="relu")(inputs)
    return inputs, {
        "a": keras.layers.Dense(3, name="a")(h),
        "b": keras.layers.Dense(1, name="b")(h),
    }


def _data(n):
    rng = np.random.default_rng(0)
    return (
        rng.normal(size=(n, 4)).astype("float32"),
        {
            "a": rng.integers(0, 3, n).astype("int32"),
            "b": rng.normal(size=(n, 1)).astype("float32"),
        },
    )


def _compile(model):
    model.compile(
        optimizer=keras.optimizers.SGD(0.05),
        loss_weights={"a": 1.0, "b": 0.5},
        loss={"a": keras.losses.SparseCategoricalCrossentropy(from_logits=True), "b": "mse"},
    )


@pytest.fixture(scope="module")
def plain_logs():
    """Plain Keras's initial weights, its `evaluate` logs at them and its
    logs of the last of 2 epochs, each with their bounds (its fit traced)."""
    x, y = _data(29)
    plain = keras.Model(*_graph())
    initial = plain.get_weights()
    _compile(plain)
    evaluated = plain.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    logs = {"evaluate": (evaluated, evaluate_apart(plain, x, y, 8, named=True))}
    reference = as_reference.fit(plain, x, y, 8, 2)
    logs["fit"] = tuple(
        {key: values[-1] for key, values in found.items()}
        for found in (reference.logs, reference.history())
    )
    return initial, logs


@pytest.mark.parametrize("strategy", ["mirrored", "central_storage", "pipeline", "tensor_parallel"])
def test_per_output_losses_of_fit_and_evaluate_are_plain_keras(strategy, plain_logs):
    # 29 rows, batches of 8: the last (5 rows) splits 3/2 over 2 replicas.
    x, y = _data(29)
    initial, plain = plain_logs
    model = kd.DistributedModel(*_graph(), strategy=strategy)
    model.set_weights(initial)
    _compile(model)
    logs = {"evaluate": model.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)}
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    logs["fit"] = {k: v[-1] for k, v in history.items()}
    for kind in ("evaluate", "fit"):
        (plain_logs, bounds), ours = plain[kind], logs[kind]
        assert set(ours) == set(plain_logs) >= {"a_loss", "b_loss", "loss"}
        for key in plain_logs:
            assert_within(ours[key], plain_logs[key], bounds[key], f"{kind} {key}")

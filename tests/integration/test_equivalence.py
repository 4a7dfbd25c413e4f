"""Core assertion: 2 replicas with global batch B == one device with batch B."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_distrib as kd

import as_reference
from float_bounds import Reference, Trace, assert_within, evaluate_apart, outputs_apart
from helpers import (
    Batches,
    all_variables_on,
    assert_trains_like_single,
    build,
    plain_model,
    tf_dataset,
)

FORMS = ["functional", "subclass", "from_model"]
BATCH = 32
EPOCHS = 2  # 203 samples -> 7 steps per epoch (last one 11 rows) -> 14 steps


@pytest.mark.parametrize("form", FORMS)
def test_mirrored_matches_single(form, data):
    x, y = data
    mirrored = assert_trains_like_single(form, "mirrored", x, y, BATCH, EPOCHS, steps=EPOCHS * 7)
    assert mirrored.strategy.num_replicas == 2
    assert all_variables_on(mirrored, mirrored.strategy)


def test_reduces_gradients_once(data):
    """Reducing twice would scale every update by the replica count."""
    x, y = data
    reference = as_reference.fit(build("functional", "single"), x[:32], y[:32], 32)
    mirrored = build("functional", "mirrored")
    mirrored.train_on_batch(x[:32], y[:32])
    as_reference.assert_weights(reference, mirrored)


@pytest.mark.parametrize("kind", ["tf_data", "py_dataset"])
def test_input_types(kind, data):
    x, y = data
    make = {"tf_data": tf_dataset, "py_dataset": Batches}[kind]
    # The reference reads the same batches in the same order from arrays.
    reference = as_reference.fit(build("functional", "single"), x, y, BATCH, EPOCHS)
    mirrored = build("functional", "mirrored")
    mirrored.fit(make(x, y, BATCH), epochs=EPOCHS, shuffle=False, verbose=0)
    as_reference.assert_weights(reference, mirrored)
    as_reference.assert_evaluate(
        reference, mirrored.evaluate(make(x, y, BATCH), verbose=0), x, y, BATCH
    )
    as_reference.assert_predict(reference, mirrored.predict(make(x, y, BATCH), verbose=0), x)


def test_on_batch_methods(data):
    x, y = data
    single = build("subclass", "single")
    mirrored = build("subclass", "mirrored")
    trace = Trace(outputs=True, model=single)
    want, got = [], []
    for start in range(0, 160, 32):
        s = slice(start, start + 32)
        trace.record(x[s], y[s])
        want.append(single.train_on_batch(x[s], y[s]))
        got.append(mirrored.train_on_batch(x[s], y[s]))
    trace.on_train_end()
    reference = Reference(single, trace)
    bounds = reference.history(steps_per_epoch=1)  # each call's logs: its own step's
    for i, key in enumerate(("loss", "accuracy")):
        assert_within([g[i] for g in got], [w[i] for w in want], bounds[key], key)
    as_reference.assert_weights(reference, mirrored)
    assert_within(
        mirrored.test_on_batch(x[:50], y[:50]),
        single.test_on_batch(x[:50], y[:50]),
        evaluate_apart(single, x[:50], y[:50], 50, reference.trainable),
        "test_on_batch",
    )
    assert_within(
        mirrored.predict_on_batch(x[:51]),
        single.predict_on_batch(x[:51]),
        outputs_apart(single, x[:51], reference.trainable),
        "predict_on_batch",
    )


def test_jit_compile(data):
    x, y = data
    reference = as_reference.fit(build("functional", "single", jit_compile=True), x, y, BATCH)
    mirrored = build("functional", "mirrored", jit_compile=True)
    assert mirrored.jit_compile
    mirrored.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    as_reference.assert_weights(reference, mirrored)
    as_reference.assert_predict(
        reference, mirrored.predict(x, batch_size=BATCH, verbose=0), x, BATCH
    )


@pytest.mark.parametrize("strategy", ["pipeline", "tensor_parallel"])
def test_jit_compile_where_xla_cannot_compile_the_step(strategy, data):
    """A step over several devices runs without XLA: `jit_compile` reads
    False, with a warning saying why when True was asked for."""
    x, y = data
    single = build("functional", "single", jit_compile=True)
    with pytest.warns(
        UserWarning,
        match=rf"jit_compile=True is not possible with "
        rf"strategy='{strategy}': XLA compiles the work of one device",
    ):
        model = build("functional", strategy, jit_compile=True)
    assert model.jit_compile is False
    with pytest.warns(UserWarning, match=rf"strategy='{strategy}'"):
        model.jit_compile = True  # Keras's public setter, after compile
    assert model.jit_compile is False
    reference = as_reference.fit(single, x, y, BATCH)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    as_reference.assert_weights(reference, model)


def test_steps_per_execution_and_adam(data):
    """Three steps per call on two replicas end as one step per call on one
    device (the reference: the trace follows one step per call)."""
    x, y = data
    reference = as_reference.fit(
        build("functional", "single", optimizer="adam"), x, y, BATCH, EPOCHS
    )
    mirrored = build("functional", "mirrored", optimizer="adam", steps_per_execution=3)
    mirrored.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    as_reference.assert_weights(reference, mirrored)


def test_validation_and_sample_weights(data):
    x, y = data
    w = np.linspace(0.5, 1.5, len(x)).astype("float32")
    validation = (x[:64], y[:64])
    reference = as_reference.fit(
        build("functional", "single"), x, y, BATCH, sample_weight=w, validation_data=validation
    )
    mirrored = build("functional", "mirrored")
    history = mirrored.fit(
        x,
        y,
        sample_weight=w,
        batch_size=BATCH,
        epochs=1,
        shuffle=False,
        verbose=0,
        validation_data=validation,
    )
    as_reference.assert_weights(reference, mirrored)
    as_reference.assert_validation(reference, history.history, *validation)


def test_regularization_loss_counted_once(data):
    """Layer losses are added per replica; weighting must keep them whole."""
    x, y = data

    def make(strategy):
        keras.utils.set_random_seed(3)
        inputs = keras.Input((x.shape[1],))
        outputs = keras.layers.Dense(3, kernel_regularizer=keras.regularizers.L2(0.1))(inputs)
        model = kd.DistributedModel(inputs, outputs, strategy=strategy)
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        return model

    reference = as_reference.fit(make("single"), x, y, BATCH)
    mirrored = make("mirrored")
    mirrored.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    as_reference.assert_weights(reference, mirrored)


@pytest.mark.parametrize("batch", [6, 10])
def test_replica_gradients_are_those_of_the_summed_loss_bit_for_bit(batch, data):
    """Each replica hands `reduce_gradients` the gradient of the *sum* of its
    samples' losses. Without float16 layers the tape computes it directly
    (the sample count scales the loss, not every gradient afterwards: one
    pass over the gradients less per step), so it is exactly the gradient of
    a sum-reduced loss, whatever the shard size (3 and 5 here)."""
    x, y = data[0][:batch], data[1][:batch]
    seen = []

    class Recording(kd.DistributedModel):
        def reduce_gradients(self, gradients, num_samples):
            seen.append([g.numpy() for g in gradients])
            return super().reduce_gradients(gradients, num_samples)

    reference = plain_model()
    model = Recording(reference.input, reference.output, strategy="mirrored")
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        run_eagerly=True,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    summed = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")

    def gradient_of_sum(rows):
        with tf.GradientTape() as tape:
            loss = summed(y[rows], reference(x[rows], training=True))
        return [g.numpy() for g in tape.gradient(loss, reference.trainable_weights)]

    half = batch // 2
    want = [gradient_of_sum(slice(0, half)), gradient_of_sum(slice(half, batch))]
    model.train_on_batch(x, y)
    assert len(seen) == 2
    for got in seen:  # the replicas' order of arrival varies
        matches = [all(np.array_equal(g, w) for g, w in zip(got, shard)) for shard in want]
        assert any(matches), [
            max(float(np.abs(g - w).max()) for g, w in zip(got, shard)) for shard in want
        ]

"""One compiled call per step (`keras_distrib.training.step_call`): Keras's math, fewer ops.

Keras's own train/test function nests the step in a second compiled
function and wraps the logs in a `tf.experimental.Optional`; ours is one
function with neither (a measurable share of a small model's step:
benchmarks/overhead.py).
These tests pin the shape of that function, and that it trains, evaluates
and ends epochs exactly as Keras's does.
"""

import keras
import pytest
import tensorflow as tf

import as_reference
from helpers import build, plain_model, tf_dataset

KERAS_FUNCTION_OPS = {"OptionalFromValue", "StatefulPartitionedCall", "PartitionedCall"}


def _op_types(compiled, dataset):
    graph = compiled.get_concrete_function(iter(dataset)).graph
    return {op.type for op in graph.get_operations()}


def _compile_like_build(model, **options):
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        **options,
    )
    return model


@pytest.mark.parametrize("strategy", ["single", "mirrored"])
def test_train_and_test_functions_are_one_compiled_call(data, strategy):
    x, y = data
    model = build("functional", strategy)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    model.evaluate(x, y, batch_size=32, verbose=0)
    dataset = tf_dataset(x, y, 32)
    for function in (model.train_function, model.test_function):
        ops = _op_types(function.compiled, dataset)
        assert "IteratorGetNext" in ops
        assert not ops & KERAS_FUNCTION_OPS, sorted(ops & KERAS_FUNCTION_OPS)


@pytest.mark.parametrize("options", [dict(steps_per_execution=3), dict(run_eagerly=True)])
def test_other_settings_keep_keras_function(data, options):
    x, y = data
    model = build("functional", "single", **options)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert not hasattr(model.train_function, "compiled")


@pytest.fixture(scope="module")
def plain_3_epochs(data):
    """Plain Keras trained on the data in order, 3 epochs of batches of 32, traced."""
    x, y = data
    return as_reference.fit(_compile_like_build(plain_model()), x, y, 32, 3)


@pytest.mark.parametrize("strategy", ["single", "mirrored"])
def test_finite_dataset_epochs_end_as_in_keras(data, strategy, plain_3_epochs):
    """No steps_per_epoch: the end of the data ends each epoch, every batch once."""
    x, y = data
    reference, plain = plain_3_epochs, plain_3_epochs.model
    ours = build("functional", strategy)
    h_ours = ours.fit(tf_dataset(x, y, 32), epochs=3, verbose=0)
    assert ours.optimizer.iterations.numpy() == plain.optimizer.iterations.numpy() == 3 * 7
    as_reference.assert_weights(reference, ours)
    assert h_ours.history.keys() == reference.logs.keys()
    as_reference.assert_history(reference, h_ours.history, reference.logs.keys())
    as_reference.assert_evaluate(
        reference, ours.evaluate(tf_dataset(x, y, 32), verbose=0), x, y, 32
    )


def _batches_without_weights(x, y, batch_size=32):
    """Endless (x, y, None) batches: Keras feeds the absent weights as an Optional."""
    while True:
        for i in range(0, len(x), batch_size):
            yield x[i : i + batch_size], y[i : i + batch_size], None


@pytest.fixture(scope="module")
def plain_2_epochs(data):
    """Plain Keras trained on the data in order, 2 epochs of batches of 32, traced."""
    x, y = data
    return as_reference.fit(_compile_like_build(plain_model()), x, y, 32, 2)


@pytest.mark.parametrize("strategy", ["single", "mirrored"])
def test_absent_element_reaches_the_step_as_none(data, strategy, plain_2_epochs):
    """Also the build's batch: a DistributedModel builds from one (plain Keras
    with no strategy at the first step), and Keras's build read the
    Optional's shape."""
    x, y = data
    ours = build("functional", strategy)
    # The reference: the same batches, from arrays in order.
    ours.fit(_batches_without_weights(x, y), steps_per_epoch=7, epochs=2, verbose=0)
    assert hasattr(ours.train_function, "compiled")
    as_reference.assert_weights(plain_2_epochs, ours)


def test_jit_compiled_step_trains_like_keras(data):
    """With jit_compile the step stays a nested XLA function, as in Keras."""
    x, y = data
    plain = _compile_like_build(plain_model(), jit_compile=True)
    ours = build("functional", "single", jit_compile=True)
    kwargs = dict(batch_size=32, epochs=2, shuffle=False, verbose=0)
    reference = as_reference.fit(plain, x, y, 32, 2)
    ours.fit(x, y, **kwargs)
    ops = _op_types(ours.train_function.compiled, tf_dataset(x, y, 32))
    assert "OptionalFromValue" not in ops
    assert ops & {"StatefulPartitionedCall", "PartitionedCall"}  # the XLA step
    as_reference.assert_weights(reference, ours)
    assert tf.is_tensor(ours.train_function.compiled(iter(tf_dataset(x, y, 32)))["loss"])

"""Models are made on a strategy without a config round trip (keras_distrib/placement.py).

Keras's own way to re-make a model elsewhere (`clone_model`: `get_config`
then `from_config`) refuses a `Lambda` holding a Python lambda and fails on
a user layer or metric without `get_config`/`**kwargs`; here the layers
keep their objects (`DistributedModel(inputs, outputs)`) or are copied
object by object (`from_model`).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import as_reference
import keras_distrib as kd
from float_bounds import assert_within, outputs_apart

STRATEGIES = ["mirrored", "central_storage", "pipeline", "tensor_parallel"]


class Scale(keras.layers.Layer):
    """Written the common way: no get_config, no **kwargs, a sub-layer, an
    array, a callable."""

    def __init__(self, factor, units):
        super().__init__()
        self.factor = factor
        self.dense = keras.layers.Dense(units)
        self.offset = np.arange(units, dtype="float32") / units
        self.squash = lambda t: t / (1.0 + keras.ops.abs(t))

    def call(self, x):
        return self.squash(self.factor * self.dense(x) + self.offset)


class Seen(keras.metrics.Metric):
    def __init__(self):
        super().__init__(name="seen")
        self.count = self.add_variable(shape=(), initializer="zeros", name="count")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.count.assign_add(tf.cast(tf.shape(y_pred)[0], "float32"))

    def result(self):
        return self.count


def _graph():
    inputs = keras.Input((6,))
    h = keras.layers.Lambda(lambda t: t * 2.0 - 1.0)(inputs)
    h = Scale(0.5, 8)(h)
    return inputs, keras.layers.Dense(3)(h)


def _data(n=32):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 6)).astype("float32"), rng.integers(0, 3, n).astype("int32")


def _compile(model):
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        metrics=[Seen()],
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )


@pytest.fixture(scope="module")
def plain_run():
    """(the initial weights, plain Keras trained from them, traced): the
    run every strategy's is compared with."""
    x, y = _data()
    plain = keras.Model(*_graph())
    initial = plain.get_weights()
    _compile(plain)
    return initial, as_reference.fit(plain, x, y, 8, 2, outputs=False)


@pytest.mark.parametrize("form", ["constructor", "from_model"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_lambda_user_layer_and_user_metric_train_as_plain_keras(strategy, form, plain_run):
    x, y = _data()
    initial, reference = plain_run
    if form == "constructor":
        model = kd.DistributedModel(*_graph(), strategy=strategy)
    else:
        model = kd.DistributedModel.from_model(keras.Model(*_graph()), strategy=strategy)
    model.set_weights(initial)
    _compile(model)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    as_reference.assert_weights(reference, model)
    assert model.evaluate(x, y, verbose=0, return_dict=True)["seen"] == len(x)


def test_constructor_takes_the_layers_as_keras_model_does():
    """`DistributedModel(inputs, outputs)` is made of those layers, as
    `keras.Model(inputs, outputs)` is: a plain model of the same graph sees
    what the distributed one trained."""
    x, y = _data()
    inputs, outputs = _graph()
    plain = keras.Model(inputs, outputs)
    model = kd.DistributedModel(inputs, outputs, strategy="mirrored")
    assert all(model.strategy.holds(v) for v in model.variables)
    _compile(model)
    model.fit(x, y, batch_size=8, verbose=0)
    # Mirrored predicts each batch of 32 as 16 rows per device, so plain
    # Keras predicts batches of 16; the same shapes need not mean the same
    # kernels (a CPU without AVX-512 ends a few rows a last bit apart), so
    # within what other orders of the layers' sums allow.
    assert_within(
        model.predict(x, verbose=0),
        plain.predict(x, batch_size=16, verbose=0),
        outputs_apart(plain, x),
        "predict",
    )


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_from_model_copies_and_leaves_the_model_as_it_was(strategy):
    x, y = _data()
    plain = keras.Model(*_graph())
    _compile(plain)
    plain.fit(x, y, batch_size=8, verbose=0)  # compiled and trained: its functions exist
    before = plain.predict(x, verbose=0)
    weights = plain.get_weights()
    model = kd.DistributedModel.from_model(plain, strategy=strategy)
    # The same weights, other kernels (a batch split over devices, a layer
    # over both): within what other orders of the layers' sums allow.
    assert_within(model.predict(x, verbose=0), before, outputs_apart(plain, x), "predict")
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    np.testing.assert_array_equal(plain.predict(x, verbose=0), before)
    for a, b in zip(weights, plain.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert not any(isinstance(v.value, tf.distribute.DistributedValues) for v in plain.weights)
    assert int(model.optimizer.iterations.numpy()) == int(plain.optimizer.iterations.numpy()) + 8


def test_layers_another_distributed_model_trains_are_copied():
    """A variable lives under one strategy: a second DistributedModel of
    the same graph gets copies, and the first keeps training alone."""
    x, y = _data()
    inputs, outputs = _graph()
    first = kd.DistributedModel(inputs, outputs, strategy="single")
    second = kd.DistributedModel(inputs, outputs, strategy="mirrored")
    assert not any(a is b for a in first.weights for b in second.weights)
    # The same weights; mirrored predicts on 16 rows per device.
    assert_within(
        second.predict(x, verbose=0),
        first.predict(x, verbose=0),
        outputs_apart(first, x),
        "predict",
    )
    _compile(second)
    second.fit(x, y, batch_size=8, verbose=0)
    assert not any(isinstance(v.value, tf.distribute.DistributedValues) for v in first.weights)
    assert not np.allclose(first.get_weights()[0], second.get_weights()[0])


def test_a_subclass_taking_another_models_layers_is_a_one_line_error():
    inputs, outputs = _graph()
    first = kd.DistributedModel(inputs, outputs, strategy="single")

    class Head(kd.DistributedModel):
        def __init__(self, body, **kwargs):
            super().__init__(**kwargs)
            self.body = body

        def call(self, x):
            return self.body(x)

    model = Head(first.layers[2], strategy="mirrored")
    with pytest.raises(
        ValueError,
        match=r"belongs to model .* on strategy 'single', and a "
        r"variable lives under one strategy; build the layers again",
    ) as e:
        model(np.zeros((2, 6), "float32"))
    assert "\n" not in str(e.value)


def test_optimizer_and_metric_without_get_config_are_adopted_in_place():
    class Plain(keras.optimizers.SGD):
        def __init__(self):  # no config round trip possible
            super().__init__(learning_rate=0.1)

    optimizer, metric = Plain(), Seen()
    model = kd.DistributedModel(*_graph(), strategy="mirrored")
    model.compile(
        optimizer=optimizer,
        metrics=[metric],
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    assert model.optimizer is optimizer
    assert model.strategy.holds(optimizer.iterations) and model.strategy.holds(metric.count)
    x, y = _data()
    model.fit(x, y, batch_size=8, verbose=0)
    assert int(optimizer.iterations.numpy()) == 4


def test_a_layer_that_cannot_be_copied_is_named_in_one_line():
    import threading

    class Locked(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.lock = threading.Lock()  # neither copyable nor serializable

        def call(self, x):
            return x

    inputs = keras.Input((6,))
    plain = keras.Model(inputs, keras.layers.Dense(2)(Locked()(inputs)))
    with pytest.raises(
        ValueError,
        match=r"Layer 'locked.*' \(Locked\) cannot be copied .*; "
        r"build the model with keras_distrib.DistributedModel\(inputs, outputs",
    ) as e:
        kd.DistributedModel.from_model(plain, strategy="mirrored")
    assert "\n" not in str(e.value)
    # ... and the constructor, which takes the layers themselves, works.
    kd.DistributedModel(plain.input, plain.output, strategy="mirrored")

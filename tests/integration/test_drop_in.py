"""DistributedModel as a drop-in `keras.Model`: what plain Keras does with a
user's code, ours does too (each case written as users write it, and
compared with plain Keras from the same weights where it computes)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_distrib as kd
from helpers import CLASSES, FEATURES, build, make_data, plain_model

import as_reference
from float_bounds import assert_within, evaluate_apart, outputs_apart


def _dense_net(base, **kwargs):
    class Dense(base):
        def __init__(self, **kw):
            super().__init__(**{**kwargs, **kw})
            self.dense = keras.layers.Dense(3, kernel_initializer="ones")

        def call(self, x):
            return self.dense(x)

    return Dense()


# -- the class itself never changes -------------------------------------------------


def test_functional_init_in_a_subclass_changes_no_class():
    bases = kd.DistributedModel.__bases__

    class Net(kd.DistributedModel):  # Keras's "functional init in a subclass"
        def __init__(self):
            inputs = keras.Input((FEATURES,))
            super().__init__(inputs, keras.layers.Dense(2)(inputs), strategy="single")

    net = Net()
    assert isinstance(net, Net) and isinstance(net, kd.FunctionalDistributedModel)
    inputs = keras.Input((FEATURES,))
    with pytest.raises(ValueError):
        kd.DistributedModel({"a": "x"}, keras.layers.Dense(1)(inputs))
    assert kd.DistributedModel.__bases__ == bases and Net.__bases__ == (kd.DistributedModel,)
    later = _dense_net(kd.DistributedModel, strategy="single")  # a subclass still works
    assert later(np.ones((2, FEATURES), "float32")).shape == (2, 3)


# -- predict as Keras's ---------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["single", "mirrored"])
def test_predict_on_an_unbuilt_uncompiled_subclass(strategy):
    model = _dense_net(kd.DistributedModel, strategy=strategy)
    out = model.predict(np.ones((10, FEATURES), "float32"), batch_size=4, verbose=0)
    np.testing.assert_array_equal(out, np.full((10, 3), FEATURES, "float32"))


@pytest.mark.parametrize("strategy", ["single", "mirrored"])
def test_predict_before_fit_on_a_model_compiled_with_metrics(strategy):
    model = _dense_net(kd.DistributedModel, strategy=strategy)
    model.compile(optimizer="sgd", loss="mse", metrics=[keras.metrics.MeanSquaredError()])
    out = model.predict(np.ones((10, FEATURES), "float32"), batch_size=4, verbose=0)
    assert out.shape == (10, 3)
    assert model.predict_on_batch(np.ones((3, FEATURES), "float32")).shape == (3, 3)


@pytest.mark.parametrize("strategy", ["single", "mirrored", "central_storage"])
def test_predict_on_a_generator_loses_no_batch(strategy):
    def batches():
        for i in range(4):
            yield (np.full((2, FEATURES), i, "float32"),)

    model = _dense_net(kd.DistributedModel, strategy=strategy)
    out = model.predict(batches(), verbose=0)  # unbuilt: its first batch builds it
    np.testing.assert_array_equal(out[:, 0], np.repeat(np.arange(4.0) * FEATURES, 2))
    out = model.predict(batches(), verbose=0)  # built
    assert out.shape == (8, 3)


# -- any global batch -----------------------------------------------------------------


@pytest.fixture(scope="module")
def single_batch_5():
    """ "single" trained on `make_data()` in batches of 5 for 2 epochs (with
    validation in batches of 7), traced."""
    x, y = make_data()
    return as_reference.fit(
        build("functional", "single"),
        x,
        y,
        5,
        2,
        validation_data=(x, y),
        validation_batch_size=7,
    )


@pytest.mark.parametrize("strategy", ["mirrored", "central_storage", "tensor_parallel", "pipeline"])
def test_a_batch_the_replicas_cannot_share_evenly_trains_as_one_device(strategy, single_batch_5):
    x, y = make_data()
    reference, model = single_batch_5, build("functional", strategy)
    model.fit(
        x,
        y,
        batch_size=5,
        epochs=2,
        shuffle=False,
        verbose=0,
        validation_data=(x, y),
        validation_batch_size=7,
    )
    as_reference.assert_weights(reference, model)
    as_reference.assert_evaluate(
        reference, model.evaluate(x, y, batch_size=33, verbose=0), x, y, 33
    )
    as_reference.assert_predict(reference, model.predict(x, batch_size=33, verbose=0), x, 33)


@pytest.fixture(scope="module")
def single_batch_1():
    """ "single" trained on 7 rows one at a time, traced."""
    x, y = make_data(7)
    return as_reference.fit(build("functional", "single"), x, y, 1)


@pytest.mark.parametrize("strategy", ["mirrored", "central_storage"])
def test_a_batch_smaller_than_the_replica_count_trains_as_one_device(strategy, single_batch_1):
    x, y = make_data(7)
    reference, model = single_batch_1, build("functional", strategy)
    history = model.fit(x, y, batch_size=1, epochs=1, shuffle=False, verbose=0).history
    as_reference.assert_history(reference, history, ("loss",))
    as_reference.assert_weights(reference, model)
    as_reference.assert_evaluate(reference, model.evaluate(x, y, batch_size=1, verbose=0), x, y, 1)


def test_plain_keras_reference_trains_with_that_batch_too():
    # The control: the reference is Keras itself (same weights, batch 5).
    x, y = make_data()
    plain, ours = plain_model(), build("functional", "single")
    plain.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    reference = as_reference.fit(plain, x, y, 5)
    ours.fit(x, y, batch_size=5, epochs=1, shuffle=False, verbose=0)
    as_reference.assert_weights(reference, ours)


# -- a DistributedModel nested in another ---------------------------------------------


class _Inner(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(3, kernel_initializer="ones")

    def call(self, x):
        return self.dense(x) * 0.1


class _DistributedInner(_Inner, kd.DistributedModel):
    pass


def _nested_data():
    x, y = make_data()
    return x, y.astype("float32")[:, None]


def _outer(inner, outer_class, **kwargs):
    inputs = keras.Input((FEATURES,))
    outer = outer_class(
        inputs, keras.layers.Dense(1, kernel_initializer="ones")(inner(inputs)), **kwargs
    )
    outer.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return outer


@pytest.fixture(scope="module")
def nested_reference():
    """The plain Keras subclass nested in a plain functional model, trained
    in order, traced."""
    return as_reference.fit(_outer(_Inner(), keras.Model), *_nested_data(), 32, 2)


@pytest.mark.parametrize("strategy", ["single", "mirrored"])
def test_a_subclass_nested_in_a_functional_model_trains_with_it(strategy, nested_reference):
    x, y = _nested_data()
    outer = _outer(_DistributedInner(strategy=strategy), kd.DistributedModel, strategy=strategy)
    outer.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    as_reference.assert_weights(nested_reference, outer)


# -- callbacks keep their contracts ---------------------------------------------------


@pytest.mark.parametrize("strategy", ["single", "mirrored"])
def test_terminate_on_nan_stops_quietly(strategy):
    x, y = make_data()
    model = build("functional", strategy, optimizer=keras.optimizers.SGD(1e30))
    history = model.fit(
        x, y, batch_size=32, epochs=5, verbose=0, callbacks=[keras.callbacks.TerminateOnNaN()]
    )
    assert len(history.history["loss"]) == 1 and not np.isfinite(history.history["loss"][0])


@pytest.mark.parametrize("strategy", ["single", "mirrored"])
def test_terminate_on_nan_takes_non_finite_input_as_keras_does(strategy):
    # Keras's own TerminateOnNaN tests make the loss NaN with inf input:
    # the user who passes the callback said what a NaN loss should do, so the
    # input is not refused (without the callback it is, in one line).
    x, y = make_data()
    x[0, 0] = np.inf
    model = build("functional", strategy)
    history = model.fit(
        x, y, batch_size=32, epochs=3, verbose=0, callbacks=[keras.callbacks.TerminateOnNaN()]
    )
    assert len(history.history["loss"]) == 1 and not np.isfinite(history.history["loss"][0])
    with pytest.raises(ValueError, match=r"^x holds inf at row 0; .* set model.check_finite"):
        model.fit(x, y, batch_size=32, verbose=0)


# -- what a custom step receives --------------------------------------------------------


@pytest.mark.parametrize("strategy", ["single", "mirrored"])
def test_fit_without_y_hands_a_custom_train_step_x_itself(strategy):
    # keras-io's DCGAN and VAE: `fit(images)`, then `train_step(self, data)`
    # uses `data` as the batch of images.
    seen = []

    class AutoEncoder(kd.DistributedModel):
        def __init__(self):
            super().__init__(strategy=strategy)
            self.dense = keras.layers.Dense(FEATURES)

        def call(self, x):
            return self.dense(x)

        def train_step(self, data):
            seen.append(type(data))
            loss = keras.ops.mean((self(data) - data) ** 2)  # fails on a tuple
            return {"loss": loss}

    x, _ = make_data()
    model = AutoEncoder()
    model.compile(optimizer="sgd")
    history = model.fit(x, batch_size=32, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    assert tuple not in seen and seen


@pytest.mark.parametrize("strategy", ["single", "mirrored", "central_storage"])
def test_a_warning_of_the_step_is_shown_once(strategy):
    import warnings

    class Loud(keras.layers.Layer):
        def call(self, x):
            warnings.warn("kd-test: a user's layer warns", stacklevel=2)
            return x

    inputs = keras.Input((FEATURES,))
    model = kd.DistributedModel(inputs, keras.layers.Dense(2)(Loud()(inputs)), strategy=strategy)
    model.build((None, FEATURES))  # the warnings of predict's trace alone are counted
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.predict(np.ones((4, FEATURES), "float32"), batch_size=4, verbose=0)
    assert [str(w.message) for w in caught if "kd-test" in str(w.message)] == [
        "kd-test: a user's layer warns"
    ]


@pytest.mark.parametrize("strategy", ["single", "mirrored", "central_storage"])
def test_an_optional_input_given_as_none_by_a_generator(strategy):
    class OptionalInput(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(2, kernel_initializer="ones")

        def call(self, x, o=None):
            return self.dense(x if o is None else x + o)

    x_in, o_in = keras.Input((2,), name="x"), keras.Input((2,), name="o", optional=True)
    model = kd.DistributedModel(
        {"x": x_in, "o": o_in}, OptionalInput()(x_in, o_in), strategy=strategy
    )

    def batches():
        for _ in range(4):
            yield ({"x": np.ones((2, 2), "float32"), "o": None},)

    np.testing.assert_array_equal(model.predict(batches(), verbose=0), np.full((8, 2), 2.0))


# -- a variable read as a Python number -----------------------------------------------


class _CallCounter(keras.layers.Layer):
    """Counts its calls in a weight, as the layer of Keras's BackupAndRestore
    tests does."""

    def build(self, input_shape):
        self.counter = self.add_weight(shape=(), initializer="zeros", trainable=False)

    def call(self, x):
        self.counter.assign_add(1)
        return x


@pytest.mark.parametrize("strategy", ["single", "mirrored", "central_storage"])
def test_a_counter_a_layer_keeps_reads_as_a_python_number(strategy):
    x, y = make_data(24)  # 3 steps of 8

    def trained(model_class, **kwargs):
        counter = _CallCounter()
        inputs = keras.Input((FEATURES,))
        model = model_class(inputs, keras.layers.Dense(CLASSES)(counter(inputs)), **kwargs)
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        return counter.counter, model.optimizer.iterations

    expected, _ = trained(keras.Model)
    counter, iterations = trained(kd.DistributedModel, strategy=strategy)
    # Each replica calls the layer once a step, on its own copy: steps, as
    # plain Keras counts them.
    assert int(expected) == 3
    assert int(counter) == int(counter.value) == int(expected)
    assert float(counter) == float(counter.value) == 3.0
    assert int(iterations) == 3


def test_a_counter_built_in_a_tf_distribute_scope_reads_as_a_python_number():
    x, y = make_data(24)
    with tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]).scope():  # tf.distribute's habit
        counter = _CallCounter()
        inputs = keras.Input((FEATURES,))
        model = kd.DistributedModel(inputs, keras.layers.Dense(CLASSES)(counter(inputs)))
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert int(counter.counter) == int(counter.counter.value) == 3


# -- a plain keras.Model sharing layers with one ---------------------------------------


def _sharing_data():
    x, _ = make_data()
    rng = np.random.default_rng(1)
    return x, rng.normal(size=(len(x), 1)), rng.normal(size=(len(x), 16))


def _sharing_models(model_class, **kwargs):
    """(an encoder, kept for later as users do; a model of `model_class`
    sharing its layer), compiled as the test trains them."""
    keras.utils.set_random_seed(7)
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(16)(inputs)
    encoder = keras.Model(inputs, hidden)
    full = model_class(inputs, keras.layers.Dense(1)(hidden), **kwargs)
    full.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return encoder, full


def _sharing_run(encoder, full, optimizer, fit):
    """The full model trained for an epoch, the encoder (compiled with
    `optimizer`) for two, the full model again for one, each by `fit(model,
    x, y, epochs)`; returns the encoder's weights, `evaluate` and `predict`
    after its training, then the full model's weights."""
    x, y, z = _sharing_data()
    fit(full, x, y, 1)
    encoder.compile(optimizer=getattr(keras.optimizers, optimizer)(0.01), loss="mse")
    fit(encoder, x, z, 2)
    results = [
        *encoder.get_weights(),
        encoder.evaluate(x, z, verbose=0),
        encoder.predict(x, verbose=0),
    ]
    fit(full, x, y, 1)  # on what it trained
    return results + full.get_weights()


@pytest.fixture(scope="module")
def sharing_reference():
    """Per optimizer: plain Keras's results of `_sharing_run`, and their
    bounds. Each fit is traced; a difference in the weights a fit starts
    from does not grow in it (see float_bounds' module doc), so a weight's
    bound adds up those of the fits that train it."""
    found = {}

    def reference(optimizer):
        if optimizer in found:
            return found[optimizer]
        encoder, full = _sharing_models(keras.Model)
        x, _, z = _sharing_data()
        apart = {id(v): 0.0 for v in full.trainable_weights}
        bounds = []

        def fit(model, x, y, epochs):
            traced = as_reference.fit(model, x, y, 32, epochs)
            for variable, bound in zip(model.trainable_weights, traced.trainable):
                apart[id(variable)] = apart[id(variable)] + bound
            if model is encoder:
                weights_apart = [apart[id(v)] for v in encoder.trainable_weights]
                bounds.extend(weights_apart)
                bounds.append(evaluate_apart(encoder, x, y, 32, weights_apart))
                bounds.append(outputs_apart(encoder, x, weights_apart))

        results = _sharing_run(encoder, full, optimizer, fit)
        bounds.extend(apart[id(v)] for v in full.trainable_weights)
        found[optimizer] = results, bounds
        return found[optimizer]

    return reference


@pytest.mark.parametrize("strategy", ["single", "mirrored", "central_storage"])
@pytest.mark.parametrize("optimizer", ["SGD", "AdamW"])  # AdamW reads them in its update
def test_a_plain_model_sharing_layers_with_a_distributed_one_trains_them(
    strategy, optimizer, sharing_reference
):
    expected, bounds = sharing_reference(optimizer)

    def fit(model, x, y, epochs):
        model.fit(x, y, batch_size=32, epochs=epochs, shuffle=False, verbose=0)

    got = _sharing_run(*_sharing_models(kd.DistributedModel, strategy=strategy), optimizer, fit)
    assert len(got) == len(expected) == len(bounds)
    for i, (a, b, bound) in enumerate(zip(got, expected, bounds)):
        assert_within(np.ravel(a), np.ravel(b), np.ravel(bound), f"result {i}")


# -- saved and loaded back ------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["single", "mirrored"])
def test_a_legacy_h5_file_loads_back_into_the_class_that_saved_it(strategy, tmp_path):
    x, _ = make_data()
    model = build("functional", strategy)
    model.save(tmp_path / "model.h5")  # Keras's legacy HDF5 format
    loaded = keras.models.load_model(tmp_path / "model.h5")
    assert type(loaded) is kd.FunctionalDistributedModel
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))


@keras.saving.register_keras_serializable(package="test_drop_in")
class SequentialNet(kd.DistributedModel, keras.Sequential):
    """A `keras.Sequential` trained by DistributedModel."""


def test_a_model_saved_with_ema_weights_loads_under_mirrored(tmp_path):
    # keras.callbacks.SwapEMAWeights' own test: a Sequential built at its
    # first fit, an optimizer with EMA slots; compiled again on load, the
    # optimizer makes its slots beside the loaded variables.
    x, y = make_data()
    model = SequentialNet(
        [keras.layers.Dense(CLASSES, kernel_initializer="ones")], strategy="mirrored"
    )
    model.compile(
        optimizer=keras.optimizers.SGD(use_ema=True, ema_momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(
        x,
        y,
        batch_size=32,
        epochs=1,
        verbose=0,
        callbacks=[keras.callbacks.SwapEMAWeights(swap_on_epoch=True)],
    )
    model.save(tmp_path / "model.keras")
    loaded = keras.saving.load_model(tmp_path / "model.keras")
    assert loaded.strategy.name == "mirrored"
    # The same class and strategy at the same weights on the same batches:
    # the same kernels, the same loss.
    assert loaded.evaluate(x, y, verbose=0) == model.evaluate(x, y, verbose=0)

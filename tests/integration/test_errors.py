"""Bad input: one clear line naming the problem and the fix."""

import re

import keras
import numpy as np
import pytest

import keras_distrib as kd
from helpers import FEATURES, build, make_data


def _one_line(excinfo):
    assert "\n" not in str(excinfo.value)


def test_subclass_with_functional_arguments():
    class Loose(kd.DistributedModel):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, strategy="single", **kwargs)

    inputs = keras.Input((8,))
    # A functional variant of the subclass (the Keras guide's form) ...
    model = Loose(inputs, keras.layers.Dense(3)(inputs))
    assert isinstance(model, Loose) and model.strategy.name == "single"
    # ... which did not turn DistributedModel or the subclass functional.
    assert keras.src.models.functional.Functional not in kd.DistributedModel.__mro__
    assert keras.src.models.functional.Functional not in Loose.__mro__


def test_from_model_rejects_subclassed_models():
    class Plain(keras.Model):
        def __init__(self):
            super().__init__()
            self.d = keras.layers.Dense(1)

        def call(self, x):
            return self.d(x)

    with pytest.raises(ValueError, match="subclass keras_distrib.DistributedModel") as e:
        kd.DistributedModel.from_model(Plain(), strategy="single")
    _one_line(e)


def test_optimizer_used_elsewhere():
    x, y = make_data()
    optimizer = keras.optimizers.SGD()
    plain = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
    plain.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    plain.fit(x, y, verbose=0)
    model = build("functional", "mirrored", compile_model=False)
    with pytest.raises(ValueError, match="pass a new optimizer") as e:
        model.compile(optimizer=optimizer, loss="mse")
    _one_line(e)


def test_optimizer_made_outside_scope_is_recreated_inside():
    model = build("functional", "mirrored", compile_model=False)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    assert model.strategy.holds(model.optimizer.iterations)
    assert model.optimizer.learning_rate.numpy() == np.float32(0.05)


@pytest.mark.parametrize("option,value", [("devices", ["/cpu:0"]), ("num_stages", 2)])
def test_strategy_options_given_to_the_model_are_refused(option, value):
    # Keras's Functional model ignores unknown keyword arguments: the
    # strategy would silently run with its defaults.
    import keras

    inputs = keras.Input((4,))
    with pytest.raises(
        ValueError,
        match=rf"^{option}= is an option of the strategy, not of "
        rf"the model; pass strategy=keras_distrib.strategies"
        rf"\.get\('mirrored', {option}=\.\.\.\) instead\.$",
    ) as e:
        kd.DistributedModel(
            inputs, keras.layers.Dense(1)(inputs), strategy="mirrored", **{option: value}
        )
    _one_line(e)


@pytest.mark.parametrize("strategy", ["single", "mirrored"])
@pytest.mark.parametrize("bad", ["y", "sample_weight"])
def test_arrays_of_different_lengths_are_refused(strategy, bad):
    x, y = make_data()
    weights = np.ones(len(x), "float32")
    if bad == "y":
        y = y[:50]
    else:
        weights = weights[:10]
    model = build("functional", strategy)
    with pytest.raises(
        ValueError,
        match=r"do not have one row per sample \(rows: x 203, y "
        rf"{len(y)}, sample_weight {len(weights)}\)",
    ) as e:
        model.fit(x, y, sample_weight=weights, batch_size=32, verbose=0)
    _one_line(e)


@pytest.mark.parametrize("steps_per_execution", [1, 2])
def test_a_wrong_input_shape_in_predict_is_keras_s_one_line_error(steps_per_execution):
    # Our replicated predict (and fused-steps) functions are not converted
    # by AutoGraph, as Keras's are not: the error raised while tracing is
    # Keras's own, not wrapped in "in user code:" frames.
    model = build("functional", "mirrored", steps_per_execution=steps_per_execution)
    x = np.zeros((6, FEATURES + 1), "float32")
    with pytest.raises(ValueError, match="is incompatible with the layer") as e:
        model.predict(x, verbose=0)
    _one_line(e)
    if steps_per_execution == 2:
        with pytest.raises(ValueError, match="is incompatible with the layer") as e:
            model.fit(x, np.zeros(6), batch_size=2, verbose=0)
        _one_line(e)


@pytest.mark.parametrize("strategy", ["mirrored", "central_storage"])
def test_keras_gradient_accumulation_under_tf_distribute_points_to_ours(strategy):
    # Keras accumulates inside a tf.cond, where a tf.distribute replica
    # cannot merge_call: it failed at the first step with a long RuntimeError.
    import keras

    model = build("functional", strategy, compile_model=False)
    optimizer = keras.optimizers.SGD(0.1, gradient_accumulation_steps=2)
    with pytest.raises(
        ValueError,
        match=r"gradient_accumulation_steps=2 of a Keras optimizer "
        rf"cannot run under strategy '{strategy}'; use "
        r"keras_distrib\.optimizers\.DistributedOptimizer\("
        r"optimizer, backward_passes_per_step=2\) instead\.",
    ) as e:
        model.compile(optimizer=optimizer, loss="mse")
    _one_line(e)


# -- bad input an adversarial user tried ---------------------------------------


@pytest.mark.parametrize(
    "option,value,message",
    [
        (
            "collective_timeout",
            "10",
            "collective_timeout='10' must be a number of seconds > 0, or None.",
        ),
        (
            "collective_timeout",
            True,
            "collective_timeout=True must be a number of seconds > 0, or None.",
        ),
        ("peer_timeout", "x", "peer_timeout='x' must be a number of seconds > 0."),
        ("peer_timeout", 0, "peer_timeout=0 must be a number of seconds > 0."),
    ],
)
def test_multi_worker_timeouts_are_named_before_any_cluster_is_needed(
    monkeypatch, option, value, message
):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ValueError) as e:
        kd.strategies.get("multi_worker", **{option: value})
    assert str(e.value) == message


@pytest.mark.parametrize("method", ["fit", "evaluate", "predict"])
@pytest.mark.parametrize("strategy", ["single", "mirrored"])
@pytest.mark.parametrize("batch_size", [0, -1, -2, 1.5, True])
def test_batch_size_must_be_a_positive_integer(method, strategy, batch_size):
    x, y = make_data()
    model = build("functional", strategy)
    args = (x,) if method == "predict" else (x, y)
    with pytest.raises(
        ValueError,
        match=rf"^batch_size={batch_size!r} must be a positive "
        r"integer \(the global batch\)",
    ) as e:
        getattr(model, method)(*args, batch_size=batch_size, verbose=0)
    _one_line(e)


def test_validation_batch_size_must_be_a_positive_integer():
    x, y = make_data()
    with pytest.raises(
        ValueError, match=r"^validation_batch_size=0 must be a positive integer"
    ) as e:
        build("functional", "single").fit(
            x, y, validation_data=(x, y), validation_batch_size=0, verbose=0
        )
    _one_line(e)


def test_batch_size_none_and_numpy_integers_still_work():
    x, y = make_data()
    model = build("functional", "mirrored")
    model.fit(x, y, batch_size=None, verbose=0)
    model.fit(
        x,
        y,
        batch_size=np.int64(32),
        validation_data=(x, y),
        validation_batch_size=np.int32(64),
        verbose=0,
    )


@pytest.mark.parametrize("strategy", ["single", "mirrored"])
def test_empty_training_data_is_a_one_line_error(strategy):
    import tensorflow as tf

    x, y = make_data()
    model = build("functional", strategy)
    with pytest.raises(ValueError, match=r"^The training data is empty: x has 0 rows") as e:
        model.fit(x[:0], y[:0], verbose=0)
    _one_line(e)
    empty = tf.data.Dataset.from_tensor_slices((x[:0], y[:0])).batch(4)
    with pytest.raises(
        ValueError,
        match=r"^The training data is empty: the tf.data.Dataset "
        r"has no elements",
    ) as e:
        model.fit(empty, verbose=0)
    _one_line(e)
    # Size unknown without reading it: the batch Keras reads to build is missing.
    filtered = tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda a, b: False).batch(4)
    with pytest.raises(ValueError, match=r"^The input data is empty: it gave no batch") as e:
        model.fit(filtered, verbose=0)
    _one_line(e)


@pytest.mark.parametrize("strategy", ["single", "mirrored"])
@pytest.mark.parametrize(
    "bad,loss",
    [
        (5, keras.losses.SparseCategoricalCrossentropy(from_logits=True)),
        (-1, "sparse_categorical_crossentropy"),
    ],
)
def test_sparse_labels_out_of_range_name_the_label_and_the_classes(strategy, bad, loss):
    x, y = make_data()
    y = y.copy()
    y[7] = bad
    model = build("functional", strategy, loss=loss)
    with pytest.raises(
        ValueError,
        match=rf"^y holds label {bad} \(row 7\) but the model's "
        r"output has 3 classes;.* in 0\.\.2",
    ) as e:
        model.fit(x, y[:, None], verbose=0)
    _one_line(e)


def test_ignored_class_label_is_not_out_of_range():
    x, y = make_data()
    y = np.where(y == 0, -1, y).astype("int32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=-1)
    build("functional", "single", loss=loss).fit(x, y, verbose=0)


@pytest.mark.parametrize("steps", [0, -3, 1.5])
def test_steps_per_execution_must_be_an_integer_of_at_least_one(steps):
    model = build("functional", "mirrored", compile_model=False)
    with pytest.raises(
        ValueError,
        match=rf"^steps_per_execution={steps!r} must be an "
        r"integer >= 1",
    ) as e:
        model.compile(optimizer="sgd", loss="mse", steps_per_execution=steps)
    _one_line(e)


@pytest.mark.parametrize(
    "load", [keras.models.load_model, keras.saving.load_model], ids=["keras.models", "keras.saving"]
)
def test_a_truncated_keras_file_is_named_truncated_not_missing(tmp_path, load):
    # Our saves are atomic, so a truncated file comes from a copy cut short;
    # Keras alone says "File not found" for a file that is there.
    path = tmp_path / "m.keras"
    build("functional", "single").save(path)
    truncated = tmp_path / "truncated.keras"
    truncated.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(
        ValueError,
        match=rf"^{re.escape(str(truncated))} is not a valid "
        r"\.keras file: it exists \(\d+ bytes\) but is no "
        r"zip archive, i\.e\. truncated",
    ) as e:
        load(str(truncated))
    _one_line(e)
    with pytest.raises(ValueError, match=r"^File not found"):  # one that is not there
        load(str(tmp_path / "missing.keras"))


@pytest.mark.parametrize("strategy", ["single", "mirrored"])
def test_nan_input_is_refused_unless_opted_out(strategy):
    x, y = make_data()
    x = x.copy()
    x[20, 3] = np.inf
    model = build("functional", strategy)
    with pytest.raises(
        ValueError, match=r"^x holds inf at row 20;.*model.check_finite = False"
    ) as e:
        model.fit(x, y, verbose=0)
    _one_line(e)
    model.check_finite = False
    model.fit(x, y, verbose=0)  # the user's call: trains on


@pytest.mark.parametrize("strategy", ["single", "mirrored"])
def test_non_finite_loss_stops_training_naming_the_step(strategy):
    x, y = make_data()
    model = build("functional", strategy)

    class Spoil(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:  # the weights that step 3 reads become NaN
                self.model.layers[-1].bias.assign(np.full(3, np.nan, "float32"))

    epochs = []

    class Record(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            epochs.append(epoch)

    with pytest.raises(
        ValueError,
        match=r"^The training loss is nan at epoch 1, step 3: .*"
        r"model.check_finite = False",
    ) as e:
        model.fit(x, y, batch_size=32, shuffle=False, verbose=0, callbacks=[Spoil(), Record()])
    _one_line(e)
    assert epochs == []  # stopped at the step, before the epoch's callbacks
    # Opted out: Keras's behaviour (trains on with a NaN loss).
    model = build("functional", strategy)
    model.check_finite = False
    history = model.fit(x, y, batch_size=32, shuffle=False, verbose=0, callbacks=[Spoil()])
    assert np.isnan(history.history["loss"][0])


def test_non_finite_loss_is_checked_at_epoch_end_with_several_processes():
    # With several processes per-batch logs are each worker's own, so the
    # check reads the (global) epoch logs: every worker stops together.
    from keras.src.utils import python_utils

    from keras_distrib.training import fit_checks

    check = fit_checks.FiniteLossCheck(per_batch=False)
    assert python_utils.is_default(check.on_train_batch_end)
    check.on_train_batch_end(0, {"loss": float("nan")})  # not read
    with pytest.raises(ValueError, match=r"^The training loss is inf in epoch 2: ") as e:
        check.on_epoch_end(1, {"loss": float("inf")})
    _one_line(e)


def test_metric_average_per_batch_must_be_a_bool():
    with pytest.raises(TypeError, match=r"^per_batch='yes' must be True or False\.$") as e:
        kd.callbacks.MetricAverage(per_batch="yes")
    _one_line(e)
    assert kd.callbacks.MetricAverage(per_batch=np.bool_(True)).per_batch is True

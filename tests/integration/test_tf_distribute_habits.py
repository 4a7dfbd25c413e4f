"""Code written for tf.distribute runs as it is (keras_distrib/strategies/from_tf.py).

TensorFlow's "Distributed training with Keras" tutorial and Keras's own
integration test build, compile, fit, evaluate, predict and load inside
`with strategy.scope():`, pass strategy objects and distributed datasets;
on Keras 3 `fit` there fails ("'PerReplica' object has no attribute
'shape'", keras-team/keras#20585). Here the strategy object is adopted.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import as_reference
import keras_distrib as kd
from float_bounds import assert_within, evaluate_apart


def _graph(batch_norm=True):
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activation="relu")(inputs)
    if batch_norm:
        h = keras.layers.BatchNormalization()(h)
    return inputs, keras.layers.Dense(3)(h)


def _data(n=64):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 6)).astype("float32"), rng.integers(0, 3, n).astype("int32")


def _compile(model):
    model.compile(
        optimizer=keras.optimizers.SGD(0.05, momentum=0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[keras.metrics.SparseCategoricalAccuracy()],
    )


def _mirrored():
    return tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])


def test_keras_integration_test_as_written_with_a_distributed_model():
    """keras-team/keras integration_tests/tf_distribute_training_test.py,
    with `kd.DistributedModel` for `models.Model`."""
    x, y = _data()
    strategy = _mirrored()
    with strategy.scope():
        model = kd.DistributedModel(*_graph())
    assert model.strategy.tf_strategy is strategy and model.strategy.num_replicas == 2
    assert all(model.strategy.holds(v) for v in model.variables)
    with strategy.scope():
        _compile(model)
        history = model.fit(x, y, batch_size=8, epochs=2, validation_split=0.25, verbose=0)
    assert np.isfinite(history.history["val_loss"]).all()
    with strategy.scope():
        dataset = strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
        )
        model.fit(dataset, epochs=1, verbose=0)
        results = model.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
        predictions = model.predict(x, batch_size=8, verbose=0)
    assert predictions.shape == (64, 3) and np.isfinite(results["loss"])


@pytest.mark.parametrize("kind", ["object", "scope"])
def test_a_mirrored_strategy_trains_as_ours_does(kind):
    """The user's MirroredStrategy object (given, or the scope's) trains
    exactly as strategy="mirrored"."""
    x, y = _data()
    ours = kd.DistributedModel(*_graph(), strategy="mirrored")
    engine = _mirrored()
    if kind == "object":
        theirs = kd.DistributedModel(*_graph(), strategy=engine)
    else:
        with engine.scope():
            theirs = kd.DistributedModel(*_graph())
    theirs.set_weights(ours.get_weights())
    for model in (ours, theirs):
        _compile(model)
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert type(theirs.strategy).__name__ == "Mirrored"
    # One strategy class over the same two devices: the same kernels on the
    # same shards, and a cross-replica sum of two values, which float
    # addition gives alike in either order.
    for a, b in zip(ours.get_weights(), theirs.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_other_in_process_strategies_map_to_ours():
    one = kd.strategies.get(tf.distribute.OneDeviceStrategy("/cpu:1"))
    assert one.name == "single" and one.devices == ("/device:CPU:1",)
    engine = tf.distribute.experimental.CentralStorageStrategy(["CPU:0", "CPU:1"])
    central = kd.strategies.get(engine)
    assert central.name == "central_storage" and central.tf_strategy is engine
    assert central.parameter_device == "/device:CPU:0"
    x, y = _data()
    with engine.scope():  # BatchNormalization's state, made in their scope, works too
        model = kd.DistributedModel(*_graph())
        _compile(model)
    model.fit(x, y, batch_size=8, verbose=0)
    assert model.strategy is central
    with pytest.raises(
        ValueError,
        match=r"Options \['devices'\] were given with a "
        r"tf.distribute strategy object",
    ):
        kd.strategies.get(tf.distribute.OneDeviceStrategy("/cpu:0"), devices=["/cpu:0"])


def test_load_model_compile_evaluate_in_the_scope(tmp_path):
    """The tutorial's "save, then load in a strategy's scope" step."""
    x, y = _data()
    saved = kd.DistributedModel(*_graph(), strategy="single")
    _compile(saved)
    saved.fit(x, y, batch_size=8, verbose=0)
    saved.save(tmp_path / "m.keras")
    strategy = _mirrored()
    with strategy.scope():
        loaded = keras.models.load_model(tmp_path / "m.keras")
        _compile(loaded)
        loss = loaded.evaluate(x, y, batch_size=8, verbose=0)
    assert isinstance(loaded, kd.DistributedModel) and loaded.strategy.tf_strategy is strategy
    assert_within(
        loss,
        saved.evaluate(x, y, batch_size=8, verbose=0),
        evaluate_apart(saved, x, y, 8),
        "evaluate",
    )
    with strategy.scope():
        loaded.fit(x, y, batch_size=8, verbose=0)


def test_datasets_distributed_by_tensorflow_are_used_as_the_global_batches():
    x, y = _data()
    engine = _mirrored()
    model = kd.DistributedModel(*_graph(batch_norm=False), strategy=engine)
    plain = keras.Model(*_graph(batch_norm=False))
    plain.set_weights(model.get_weights())
    _compile(model)
    _compile(plain)

    def per_replica(context):
        batch = context.get_per_replica_batch_size(16)
        return (
            tf.data.Dataset.from_tensor_slices((x, y))
            .shard(context.num_input_pipelines, context.input_pipeline_id)
            .batch(batch)
        )

    model.fit(engine.distribute_datasets_from_function(per_replica), verbose=0)
    model.fit(
        engine.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
        ),
        verbose=0,
    )
    reference = as_reference.fit(plain, x, y, 16, epochs=2)
    assert int(model.optimizer.iterations.numpy()) == 8
    as_reference.assert_weights(reference, model)


def test_another_strategy_named_inside_a_scope_is_a_one_line_error():
    with _mirrored().scope():
        with pytest.raises(
            ValueError,
            match=r"Strategy 'pipeline' was asked for inside the "
            r"scope of strategy 'mirrored'; build the model outside",
        ) as e:
            kd.DistributedModel(*_graph(), strategy="pipeline")
    assert "\n" not in str(e.value)

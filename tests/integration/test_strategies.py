"""The strategy registry and its errors."""

import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

import as_reference
import keras_distrib as kd
from keras_distrib import strategies
from helpers import build, make_data


def test_available_lists_names_with_descriptions():
    names = strategies.available()
    assert {"single", "mirrored", "auto"} <= set(names)
    assert all(isinstance(d, str) and d and "\n" not in d for d in names.values())


@pytest.mark.parametrize(
    "name,cls",
    [
        ("single", strategies.SingleDevice),
        ("one_device", strategies.SingleDevice),
        ("ONE-DEVICE", strategies.SingleDevice),
        ("mirrored", strategies.Mirrored),
        ("auto", strategies.Mirrored),  # two logical CPUs in this process
    ],
)
def test_get_by_name_and_alias(name, cls):
    strategy = strategies.get(name)
    assert isinstance(strategy, cls)
    assert strategy.rank == 0 and strategy.world_size == 1 and strategy.is_chief


def test_mirrored_uses_all_logical_cpus_and_single_one():
    mirrored = strategies.get("mirrored")
    assert mirrored.num_replicas == 2
    assert len(mirrored.devices) == 2
    assert strategies.get("single").num_replicas == 1


def test_instance_beats_string():
    strategy = strategies.get("single")
    assert strategies.get(strategy) is strategy
    model = build("functional", strategy)
    assert model.strategy is strategy


def test_unknown_name_lists_valid_ones():
    with pytest.raises(ValueError) as e:
        strategies.get("mirorred")
    message = str(e.value)
    assert "mirorred" in message and "'mirrored'" in message and "'single'" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    "name,options,fragment",
    [
        ("mirrored", {"devcies": ["/cpu:0"]}, "does not take option(s) ['devcies']"),
        ("mirrored", {"cross_device_ops": "carrier_pigeon"}, "Unknown cross_device_ops"),
        ("mirrored", {"cross_device_ops": "nccl"}, "needs GPU devices"),
        ("mirrored", {"devices": ["/cpu:7"]}, "does not exist"),
        ("mirrored", {"devices": ["/cpu:0", "/cpu:0"]}, "listed twice"),
        ("mirrored", {"devices": "/cpu:0"}, "must be a list"),
        ("single", {"device": "/gpu:3"}, "does not exist"),
    ],
)
def test_bad_options_are_one_line_errors(name, options, fragment):
    with pytest.raises(ValueError) as e:
        strategies.get(name, **options)
    assert fragment in str(e.value)
    assert "\n" not in str(e.value)


def test_options_with_an_instance_are_rejected():
    with pytest.raises(ValueError, match="strategy object"):
        strategies.get(strategies.get("single"), device="/cpu:0")


def test_wrong_type_is_rejected():
    with pytest.raises(TypeError, match="strategy must be a name"):
        kd.DistributedModel(*_graph(), strategy=42)


def test_mirrored_with_chosen_devices_and_reduction():
    strategy = strategies.get(
        "mirrored", devices=["/cpu:0", "/cpu:1"], cross_device_ops="reduction_to_one_device"
    )
    x, y = make_data()
    model = build("functional", strategy)
    reference = build("functional", "single")
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    as_reference.assert_weights(as_reference.fit(reference, x, y, 32, outputs=False), model)


def test_single_with_device_places_variables():
    model = build("functional", strategies.get("single", device="/cpu:1"))
    assert all(v.value.device.endswith("CPU:1") for v in model.variables)


def test_two_mirrored_models_of_different_shapes_in_one_process():
    """TF reuses collective keys across MirroredStrategy objects; we must not."""
    x, y = make_data()
    a = build("functional", "mirrored")
    inputs = keras.Input((x.shape[1],))
    b = kd.DistributedModel(inputs, keras.layers.Dense(3)(inputs), strategy="mirrored")
    b.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    for model in (a, b, a):
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)


def test_auto_is_single_with_one_device():
    code = textwrap.dedent("""
        import keras_distrib as kd
        s = kd.strategies.get("auto")
        print(type(s).__name__, s.num_replicas)
    """)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == ["SingleDevice", "1"]


def _graph():
    inputs = keras.Input((4,))
    return inputs, keras.layers.Dense(1)(inputs)


def test_all_reduce_of_values_passed_straight_through():
    """With one local replica the batch reaches the replica untouched (no
    device); reducing it must still work."""
    import tensorflow as tf

    strategy = strategies.get("mirrored", devices=["/cpu:0"])

    @tf.function
    def step(x):
        per_replica = strategy.run(lambda shard: strategy.all_reduce([shard, shard * 2], "sum"), x)
        return strategy.concat(per_replica)

    total, doubled = step(tf.ones([4, 2]))
    np.testing.assert_array_equal(total, np.ones([4, 2]))
    np.testing.assert_array_equal(doubled, 2 * np.ones([4, 2]))

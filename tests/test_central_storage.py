"""`central_storage`: variables on one device, 2 replicas == one device."""

import numpy as np
import pytest

import keras_distrib as kd
from helpers import assert_trains_like_single, build, make_data

FORMS = ["functional", "subclass", "from_model"]
BATCH, EPOCHS = 32, 2  # 203 samples: 7 steps per epoch (last 11 rows), 14 SGD steps


@pytest.fixture(scope="module")
def data():
    return make_data()


@pytest.mark.parametrize("form", FORMS)
def test_matches_single(form, data):
    x, y = data
    central = assert_trains_like_single(form, "central_storage", x, y, BATCH, EPOCHS,
                                        steps=EPOCHS * 7)
    strategy = central.strategy
    assert type(strategy).__name__ == "CentralStorage"
    assert strategy.num_replicas == 2 and len(strategy.devices) == 2
    # One copy of every variable, on the parameter device (the CPU).
    assert all(strategy.holds(v) for v in central.variables)
    assert {v.value.device for v in central.trainable_variables} == {
        "/job:localhost/replica:0/task:0/device:CPU:0"}


def test_metrics_accumulate_over_batches(data):
    """Keras adds to metric variables by assign(self + v); on one aggregating
    copy for two replicas that would count the running total twice."""
    x, y = data
    single = build("functional", "single")
    central = build("functional", "central_storage")
    for batch in (32, 2):
        np.testing.assert_allclose(single.evaluate(x, y, batch_size=batch, verbose=0),
                                   central.evaluate(x, y, batch_size=batch, verbose=0),
                                   atol=1e-5)


def test_named_devices(data):
    strategy = kd.strategies.get("central_storage", compute_devices=["/cpu:0", "/cpu:1"],
                                 parameter_device="/cpu:1")
    assert strategy.parameter_device.endswith("CPU:1")
    model = build("functional", strategy)
    assert {v.value.device for v in model.trainable_variables} == {
        "/job:localhost/replica:0/task:0/device:CPU:1"}
    x, y = data
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)


@pytest.mark.parametrize("options,fragment", [
    ({"compute_devices": ["/gpu:7"]}, "does not exist"),
    ({"compute_devices": "/cpu:0"}, "must be a list"),
    ({"parameter_device": "/tpu:0"}, "does not exist"),
    ({"cores": 2}, "does not take option"),
])
def test_bad_options(options, fragment):
    with pytest.raises(ValueError, match=fragment):
        kd.strategies.get("central_storage", **options)


def test_alias_and_listing():
    assert "central_storage" in kd.strategies.available()
    assert type(kd.strategies.get("central")).__name__ == "CentralStorage"
    assert isinstance(kd.strategies.get("central_storage"), kd.strategies.Strategy)

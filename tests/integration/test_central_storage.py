"""`central_storage`: variables on one device, 2 replicas == one device."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_distrib as kd
import as_reference
from float_bounds import assert_within, evaluate_apart, outputs_apart
from helpers import assert_trains_like_single, build, make_data

FORMS = ["functional", "subclass", "from_model"]
BATCH, EPOCHS = 32, 2  # 203 samples: 7 steps per epoch (last 11 rows), 14 SGD steps


@pytest.mark.parametrize("form", FORMS)
def test_matches_single(form, data):
    x, y = data
    central = assert_trains_like_single(
        form, "central_storage", x, y, BATCH, EPOCHS, steps=EPOCHS * 7
    )
    strategy = central.strategy
    assert type(strategy).__name__ == "CentralStorage"
    assert strategy.num_replicas == 2 and len(strategy.devices) == 2
    # One copy of every variable, on the parameter device (the CPU).
    assert all(strategy.holds(v) for v in central.variables)
    assert {v.value.device for v in central.trainable_variables} == {
        "/job:localhost/replica:0/task:0/device:CPU:0"
    }


_OPTIMIZERS = {
    "nadam": lambda: keras.optimizers.Nadam(0.01),
    "ema": lambda: keras.optimizers.SGD(0.1, use_ema=True, ema_momentum=0.9),
    "loss_scale": lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01)),
    "muon": lambda: keras.optimizers.Muon(0.01),
}


class GuideStepModel(kd.DistributedModel):
    """The train_step of Keras's guide: the optimizer is called by the user."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(y=y, y_pred=self(x, training=True))
            scaled = self.optimizer.scale_loss(loss)  # a LossScaleOptimizer's scale
        self.optimizer.apply(
            tape.gradient(scaled, self.trainable_variables), self.trainable_variables
        )
        return {"loss": loss}


@pytest.mark.parametrize("custom_step", [False, True], ids=["our_step", "guide_step"])
@pytest.mark.parametrize("name", sorted(_OPTIMIZERS))
def test_optimizers_that_assign_their_own_variables(name, custom_step, data):
    """Nadam (its u_product), Muon, EMA copies and a LossScaleOptimizer's
    scale assign variables of their own in the replica context; on one
    aggregating copy that failed ("You must specify an aggregation method
    to update a AggregatingVariable in Replica Context"). The update now
    runs once, from the cross-replica context, as on one device."""
    x, y = data
    if custom_step:  # Keras's custom steps average per replica: equal shares only
        x, y = x[:192], y[:192]
    plain = build("functional", "single", compile_model=False)
    central = (
        GuideStepModel(plain.inputs, plain.outputs, strategy="central_storage")
        if custom_step
        else build("functional", "central_storage", compile_model=False)
    )
    central.set_weights(plain.get_weights())
    for model in (plain, central):
        model.compile(
            optimizer=_OPTIMIZERS[name](),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    reference = as_reference.fit(plain, x, y, BATCH, EPOCHS, slots=True)
    central.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    assert int(central.optimizer.iterations.numpy()) == EPOCHS * (6 if custom_step else 7)
    as_reference.assert_weights(reference, central)
    variables = central.optimizer.variables
    assert len(variables) == len(reference.slots)
    for a, b, bound in zip(plain.optimizer.variables, variables, reference.slots):
        assert_within(np.asarray(b), np.asarray(a), bound, a.path)


def test_jit_compile_true_runs_without_xla_and_says_why(data):
    """XLA cannot read variables on another device than the replica's: the
    first step failed ("Trying to access resource ... located in device
    CPU:0 from device CPU:1"); Keras's jit_compile="auto" asks for XLA on
    GPU machines. Now the step runs without XLA, with a warning for True."""
    x, y = data
    plain = build("functional", "single", jit_compile=True)
    central = build("functional", "central_storage", compile_model=False)
    central.set_weights(plain.get_weights())
    with pytest.warns(
        UserWarning,
        match=r"jit_compile=True is not possible with "
        r"strategy='central_storage': XLA cannot read the variables",
    ):
        central.compile(
            optimizer=keras.optimizers.SGD(0.1),
            jit_compile=True,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    assert central.jit_compile is False
    reference = as_reference.fit(plain, x, y, BATCH, EPOCHS)
    central.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    as_reference.assert_weights(reference, central)
    as_reference.assert_predict(reference, central.predict(x, verbose=0), x)


def test_jit_compile_set_true_after_compile_warns_and_stays_off(data):
    """`model.jit_compile = True` after `compile` (Keras's public setter)
    made the next step function with XLA, which failed as above."""
    x, y = data
    plain = build("functional", "single")
    central = build("functional", "central_storage", compile_model=False)
    central.set_weights(plain.get_weights())
    central.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    with pytest.warns(
        UserWarning,
        match=r"jit_compile=True is not possible with "
        r"strategy='central_storage'",
    ):
        central.jit_compile = True
    assert central.jit_compile is False
    reference = as_reference.fit(plain, x, y, BATCH)
    central.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    as_reference.assert_weights(reference, central)


def test_predict_before_compile_on_a_machine_where_keras_picks_xla(data, monkeypatch):
    """Uncompiled, `jit_compile` is Keras's "auto", which resolves to True on
    GPU machines (stood in for here by Keras's own resolver answering True):
    `predict` then compiled with XLA and failed."""
    monkeypatch.setattr(keras.Model, "_resolve_auto_jit_compile", lambda self: True)
    x, _ = data
    plain = build("functional", "single", compile_model=False)
    central = build("functional", "central_storage", compile_model=False)
    central.set_weights(plain.get_weights())
    assert plain.jit_compile is True and central.jit_compile is False
    assert_within(
        central.predict(x, verbose=0),
        plain.predict(x, verbose=0),
        outputs_apart(plain, x),
        "predict",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "auto" turns XLA off silently
        central.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    assert central.jit_compile is False


def test_jit_compile_with_variables_on_the_one_compute_device(data):
    """Where the one replica computes beside the variables, XLA compiles its step."""
    strategy = kd.strategies.get(
        "central_storage", compute_devices=["/cpu:1"], parameter_device="/cpu:1"
    )
    model = build("functional", strategy, jit_compile=True)
    assert model.jit_compile is True
    x, y = data
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)


def _twins(graph, strategies, seed=3):
    """One DistributedModel per strategy over `graph()`, all with the same weights."""
    models = []
    for strategy in strategies:
        keras.utils.set_random_seed(seed)
        models.append(kd.DistributedModel(*graph(), strategy=strategy))
    for model in models[1:]:
        model.set_weights(models[0].get_weights())
    return models


def test_layers_with_state_train_like_mirrored():
    """BatchNormalization's moving statistics and the seed state of Dropout
    and GaussianNoise have no aggregation; one copy of them failed the first
    step ("You must specify an aggregation method to update a
    AggregatingVariable in Replica Context"). Each replica normalizes by its
    own shard's statistics, as under mirrored: the same weights and moving
    statistics as mirrored, and the random layers train."""
    x, y = make_data(n=128)

    def batch_norm():
        inputs = keras.Input((x.shape[1],))
        h = keras.layers.BatchNormalization()(keras.layers.Dense(16, activation="relu")(inputs))
        return inputs, keras.layers.Dense(3)(h)

    mirrored, central = _twins(batch_norm, ["mirrored", "central_storage"])
    for model in (mirrored, central):
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    # The same shards on the same two devices run the same kernels under
    # both; what crosses replicas is a sum of two values, which float
    # addition gives alike in either order: equal, moving statistics too.
    for a, b in zip(mirrored.get_weights(), central.get_weights()):
        np.testing.assert_array_equal(a, b)

    def noisy():
        inputs = keras.Input((x.shape[1],))
        h = keras.layers.Dropout(0.3)(keras.layers.Dense(16, activation="relu")(inputs))
        return inputs, keras.layers.Dense(3)(keras.layers.GaussianNoise(0.1)(h))

    (model,) = _twins(noisy, ["central_storage"])
    seeds = [v for v in model.non_trainable_variables if "seed" in v.path]
    assert len(seeds) == 2
    before = [np.asarray(v).copy() for v in seeds]
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0).history
    assert np.all(np.isfinite(history["loss"]))
    assert all(not np.array_equal(a, np.asarray(b)) for a, b in zip(before, seeds))


def test_each_replica_reads_its_own_added_losses():
    """Replicas take turns at every variable update; one replica's forward
    pass replaced the other's activity-regularizer losses before Keras's
    compute_loss read them (it updates the per-output loss metrics first):
    weights 1e-3 off one device with two outputs."""
    x, y = make_data(n=128)

    def two_outputs():
        inputs = keras.Input((x.shape[1],))
        h = keras.layers.Dense(
            16, activation="relu", activity_regularizer=keras.regularizers.L1(0.01)
        )(inputs)
        return inputs, {
            "a": keras.layers.Dense(3, name="a")(h),
            "b": keras.layers.Dense(1, name="b")(h),
        }

    single, central = _twins(two_outputs, ["single", "central_storage"])
    targets = {"a": y, "b": x[:, :1]}
    for model in (single, central):
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss={"a": keras.losses.SparseCategoricalCrossentropy(from_logits=True), "b": "mse"},
        )
    reference = as_reference.fit(single, x, targets, BATCH, EPOCHS)
    central.fit(x, targets, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    as_reference.assert_weights(reference, central)


def test_mixed_float16_policy_wraps_the_optimizer_it_adopts():
    """Keras's compile wraps the optimizer in a LossScaleOptimizer under the
    "mixed_float16" policy, after the strategy adopted the inner one: its
    loss-scale update failed the first step ("`merge_call` called while
    defining a new graph or a tf.function")."""
    x, y = make_data(n=128)

    def graph():
        inputs = keras.Input((x.shape[1],))
        logits = keras.layers.Dense(3)(keras.layers.Dense(16, activation="relu")(inputs))
        return inputs, keras.layers.Activation("linear", dtype="float32")(logits)

    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        single, central = _twins(graph, ["single", "central_storage"])
        for model in (single, central):
            model.compile(
                optimizer=keras.optimizers.SGD(0.1),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
            model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert type(central.optimizer).__name__ == "LossScaleOptimizer"
    steps = EPOCHS * 4
    assert int(central.optimizer.iterations.numpy()) == steps
    # What varies: each replica's float16 matmuls sum over its 16 rows where
    # one device sums over 32 (and oneDNN picks its kernel, and so its
    # accumulation order, by shape), so every step's float16 gradient may
    # differ by float16's rounding of its magnitude. The weights (float32)
    # then differ by at most lr * eps16 * |gradient| per step, summed over
    # the steps. A reduction gone wrong is off by a whole update.
    bound = steps * 0.1 * np.finfo(np.float16).eps * _largest_gradient(single, x, y)
    for a, b in zip(single.get_weights(), central.get_weights()):
        np.testing.assert_allclose(a, b, atol=bound, rtol=0)
    assert bound < 0.1 * max(np.abs(w).max() for w in single.get_weights())


def _largest_gradient(model, x, y) -> float:
    """Twice the largest gradient element over `x`'s batches of `BATCH` rows
    at `model`'s final weights: a bound on the gradients of the few steps
    before (the weights barely moved)."""
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    largest = 0.0
    for start in range(0, len(x), BATCH):
        with tf.GradientTape() as tape:
            value = loss(
                y[start : start + BATCH],
                tf.cast(model(x[start : start + BATCH], training=True), tf.float32),
            )
        grads = tape.gradient(value, model.trainable_variables)
        largest = max(largest, *(float(tf.reduce_max(tf.abs(g))) for g in grads))
    return 2 * largest


def test_metrics_accumulate_over_batches(data):
    """Keras adds to metric variables by assign(self + v); on one aggregating
    copy for two replicas that would count the running total twice."""
    x, y = data
    single = build("functional", "single")
    central = build("functional", "central_storage")
    for batch in (32, 2):
        assert_within(
            central.evaluate(x, y, batch_size=batch, verbose=0),
            single.evaluate(x, y, batch_size=batch, verbose=0),
            evaluate_apart(single, x, y, batch),
            f"batch {batch}",
        )


def test_named_devices(data):
    strategy = kd.strategies.get(
        "central_storage", compute_devices=["/cpu:0", "/cpu:1"], parameter_device="/cpu:1"
    )
    assert strategy.parameter_device.endswith("CPU:1")
    model = build("functional", strategy)
    assert {v.value.device for v in model.trainable_variables} == {
        "/job:localhost/replica:0/task:0/device:CPU:1"
    }
    x, y = data
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)


@pytest.mark.parametrize(
    "options,fragment",
    [
        ({"compute_devices": ["/gpu:7"]}, "does not exist"),
        ({"compute_devices": "/cpu:0"}, "must be a list"),
        ({"parameter_device": "/tpu:0"}, "does not exist"),
        ({"cores": 2}, "does not take option"),
    ],
)
def test_bad_options(options, fragment):
    with pytest.raises(ValueError, match=fragment):
        kd.strategies.get("central_storage", **options)


def test_alias_and_listing():
    assert "central_storage" in kd.strategies.available()
    assert type(kd.strategies.get("central")).__name__ == "CentralStorage"
    assert isinstance(kd.strategies.get("central_storage"), kd.strategies.Strategy)

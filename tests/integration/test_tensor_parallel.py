"""`strategy="tensor_parallel"`: Dense/Embedding layers split over the 2 logical CPUs.

The core assertion: after SGD steps on the same global batches, the split
model holds the same (gathered) weights as `"single"` and gives the same
losses, evaluate and predict results (each within the bound of float32's
rounding of the same math in other orders, `as_reference`), while its
variables really live on both devices.
"""

import os
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import as_reference
import keras_distrib as kd
from float_bounds import assert_within, outputs_apart
from helpers import CLASSES, FEATURES, Crash, CrashAfter, Net, build, plain_model, weights_moved

DEVICES = ("/device:CPU:0", "/device:CPU:1")
BATCH, EPOCHS, STEPS = 32, 2, 14  # 203 samples: 7 steps per epoch, the last 11 rows


def tensor_parallel(**options):
    return kd.strategies.get("tensor_parallel", **options)


def device_of(variable):
    placed = variable.value.device
    return next(d for d in DEVICES if placed.endswith(d))


def devices_of(model):
    return {device_of(v) for v in model.weights}


def single_run(single, x, y, epochs=EPOCHS):
    """`single` trained on (`x`, `y`) as `assert_matches_single` trains the
    split model (one step per call: the trace follows steps), traced."""
    return as_reference.fit(single, x, y, BATCH, epochs)


def assert_matches_single(reference, model, x, y, steps=STEPS, epochs=EPOCHS):
    """Trains `model` as the traced `reference` ("single") was trained; the
    same gathered weights, history, evaluate and predict, each within the
    bound of float32's rounding of the same math in other orders."""
    history = model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)
    single = reference.model
    initial = reference.trace.weights[0]
    assert any(not np.allclose(np.asarray(a), b) for a, b in zip(single.trainable_weights, initial))
    assert int(model.optimizer.iterations.numpy()) == steps >= 10
    whole = model.get_weights()
    assert [w.shape for w in whole] == [w.shape for w in single.get_weights()]
    as_reference.assert_weights(reference, whole)
    as_reference.assert_history(reference, history.history, reference.logs)
    as_reference.assert_evaluate(
        reference, model.evaluate(x, y, batch_size=BATCH, verbose=0), x, y, BATCH
    )
    as_reference.assert_predict(reference, model.predict(x, batch_size=BATCH, verbose=0), x, BATCH)


@pytest.fixture(scope="module")
def mlp_single(data):
    """The MLP of `build` on "single", trained and traced: the run every
    split of it is compared with."""
    return single_run(build("functional", "single"), *data)


# -- equivalence with "single" -----------------------------------------------------------


@pytest.mark.parametrize("form", ["functional", "from_model"])
def test_default_plan_alternates_column_row_and_matches_single(form, data, mlp_single):
    x, y = data
    model = build(form, "tensor_parallel")
    assert model.strategy.plan().kinds == {"hidden": "column", "logits": "row"}
    assert devices_of(model) == set(DEVICES)
    for layer in model.layers:
        for v in layer.weights:  # every shard on its own device
            if "_shard" in v.path:
                assert device_of(v) == DEVICES[int(v.path[-1])]
    assert_matches_single(mlp_single, model, x, y)


@pytest.mark.parametrize(
    "layout,kinds",
    [
        ({"hidden": "column", "logits": "column"}, ("column", "column")),  # 3 units: 2 + 1
        ({".*": "row"}, ("row", "row")),  # hidden's input sliced (no column producer)
        ({"logits": "whole"}, ("column", "whole")),
    ],
)
def test_explicit_layouts_match_single(layout, kinds, data, mlp_single):
    x, y = data
    model = build("functional", tensor_parallel(layout=layout))
    assert model.strategy.plan().kinds == dict(zip(("hidden", "logits"), kinds))
    for name, kind in zip(("hidden", "logits"), kinds):
        weights = model.get_layer(name).weights
        split = [v for v in weights if "_shard" in v.path]
        if kind == "whole":
            assert not split and len({device_of(v) for v in weights}) == 1
        else:
            assert {device_of(v) for v in split} == set(DEVICES)
    assert_matches_single(mlp_single, model, x, y)


def test_whole_layers_are_spread_by_size(data):
    """Two whole layers: the second goes to the device holding fewer bytes."""
    model = build("functional", tensor_parallel(layout={".*": "whole"}))
    hidden, logits = (model.get_layer(n) for n in ("hidden", "logits"))
    assert {device_of(v) for v in hidden.weights} == {DEVICES[0]}
    assert {device_of(v) for v in logits.weights} == {DEVICES[1]}


def _sequence_data(n=203, length=5, vocab=11, seed=1):
    rng = np.random.default_rng(seed)
    return (
        rng.integers(0, vocab, size=(n, length)).astype("int32"),
        rng.integers(0, CLASSES, size=n).astype("int32"),
    )


def _embedding_model(strategy, vocab=11):
    keras.utils.set_random_seed(11)
    inputs = keras.Input((5,), dtype="int32")
    h = keras.layers.Embedding(vocab, 6, name="embed")(inputs)
    h = keras.layers.GlobalAveragePooling1D()(h)
    h = keras.layers.LayerNormalization(name="norm")(h)
    outputs = keras.layers.Dense(CLASSES, name="logits")(h)
    model = kd.DistributedModel(inputs, outputs, strategy=strategy)
    model.compile(
        optimizer=keras.optimizers.SGD(0.5),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


@pytest.fixture(scope="module")
def embedding_single():
    """The embedding model on "single", trained and traced."""
    return single_run(_embedding_model("single"), *_sequence_data())


@pytest.mark.parametrize("embed_kind", ["row", "column"])
def test_embedding_split_by_vocabulary_or_features_matches_single(embed_kind, embedding_single):
    x, y = _sequence_data()
    layout = {} if embed_kind == "row" else {"embed": "column"}
    model = _embedding_model(tensor_parallel(layout=layout))
    kinds = model.strategy.plan().kinds
    # Embedding: vocabulary rows by default; LayerNormalization: whole.
    assert kinds == {"embed": embed_kind, "norm": "whole", "logits": "column"}
    shards = [v for v in model.get_layer("embed").weights]
    assert [device_of(v) for v in shards] == list(DEVICES)
    assert [tuple(v.shape) for v in shards] == (
        [(6, 6), (5, 6)] if embed_kind == "row" else [(11, 3), (11, 3)]
    )
    assert_matches_single(embedding_single, model, x, y)


def _masked_lstm_model(strategy):
    """A graph with operations that are not layers: the mask of
    `Embedding(mask_zero=True)` (`NotEqual`) and a `keras.ops` call."""
    keras.utils.set_random_seed(12)
    inputs = keras.Input((5,), dtype="int32")
    h = keras.layers.LSTM(8)(keras.layers.Embedding(11, 6, mask_zero=True)(inputs))
    h = keras.layers.Dense(16, activation="relu")(keras.ops.cast(h, "float32") * 2.0)
    model = kd.DistributedModel(inputs, keras.layers.Dense(CLASSES)(h), strategy=strategy)
    model.compile(
        optimizer=keras.optimizers.SGD(0.5),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def test_a_graph_with_operations_that_are_not_layers_matches_single():
    # Laying out the copy asked each node for its weights: "'NotEqual' object
    # has no attribute 'set_weights'".
    x, y = _sequence_data()
    x[:, 3:] = 0  # masked steps
    reference = single_run(_masked_lstm_model("single"), x, y)
    assert_matches_single(reference, _masked_lstm_model(tensor_parallel()), x, y)


def test_adam_slots_live_with_their_shards_and_match_single(data):
    x, y = data
    model = build("functional", "tensor_parallel", optimizer=keras.optimizers.Adam(0.01))
    single = build("functional", "single", optimizer=keras.optimizers.Adam(0.01))
    assert_matches_single(single_run(single, x, y), model, x, y)
    # Slots are named "<optimizer name>/<weight path>_<slot>"; the optimizer's
    # name depends on how many Adams this process made ("adam", "adam_1", ...).
    slots = {v.path.split("/", 1)[1]: v for v in model.optimizer.variables}
    for weight in model.trainable_weights:
        for slot in ("momentum", "velocity"):
            path = f"{weight.path.replace('/', '_')}_{slot}"
            assert device_of(slots[path]) == device_of(weight), path
    # The plan counts them where they are: two slots per weight byte, plus
    # the optimizer's step counters (on the first device).
    plan = model.strategy.plan(model)
    counters = sum(v.numpy().nbytes for v in model.optimizer.variables if len(v.shape) == 0)
    assert sum(plan.optimizer_bytes_per_device.values()) == 2 * plan.total_bytes + counters
    for device, weight_bytes in plan.bytes_per_device.items():
        slot_bytes = plan.optimizer_bytes_per_device[device]
        assert slot_bytes - 2 * weight_bytes in (0, counters), device


_CLIPPING = {
    "adam": lambda: keras.optimizers.Adam(0.01, clipnorm=0.02),
    "loss_scale": lambda: keras.optimizers.LossScaleOptimizer(
        keras.optimizers.Adam(0.01, clipnorm=0.02)
    ),
    "sgd": lambda: keras.optimizers.SGD(0.5, clipnorm=0.05),
}


@pytest.mark.parametrize(
    "model_kind,optimizer", [("mlp", "adam"), ("mlp", "loss_scale"), ("embedding", "sgd")]
)
def test_clipnorm_clips_a_split_variable_by_its_whole_norm(model_kind, optimizer, data):
    """Keras clips each variable by its own norm; each part of a split
    kernel was clipped by the part's (3e-2 off one device). The embedding's
    gradients are sparse (IndexedSlices)."""

    def compiled(strategy):
        if model_kind == "mlp":
            model = build("functional", strategy, compile_model=False)
        else:
            model = _embedding_model(strategy)
        model.compile(
            optimizer=_CLIPPING[optimizer](),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        return model

    x, y = data if model_kind == "mlp" else _sequence_data()
    model = compiled("tensor_parallel")
    assert (
        len(model.strategy.plan().kinds) >= 2 and "column" in model.strategy.plan().kinds.values()
    )
    single = compiled("single")
    single.set_weights(model.get_weights())
    assert_matches_single(single_run(single, x, y), model, x, y)


@pytest.mark.parametrize("name", ["Adafactor", "Lamb", "Muon"])
def test_optimizers_reading_whole_variables_are_one_line_errors(name, data):
    x, y = data
    model = build(
        "functional",
        "tensor_parallel",
        optimizer=getattr(keras.optimizers, name)(learning_rate=0.01),
    )
    with pytest.raises(ValueError, match=f"optimizer {name} updates each variable") as error:
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert "\n" not in str(error.value) and "element-wise optimizer" in str(error.value)
    # Kept whole, the same layers train with it.
    whole = build(
        "functional",
        tensor_parallel(layout={".*": "whole"}),
        optimizer=getattr(keras.optimizers, name)(learning_rate=0.01),
    )
    whole.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)


def test_sequential_from_model_matches_single(data):
    x, y = data

    def sequential():
        keras.utils.set_random_seed(7)
        return keras.Sequential(
            [
                keras.Input((FEATURES,)),
                keras.layers.Dense(16, activation="relu", name="hidden"),
                keras.layers.Dense(CLASSES, name="logits"),
            ]
        )

    def wrap(strategy):
        model = kd.DistributedModel.from_model(sequential(), strategy=strategy)
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        return model

    model = wrap("model_parallel")  # the alias
    assert model.strategy.name == "tensor_parallel"
    assert devices_of(model) == set(DEVICES)
    assert_matches_single(single_run(wrap("single"), x, y), model, x, y)


def test_distributed_optimizer_accumulation_and_steps_per_execution(data, mlp_single):
    x, y = data

    def make(strategy, **compile_kwargs):
        optimizer = kd.optimizers.DistributedOptimizer(
            keras.optimizers.SGD(0.1), backward_passes_per_step=2
        )
        return build("functional", strategy, optimizer=optimizer, **compile_kwargs)

    # 21 batches: gradients applied every 2nd one.
    accumulated = single_run(make("single"), x, y, epochs=3)
    assert_matches_single(accumulated, make("tensor_parallel"), x, y, steps=10, epochs=3)
    # Three steps per call end as one step per call ("single", traced).
    assert_matches_single(
        mlp_single, build("functional", "tensor_parallel", steps_per_execution=3), x, y
    )


# -- the pair keeps its activation split -----------------------------------------------------


def _ops_reaching_output(model, x):
    """Op types the traced forward pass needs to produce its output."""
    forward = tf.function(lambda batch: model(batch, training=False))
    graph = forward.get_concrete_function(tf.constant(x[:4])).graph
    needed, todo = set(), [t.op for t in graph.outputs]
    while todo:
        op = todo.pop()
        if op.name in needed:
            continue
        needed.add(op.name)
        todo.extend(t.op for t in op.inputs)
        todo.extend(op.control_inputs)
    return [graph.get_operation_by_name(n).type for n in needed]


def test_a_row_layer_takes_its_column_producers_parts_without_a_gather(data):
    x, _ = data
    paired = build("functional", "tensor_parallel", compile_model=False)
    needed = _ops_reaching_output(paired, x)
    assert "ConcatV2" not in needed and "StridedSlice" not in needed
    assert needed.count("MatMul") == 4
    # Control: both layers column-split, so the hidden output is gathered.
    gathered = build("functional", tensor_parallel(layout={".*": "column"}), compile_model=False)
    assert "ConcatV2" in _ops_reaching_output(gathered, x)


# -- memory per device ------------------------------------------------------------------------


def test_each_device_holds_about_half_of_a_split_mlp():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((32,))
    h = keras.layers.Dense(64, activation="relu", name="up")(inputs)
    h = keras.layers.Dense(64, activation="relu", name="down")(h)
    h = keras.layers.Dense(64, activation="relu", name="up2")(h)
    outputs = keras.layers.Dense(10, name="out")(h)
    model = kd.DistributedModel(inputs, outputs, strategy="tensor_parallel")
    total = sum(int(np.prod(v.shape)) for v in model.weights)
    assert total == 32 * 64 + 64 + 2 * (64 * 64 + 64) + 64 * 10 + 10
    per_device = {d: 0 for d in DEVICES}
    for v in model.weights:
        per_device[device_of(v)] += int(np.prod(v.shape)) * 4
    assert max(per_device.values()) <= 0.55 * total * 4
    assert min(per_device.values()) >= 0.45 * total * 4
    plan = model.strategy.plan()
    assert plan.kinds == {"up": "column", "down": "row", "up2": "column", "out": "row"}
    assert plan.bytes_per_device == per_device
    printed = str(plan)
    for device, count in per_device.items():
        assert f"{device}: {count} (" in printed
    assert "down/kernel_shard1" in printed and "(32, 64)" in printed


# -- saving ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["w.weights.h5", "m.keras"])
def test_files_hold_whole_variables_plain_keras_loads_and_back(name, data, tmp_path):
    x, y = data
    model = build("functional", "tensor_parallel")
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    path = str(tmp_path / name)
    (model.save if name.endswith(".keras") else model.save_weights)(path)
    plain = plain_model(seed=99)
    plain.load_weights(path)
    expected = model.predict(x, verbose=0)
    for a, b in zip(plain.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    # The same weights, whole layers against split ones: within what other
    # orders of the layers' sums allow.
    assert_within(plain.predict(x, verbose=0), expected, outputs_apart(plain, x), "predict")

    # And back: into a fresh tensor-parallel model with other initial weights.
    fresh = build("functional", "tensor_parallel", seed=5)
    assert not np.allclose(fresh.predict(x, verbose=0), expected, atol=1e-3)
    fresh.load_weights(path)
    # The same split model with the same weights, predicting the same
    # batches in this process: the same kernels, the same results (so too
    # the model the .keras file loads as, tensor_parallel again).
    np.testing.assert_array_equal(fresh.predict(x, verbose=0), expected)
    assert devices_of(fresh) == set(DEVICES)
    if name.endswith(".keras"):
        loaded = keras.models.load_model(path)
        assert isinstance(loaded, kd.DistributedModel)
        assert loaded.strategy.name == "tensor_parallel"
        np.testing.assert_array_equal(loaded.predict(x, verbose=0), expected)


def _adam():
    return keras.optimizers.Adam(0.01)


def _adam_by_layer():
    """A MultiOptimizer: Adam for the hidden layer, Adam with another rate for the rest."""
    by_path = keras.optimizers.OptimizerMap(default_optimizer=keras.optimizers.Adam(0.005))
    by_path["hidden.*"] = keras.optimizers.Adam(0.01)
    return keras.optimizers.MultiOptimizer(by_path)


@pytest.mark.parametrize("optimizer", [_adam, _adam_by_layer])
def test_optimizer_state_is_saved_whole_and_plain_keras_continues_from_it(
    optimizer, data, tmp_path
):
    """Adam's slots live per shard, but files hold the plain model's slots
    (a MultiOptimizer's sub-optimizers' too: each saves its own)."""
    x, y = data
    fit = dict(batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model = build("functional", "tensor_parallel", optimizer=optimizer())
    model.fit(x, y, **fit)
    path = str(tmp_path / "m.keras")
    model.save(path)
    plain = plain_model(seed=99)
    plain.compile(optimizer=optimizer(), loss=loss)
    plain.optimizer.build(plain.trainable_variables)
    fresh = build("functional", "tensor_parallel", seed=5, optimizer=optimizer())
    fresh.fit(x[:BATCH], y[:BATCH], **fit)  # builds its optimizer
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Keras warns when it skips optimizer state
        plain.load_weights(path)
        fresh.load_weights(path)
    assert int(plain.optimizer.iterations.numpy()) == int(fresh.optimizer.iterations.numpy()) == 7
    # All three go on from the same state: same weights one epoch later
    # (plain Keras, traced: within the bound of the same math in other
    # orders; `fresh`, the same split model from the same state on the
    # same batches in this process: the same kernels, equal).
    reference = as_reference.fit(plain, x, y, BATCH)
    for m in (fresh, model):
        m.fit(x, y, **fit)
    as_reference.assert_weights(reference, model)
    for c, b in zip(fresh.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(c, b)


def test_plain_keras_files_load_into_the_split_model(data, tmp_path):
    x, _ = data
    plain = plain_model(seed=21)
    path = str(tmp_path / "plain.weights.h5")
    plain.save_weights(path)
    model = build("functional", "tensor_parallel", compile_model=False)
    model.load_weights(path)
    # The same weights, split layers against whole ones.
    assert_within(
        model.predict(x, verbose=0), plain.predict(x, verbose=0), outputs_apart(plain, x), "predict"
    )
    other = plain_model(seed=22).get_weights()
    model.set_weights(other)
    for a, b in zip(other, model.get_weights()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("form", ["functional", "subclass"])
def test_get_and_set_weights_give_and_take_a_plain_models_list(data, form):
    """As in Keras: `set_weights(plain.get_weights())` works and `get_weights()`
    gives the plain model's list (they used to list the split model's shards,
    so this failed with "expecting 7 weights"), also per layer."""
    x, _ = data
    model = build(form, "tensor_parallel", compile_model=False, seed=24)
    plain = plain_model(seed=25)
    assert len(model.weights) > len(plain.weights)  # the shards are really there
    model.set_weights(plain.get_weights())
    assert [w.shape for w in model.get_weights()] == [w.shape for w in plain.get_weights()]
    for a, b in zip(model.get_weights(), plain.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    # The same weights, split layers against whole ones.
    assert_within(
        model.predict(x, verbose=0), plain.predict(x, verbose=0), outputs_apart(plain, x), "predict"
    )
    # Per layer too: the split "hidden" layer takes and gives whole values.
    other = plain_model(seed=26).get_layer("hidden").get_weights()
    model.get_layer("hidden").set_weights(other)
    for a, b in zip(model.get_layer("hidden").get_weights(), other, strict=True):
        np.testing.assert_array_equal(a, b)
    # A list of the wrong length or shape: one line naming the fix.
    with pytest.raises(ValueError, match=r"has 4 weights .* got 3; pass the get_weights\(\)"):
        model.set_weights(plain.get_weights()[:3])
    wrong = plain.get_weights()
    wrong[3] = np.zeros((CLASSES + 1,), "float32")
    with pytest.raises(ValueError, match=r"shape \(4,\) .* same architecture"):
        model.set_weights(wrong)
    with pytest.raises(ValueError, match=r"layer 'hidden' holds 2 whole variables"):
        model.get_layer("hidden").set_weights(other[:1])


# -- callbacks --------------------------------------------------------------------------------


def test_our_callbacks_work_and_backup_and_restore_resumes_exactly(data, tmp_path):
    x, y = data
    fit = dict(batch_size=BATCH, epochs=3, shuffle=True, verbose=0)

    def run(model, backup_dir, *extra):
        callbacks = [
            kd.callbacks.MetricAverage(),
            kd.callbacks.BroadcastInitialWeights(),
            kd.callbacks.BackupAndRestore(str(backup_dir), save_freq=4),
            kd.callbacks.LearningRateWarmup(warmup_epochs=1),
            kd.callbacks.ReplicaConsistencyCheck(every_n_steps=5),
            kd.callbacks.ThroughputMonitor(global_batch_size=BATCH),
            *extra,
        ]
        return model.fit(x, y, callbacks=callbacks, **fit)

    reference = build("functional", "tensor_parallel", optimizer=keras.optimizers.Adam(0.01))
    run(reference, tmp_path / "ref")
    crashed = build("functional", "tensor_parallel", optimizer=keras.optimizers.Adam(0.01))
    with pytest.raises(Crash):
        run(crashed, tmp_path / "b", CrashAfter(10))
    resumed = build("functional", "tensor_parallel", optimizer=keras.optimizers.Adam(0.01))
    run(resumed, tmp_path / "b")
    assert int(resumed.optimizer.iterations.numpy()) == 21
    assert weights_moved(resumed, crashed)
    # The same split model from the same state (a backup file) on the same
    # batches in this process: the same kernels, equal.
    for a, b in zip(
        reference.get_weights() + [v.numpy() for v in reference.optimizer.variables],
        resumed.get_weights() + [v.numpy() for v in resumed.optimizer.variables],
    ):
        np.testing.assert_array_equal(a, b)


# -- bad input --------------------------------------------------------------------------------


def _conv_model(strategy):
    inputs = keras.Input((6, 6, 1))
    h = keras.layers.Conv2D(2, 3, name="conv")(inputs)
    h = keras.layers.Flatten()(h)
    return kd.DistributedModel(inputs, keras.layers.Dense(3, name="logits")(h), strategy=strategy)


@pytest.mark.parametrize(
    "layout,message",
    [
        (
            {"conv": "column"},
            r"split layer 'conv' column-wise, but it is a Conv2D; tensor_parallel "
            r"splits Dense and Embedding layers; map it to 'whole'",
        ),
        ({"logits": "diagonal"}, r"layout\['logits'\]='diagonal' is not a split kind"),
        ({"hiden": "row"}, r"layout pattern 'hiden' matches no layer of model"),
        ({"conv(": "whole"}, r"layout pattern 'conv\(' is not a valid regular expression"),
        (
            {"log.*": "row", "logits": "column"},
            r"layer 'logits' matches layout patterns "
            r"\['log.\*', 'logits'\] of different kinds",
        ),
    ],
)
def test_bad_layouts_are_one_line_errors(layout, message):
    with pytest.raises(ValueError, match=message) as raised:
        _conv_model(tensor_parallel(layout=layout))
    assert "\n" not in str(raised.value)


def test_a_dimension_smaller_than_the_device_count_is_an_error_or_whole():
    def one_unit(strategy):
        inputs = keras.Input((4,))
        return kd.DistributedModel(
            inputs, keras.layers.Dense(1, name="score")(inputs), strategy=strategy
        )

    with pytest.raises(ValueError, match=r"it has 1 output units, fewer than the 2 devices"):
        one_unit(tensor_parallel(layout={"score": "column"}))
    plan = one_unit("tensor_parallel").strategy.plan()
    assert plan.kinds == {"score": "whole"}
    # Unsplittable layers in the default plan are placed whole.
    assert _conv_model("tensor_parallel").strategy.plan().kinds == {
        "conv": "whole",
        "logits": "column",
    }


def test_a_bad_layout_type_and_unknown_device_are_one_line_errors():
    with pytest.raises(ValueError, match=r"layout must be a dict .* got list"):
        tensor_parallel(layout=["hidden"])
    with pytest.raises(ValueError, match=r"device '/cpu:7' does not exist"):
        tensor_parallel(devices=["/cpu:0", "/cpu:7"])


@pytest.mark.parametrize("called_first", [True, False], ids=["called", "built-by-fit"])
def test_a_subclassed_model_is_split_in_place_and_matches_single(
    called_first, data, tmp_path, mlp_single
):
    x, y = data
    reference = plain_model()
    model = Net(strategy="tensor_parallel")
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    if called_first:
        model(x[:1])
    else:  # fit builds it, then its optimizer: the slots must follow the shards
        model.fit(x[:32], y[:32], batch_size=BATCH, epochs=1, verbose=0)
        model.optimizer.iterations.assign(0)
    model.set_weights(reference.get_weights())
    # Tracking order pairs hidden (column) with logits (row).
    assert model.strategy.plan(model).kinds == {"hidden": "column", "logits": "row"}
    for v in model.trainable_weights:
        assert "_shard" in v.path or v.path.endswith("logits/bias"), v.path
    assert devices_of(model) == set(DEVICES)
    assert_matches_single(mlp_single, model, x, y)
    # Its files hold whole variables: a plain subclass loads them.
    model.save_weights(tmp_path / "net.weights.h5")
    plain = Net(strategy="single")
    plain(x[:1])
    plain.load_weights(tmp_path / "net.weights.h5")
    for a, b in zip(plain.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_from_model_leaves_the_model_untouched_and_the_constructor_takes_its_layers(data):
    """`from_model` splits a copy; `DistributedModel(inputs, outputs)` is
    made of the layers themselves, as `keras.Model(inputs, outputs)` is, so
    they are split in place and a plain model of the same graph computes
    on their shards, with the same results."""
    x, _ = data
    reference = plain_model()
    before = reference.predict(x, verbose=0)
    apart = outputs_apart(reference, x)  # of its whole layers, at these weights
    kd.DistributedModel.from_model(reference, strategy="tensor_parallel")
    assert [tuple(w.shape) for w in reference.get_weights()] == [(8, 16), (16,), (16, 3), (3,)]
    np.testing.assert_array_equal(reference.predict(x, verbose=0), before)
    model = kd.DistributedModel(reference.input, reference.output, strategy="tensor_parallel")
    assert model.layers[1] is reference.layers[1]
    assert model.strategy.plan(model).kinds == {"hidden": "column", "logits": "row"}
    # Its layers, split now, compute the same sums in other orders.
    assert_within(reference.predict(x, verbose=0), before, apart, "predict")


def test_topology_is_one_replica_over_both_devices():
    t = tensor_parallel().topology
    assert (t.num_replicas, t.num_local_replicas, t.num_processes, t.devices) == (1, 1, 1, DEVICES)
    assert os.environ.get("TF_CONFIG") is None

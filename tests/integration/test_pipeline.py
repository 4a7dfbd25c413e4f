"""`strategy="pipeline"`: stages on the 2 logical CPUs, micro-batches, GPipe and 1F1B.

The core assertion is the one every strategy meets: trained with the same
global batch, the pipelined model ends with the weights, history,
evaluate and predict results of `"single"` (each within the bound of
float32's rounding of the same math in other orders, `as_reference`), with
its variables really on both devices. The schedules themselves (pure
Python) are checked in tests/unit/test_pipeline_schedule.py.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import as_reference
import keras_distrib as kd
from bounds_split import input_statistics_apart, through_variables
from float_bounds import assert_within, evaluate_apart, moving_statistics_apart, outputs_apart
from helpers import (
    FEATURES,
    Crash,
    CrashAfter,
    assert_trains_like_single,
    build,
    make_data,
    plain_model,
    weights_moved,
)
from keras_distrib.strategies.base import Step

CPU0, CPU1 = "/device:CPU:0", "/device:CPU:1"
BATCH, EPOCHS = 32, 2  # 203 samples: 7 steps per epoch, the last one 11 rows


def pipeline(**options):
    options.setdefault("num_micro_batches", 4)
    return kd.strategies.get("pipeline", **options)


def device_of(variable):
    spec = tf.DeviceSpec.from_string(variable.value.device)
    return f"/device:{spec.device_type}:{spec.device_index}"


def placement(model):
    return {v.path: device_of(v) for v in model.variables}


# -- equivalence -------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("form", ["functional", "from_model"])
def test_matches_single(form, schedule, data):
    x, y = data
    model = assert_trains_like_single(
        form, pipeline(schedule=schedule), x, y, BATCH, EPOCHS, steps=EPOCHS * 7
    )
    assert model.strategy.num_replicas == 1
    assert model.strategy.devices == (CPU0, CPU1)
    # Read from the variables themselves: each layer lives on its stage.
    assert placement(model) == {
        "hidden/kernel": CPU0,
        "hidden/bias": CPU0,
        "logits/kernel": CPU1,
        "logits/bias": CPU1,
    }


@pytest.fixture(scope="module")
def validated_single(data):
    """The MLP trained on "single" with validation data, traced (one step
    per call, in a graph: the same math as other ways of running it)."""
    x, y = data
    validation = (x[:50], y[:50])
    single = build("functional", "single")
    return as_reference.fit(single, x, y, BATCH, EPOCHS, validation_data=validation, outputs=False)


@pytest.mark.parametrize("options", [dict(steps_per_execution=3), dict(run_eagerly=True)])
def test_steps_per_execution_eager_and_validation_match_single(options, data, validated_single):
    x, y = data
    model = build("functional", pipeline(), **options)
    fit = dict(
        batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, validation_data=(x[:50], y[:50])
    )
    history = model.fit(x, y, **fit)
    as_reference.assert_weights(validated_single, model)
    as_reference.assert_validation(validated_single, history.history, x[:50], y[:50])


def _assert_within_first_epoch(reference, model):
    """`model`'s weights within the bounds of the reference's after its
    first epoch (7 steps)."""
    for got, want, bound in zip(model.trainable_weights, *reference.after(7)):
        assert_within(np.asarray(got), want, bound, got.path)


def test_a_wrong_average_would_be_seen(data, validated_single):
    """Control: applying each micro-batch as its own step (batch 8) lands
    far from the pipeline's weights, outside the bound of the check above,
    so that check can fail."""
    x, y = data
    model = build("functional", pipeline())
    per_micro_batch = build("functional", "single")
    fit = dict(epochs=1, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=BATCH, **fit)
    per_micro_batch.fit(x, y, batch_size=BATCH // 4, **fit)
    _assert_within_first_epoch(validated_single, model)
    with pytest.raises(AssertionError, match="further apart than their bound"):
        _assert_within_first_epoch(validated_single, per_micro_batch)
    assert (
        max(np.abs(a - b).max() for a, b in zip(model.get_weights(), per_micro_batch.get_weights()))
        > 1e-2
    )


def _branchy(seed=3):
    """Two inputs, two outputs, and tensors that jump a stage: `aux` enters
    stage 0 and is only used in stage 1; `mid` is made in stage 0 and is
    both a model output and used in stage 1."""
    keras.utils.set_random_seed(seed)
    features = keras.Input((FEATURES,), name="features")
    aux = keras.Input((2,), name="aux")
    a = keras.layers.Dense(16, activation="tanh", name="a")(features)
    mid = keras.layers.Dense(4, name="mid")(a)
    b = keras.layers.Dense(16, activation="tanh", name="b")(a)
    joined = keras.layers.Concatenate(name="join")([b, mid, aux])
    out = keras.layers.Dense(3, name="out")(joined)
    return keras.Model({"features": features, "aux": aux}, {"out": out, "mid": mid})


def _branchy_data(x, y):
    rng = np.random.default_rng(1)
    inputs = {"features": x, "aux": rng.normal(size=(len(x), 2)).astype("float32")}
    targets = {"out": y, "mid": rng.normal(size=(len(x), 4)).astype("float32")}
    return inputs, targets


def _branchy_on(strategy):
    model = kd.DistributedModel.from_model(_branchy(), strategy=strategy)
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss={
            "out": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            "mid": "mse",
        },
    )
    return model


@pytest.fixture(scope="module")
def branchy_single(data):
    """`_branchy` trained on "single", traced."""
    inputs, targets = _branchy_data(*data)
    return as_reference.fit(_branchy_on("single"), inputs, targets, BATCH, EPOCHS)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_inputs_two_outputs_and_skips_match_single(schedule, data, branchy_single):
    inputs, targets = _branchy_data(*data)
    piped = _branchy_on(pipeline(schedule=schedule, split_at=["b"]))
    piped.fit(inputs, targets, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    single = branchy_single.model
    assert weights_moved(single, _branchy())
    as_reference.assert_weights(branchy_single, piped)
    assert {p: d for p, d in placement(piped).items() if p.startswith("b/")} == {
        "b/kernel": CPU1,
        "b/bias": CPU1,
    }
    assert device_of(piped.get_layer("mid").kernel) == CPU0
    for got, want, bound in zip(
        tf.nest.flatten(piped.predict(inputs, batch_size=BATCH, verbose=0)),
        tf.nest.flatten(single.predict(inputs, batch_size=BATCH, verbose=0)),
        tf.nest.flatten(branchy_single.predict(inputs)),
    ):
        assert_within(got, want, bound, "predict")


def test_nested_models_and_attention_blocks_cut_by_default_match_single(data):
    """A nested model's `output` is that of its own graph: the default cut
    of a model whose second stage is a nested model (a classifier head as a
    Functional model) failed with "Pipeline stage 0 makes none of the
    tensors later stages use". Each layer's tensors now come from this
    model's own graph. An attention block with residuals cuts by default
    too."""
    x, y = data

    def nested_head():
        head_in = keras.Input((8,))
        head = keras.Model(
            head_in,
            keras.layers.Dense(3)(keras.layers.Dense(16, activation="relu")(head_in)),
            name="head",
        )
        inputs = keras.Input((FEATURES,))
        return keras.Model(inputs, head(keras.layers.Dense(8, activation="relu")(inputs)))

    def attention_block():
        inputs = keras.Input((FEATURES,))
        h = keras.layers.Reshape((2, FEATURES // 2))(inputs)
        h = keras.layers.LayerNormalization()(
            h + keras.layers.MultiHeadAttention(2, 4)(h, h, use_causal_mask=True)
        )
        return keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Flatten()(h)))

    for graph in (nested_head, attention_block):
        plain = graph()
        piped = kd.DistributedModel.from_model(plain, strategy=pipeline())
        for model in (plain, piped):
            model.compile(
                optimizer=keras.optimizers.SGD(0.1),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
        reference = as_reference.fit(plain, x, y, BATCH)
        piped.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        as_reference.assert_weights(reference, piped)


class _PenalizeActivations(keras.layers.Layer):
    """A layer that adds a loss in `call` (the mean square of its input)."""

    def call(self, inputs):
        self.add_loss(0.02 * keras.ops.mean(keras.ops.square(inputs)))
        return inputs


def _added_losses_graph():
    keras.utils.set_random_seed(5)
    inputs = keras.Input((FEATURES,))
    h = keras.layers.Dense(
        16, activation="relu", name="first", activity_regularizer=keras.regularizers.L2(0.05)
    )(inputs)
    h = _PenalizeActivations()(h)
    h = keras.layers.Dense(
        16, activation="relu", name="second", activity_regularizer=keras.regularizers.L2(0.05)
    )(h)
    return inputs, keras.layers.Dense(3, name="logits")(h)


def _compile_added_losses(model):
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


@pytest.fixture(scope="module")
def added_losses_plain(data):
    """Plain Keras on `_added_losses_graph`: its `evaluate` before training
    and that result's bound (the same weights), and its training, traced."""
    x, y = data
    plain = _compile_added_losses(keras.Model(*_added_losses_graph()))
    before = plain.evaluate(x, y, batch_size=BATCH, verbose=0)
    before_bound = evaluate_apart(plain, x, y, BATCH)
    return before, before_bound, as_reference.fit(plain, x, y, BATCH, EPOCHS)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_losses_added_in_call_count_in_every_stage(schedule, data, added_losses_plain):
    # Activity regularizers and `add_loss` in both stages: the losses added
    # in stage 0 were left out of its gradients (weights 0.06 off plain
    # Keras after 2 epochs), and `evaluate` counted only the last
    # micro-batch's.
    x, y = data
    piped = kd.DistributedModel(
        *_added_losses_graph(), strategy=pipeline(schedule=schedule, split_at=["second"])
    )
    assert device_of(piped.get_layer("first").kernel) == CPU0
    assert device_of(piped.get_layer("second").kernel) == CPU1
    _compile_added_losses(piped)
    before, before_bound, reference = added_losses_plain
    assert_within(
        np.ravel(piped.evaluate(x, y, batch_size=BATCH, verbose=0)),
        np.ravel(before),
        np.ravel(before_bound),
        "evaluate before training",
    )
    history = piped.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    as_reference.assert_history(reference, history.history, ("loss",))
    as_reference.assert_evaluate(
        reference, piped.evaluate(x, y, batch_size=BATCH, verbose=0), x, y, BATCH
    )
    as_reference.assert_weights(reference, piped)


def test_optimizer_slots_sit_with_their_variables(data):
    x, y = data
    model = build("functional", pipeline(), optimizer=keras.optimizers.Adam(0.01))
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    slots = {v.path: device_of(v) for v in model.optimizer.variables if "kernel" in v.path}
    assert slots and all(d == (CPU0 if "hidden" in p else CPU1) for p, d in slots.items())


# -- the schedule, in the graph (the orders themselves: tests/unit) ---------------


def _pass_ops(graph_def, stage, kind, i):
    """Graph nodes of one pass: built under its name scope (forward), or
    by the tape for it (backward ops are named after the forward's)."""
    scope = f"stage_{stage}_{kind}_{i}/"
    grads = f"gradient_tape/stage_{stage}_F_{i}/"
    return [
        n.name
        for n in graph_def.node
        if n.name.startswith(scope) or (kind == "B" and n.name.startswith(grads))
    ]


def _upstream(graph_def, names):
    inputs = {n.name: [i.lstrip("^").split(":")[0] for i in n.input] for n in graph_def.node}
    seen, stack = set(), list(names)
    while stack:
        for name in inputs[stack.pop()]:
            if name not in seen:
                seen.add(name)
                stack.append(name)
    return seen


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_schedule_is_enforced_in_the_graph(schedule, data):
    """Under 1F1B stage 0 cannot start micro-batch 2 before its backward of
    micro-batch 0 ran (it then holds at most 2); GPipe lets all forwards go."""
    x, y = data
    strategy = pipeline(schedule=schedule)
    model = build("functional", strategy)
    model.train_on_batch(x[:BATCH], y[:BATCH])
    step = strategy.make_step_function(model, Step(model.train_step, "train"), lambda fn: fn)
    spec = (tf.TensorSpec([BATCH, FEATURES]), tf.TensorSpec([BATCH], tf.int32))
    graph_def = tf.function(step).get_concrete_function(spec).graph.as_graph_def()
    before_forward_2 = _upstream(graph_def, _pass_ops(graph_def, 0, "F", 2))
    backward_0 = set(_pass_ops(graph_def, 0, "B", 0))
    assert backward_0
    assert bool(before_forward_2 & backward_0) == (schedule == "1f1b")
    # Every pass's ops run on its stage's device.
    for stage, device in enumerate((CPU0, CPU1)):
        for kind in "FB":
            placed = {
                n.device
                for n in graph_def.node
                if n.name in _pass_ops(graph_def, stage, kind, 1) and n.op == "MatMul"
            }
            assert placed == {device}, (stage, kind, placed)


# -- random layers, BatchNormalization ---------------------------------------------


def _dropout_model(schedule, seed=0, features=64):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((features,))
    dropped = keras.layers.Dropout(0.5, name="drop")(inputs)
    outputs = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones", name="out")(dropped)
    model = kd.DistributedModel(
        inputs, outputs, strategy=pipeline(schedule=schedule, num_micro_batches=2)
    )
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mae")
    return model


def _one_dropout_step(schedule, seed=0):
    """Two identical one-row micro-batches; returns the kernel after one step.

    The kernel's gradient is `mask_0 + mask_1` (scaled by 1/(1-rate), over
    2 rows): each entry is 0, 1 or 2, and 1 only where the micro-batches'
    masks differ.
    """
    model = _dropout_model(schedule, seed)
    x = np.ones((2, 64), "float32")
    model.train_on_batch(x, np.full((2, 1), -1000.0, "float32"))
    return model.get_layer("out").kernel.numpy().ravel()


def test_dropout_masks_differ_per_micro_batch_and_runs_reproduce():
    kernel = _one_dropout_step("1f1b")
    # Exact: the kernel's ones, the dropout's scale 2, the mean absolute
    # error's slopes +-1/2 and the learning rate 1 are powers of two or
    # small whole numbers, and so are all their sums and products here.
    assert set(kernel.tolist()) <= {1.0, 0.0, -1.0}
    assert np.any(kernel == 0.0), "every micro-batch drew the same mask"
    np.testing.assert_array_equal(kernel, _one_dropout_step("1f1b"))
    np.testing.assert_array_equal(kernel, _one_dropout_step("gpipe"))
    assert not np.array_equal(kernel, _one_dropout_step("1f1b", seed=1))


def _bn_model(strategy):
    keras.utils.set_random_seed(5)
    inputs = keras.Input((4,))
    normed = keras.layers.BatchNormalization(momentum=0.5, name="bn")(inputs)
    outputs = keras.layers.Dense(1, name="out")(normed)
    model = kd.DistributedModel(inputs, outputs, strategy=strategy)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


def test_batch_norm_uses_micro_batch_statistics():
    """As documented: in training each micro-batch is normalized with its own
    statistics, and the moving mean is updated once per micro-batch."""
    rng = np.random.default_rng(0)
    x = rng.normal(2.0, 3.0, size=(8, 4)).astype("float32")
    y = rng.normal(size=(8, 1)).astype("float32")
    piped = _bn_model(pipeline(num_micro_batches=2))
    single = _bn_model("single")
    assert device_of(piped.get_layer("bn").moving_mean) == CPU0
    piped.train_on_batch(x, y)
    single.train_on_batch(x, y)
    after_first = 0.5 * 0.0 + 0.5 * x[:4].mean(axis=0)
    expected = 0.5 * after_first + 0.5 * x[4:].mean(axis=0)
    # Both within what float32's rounding of these means and updates
    # allows (other orders of the sums).
    assert_within(
        piped.get_layer("bn").moving_mean.numpy(),
        expected,
        input_statistics_apart([x[:4], x[4:]], 0.5)[0],
        "micro-batches' moving mean",
    )
    assert_within(
        single.get_layer("bn").moving_mean.numpy(),
        0.5 * x.mean(axis=0),
        input_statistics_apart([x], 0.5)[0],
        "one batch's moving mean",
    )


def test_batch_norm_with_one_micro_batch_matches_single():
    rng = np.random.default_rng(0)
    x = rng.normal(2.0, 3.0, size=(64, 4)).astype("float32")
    y = rng.normal(size=(64, 1)).astype("float32")
    piped = _bn_model(pipeline(num_micro_batches=1))
    single = _bn_model("single")
    reference = as_reference.fit(single, x, y, 16, 3)
    piped.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
    # The moving statistics, within what the rounding of their moments and
    # updates allows (`float_bounds.moving_statistics_apart`).
    bn = single.get_layer("bn")
    moving = moving_statistics_apart(reference, x, 16)
    statistics = [(v, moving[id(v)]) for v in (bn.moving_mean, bn.moving_variance)]
    as_reference.assert_weights(reference, piped, others=moving)
    # Its predictions: the trained weights' bounds and the statistics'.
    assert_within(
        piped.predict(x, verbose=0),
        single.predict(x, verbose=0),
        reference.predict(x) + through_variables(single, x, statistics),
        "predict",
    )


# -- saving, the plan, callbacks, optimizers ---------------------------------------------


def test_saved_files_load_into_a_plain_keras_model(data, tmp_path):
    x, y = data
    model = build("functional", pipeline())
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    expected = model.predict(x, verbose=0)
    model.save(tmp_path / "m.keras")
    model.save_weights(tmp_path / "m.weights.h5")
    apart = None  # of the plain model's predictions at the saved weights
    for path in ("m.keras", "m.weights.h5"):
        plain = plain_model(seed=99)
        plain.load_weights(tmp_path / path)
        apart = outputs_apart(plain, x) if apart is None else apart
        # The same weights, whole against staged: other orders of the sums.
        assert_within(plain.predict(x, verbose=0), expected, apart, path)
    again = build("functional", pipeline(), seed=99)
    again.load_weights(tmp_path / "m.weights.h5")
    assert placement(again) == placement(model)
    # The same pipeline with the same weights, predicting the same batches
    # in this process: the same kernels, the same results.
    np.testing.assert_array_equal(again.predict(x, verbose=0), expected)


def test_plan_reads_bytes_per_device_from_the_placement(data):
    x, y = data
    strategy = pipeline(schedule="gpipe", num_micro_batches=8)
    model = build("functional", strategy, optimizer=keras.optimizers.SGD(0.1, momentum=0.9))
    model.fit(x[:64], y[:64], batch_size=BATCH, verbose=0)
    plan = strategy.describe(model)
    placed = {}
    for v in model.variables:
        placed[device_of(v)] = placed.get(device_of(v), 0) + v.numpy().nbytes
    assert plan.bytes_per_device == placed == {CPU0: (8 * 16 + 16) * 4, CPU1: (16 * 3 + 3) * 4}
    assert plan.layers == [["hidden"], ["logits"]]
    assert plan.variables == placement(model)
    # Momentum slots sit with their weights; the step counter on the last stage.
    assert plan.optimizer_bytes_per_device[CPU0] == (8 * 16 + 16) * 4
    assert plan.peak_live_activations == [8, 8]
    assert "stage 1 on /device:CPU:1: 204 bytes" in str(plan)


def test_split_at_places_the_cut(data):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((FEATURES,))
    h = keras.layers.Dense(32, name="a")(inputs)
    h = keras.layers.Dense(32, name="b")(h)
    outputs = keras.layers.Dense(3, name="c")(h)
    model = kd.DistributedModel(inputs, outputs, strategy=pipeline(split_at=["c"]))
    assert model.strategy.describe(model).layers == [["a", "b"], ["c"]]
    assert device_of(model.get_layer("b").kernel) == CPU0
    assert device_of(model.get_layer("c").kernel) == CPU1


def test_callbacks_and_distributed_optimizer(data, tmp_path):
    x, y = data
    single = build("functional", "single")
    model = build(
        "functional",
        pipeline(),
        optimizer=kd.optimizers.DistributedOptimizer(keras.optimizers.SGD(0.1), "fp16"),
    )
    callbacks = [
        kd.callbacks.BackupAndRestore(tmp_path / "backup", save_freq=3),
        kd.callbacks.ThroughputMonitor(global_batch_size=BATCH),
        kd.callbacks.ReplicaConsistencyCheck(every_n_steps=2),
        kd.callbacks.MetricAverage(),
    ]
    fit = dict(batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    history = model.fit(x, y, callbacks=callbacks, **fit)
    # One replica: no all-reduce, so the fp16 compression has nothing to
    # compress, and the run is "single"'s math.
    reference = as_reference.fit(single, x, y, BATCH, EPOCHS, outputs=False)
    as_reference.assert_weights(reference, model)
    assert history.history["samples_per_sec"][-1] > 0


def test_a_resumed_run_equals_an_uninterrupted_one(data, tmp_path):
    x, y = data

    def fit(model, *extra):
        backup = kd.callbacks.BackupAndRestore(tmp_path / "run", save_freq=4)
        return model.fit(
            x,
            y,
            batch_size=BATCH,
            epochs=EPOCHS,
            shuffle=True,
            verbose=0,
            callbacks=[backup, *extra],
        )

    reference = build("functional", pipeline())
    reference.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=EPOCHS,
        shuffle=True,
        verbose=0,
        callbacks=[kd.callbacks.BackupAndRestore(tmp_path / "ref", save_freq=4)],
    )
    with pytest.raises(Crash):
        fit(build("functional", pipeline()), CrashAfter(12))  # epoch 2, batch 4
    resumed = build("functional", pipeline())
    fit(resumed)
    assert int(resumed.optimizer.iterations.numpy()) == EPOCHS * 7
    # The same pipeline from the same state (a backup file) on the same
    # batches in this process: the same kernels, equal.
    for a, b in zip(reference.get_weights(), resumed.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


# -- bad input: one-line errors --------------------------------------------------------


def _one_line(excinfo):
    message = str(excinfo.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize(
    "options,match",
    [
        (dict(schedule="interleaved"), "Unknown schedule 'interleaved'"),
        (dict(num_micro_batches=0), "num_micro_batches=0 must be an integer >= 1"),
        (dict(num_stages=3), "num_stages=3 needs 3 devices but only 2"),
        (dict(devices=["/cpu:0"], num_stages=2), "num_stages=2 but 1 devices were given"),
        (dict(split_at="hidden"), "must be a non-empty list of layer names"),
        (dict(split_at=["a", "b"], num_stages=2), "split_at names 2 layer"),
        (dict(balance="flops"), "Unknown balance 'flops'"),
    ],
)
def test_bad_options_are_one_line_errors(options, match):
    with pytest.raises(ValueError, match=match) as excinfo:
        kd.strategies.get("pipeline", **options)
    _one_line(excinfo)


def test_bad_cuts_are_one_line_errors():
    with pytest.raises(ValueError, match="'nope' is not a layer of model") as excinfo:
        build("functional", pipeline(split_at=["nope"]))
    _one_line(excinfo)
    with pytest.raises(ValueError, match="after its first layer 'hidden'") as excinfo:
        build("functional", pipeline(split_at=["hidden"]))
    _one_line(excinfo)
    inputs = keras.Input((FEATURES,))
    outputs = keras.layers.Dense(1)(inputs)
    with pytest.raises(ValueError, match=r"\(1 layers\) into 2 stages") as excinfo:
        kd.DistributedModel(inputs, outputs, strategy=pipeline())
    _one_line(excinfo)


def test_a_nested_model_is_cut_through_where_its_own_layers_are_needed(tmp_path):
    """A model that is one nested model (`Model(inputs, backbone(inputs))`)
    has one layer for two stages ("Cannot cut model ... (1 layers) into 2
    stages"), and `split_at` could not name a layer inside a nested model:
    the stages are now cut from the same computation with the nested
    model's own layers, which end on their stages' devices."""
    x, y = make_data()

    def one_nested():
        keras.utils.set_random_seed(4)  # one plain run for both cuts
        backbone = keras.Sequential(
            [
                keras.Input((FEATURES,)),
                keras.layers.Dense(16, activation="relu", name="inner_a"),
                keras.layers.Dense(16, activation="relu", name="inner_b"),
                keras.layers.Dense(3, name="inner_out"),
            ],
            name="backbone",
        )
        inputs = keras.Input((FEATURES,))
        return keras.Model(inputs, backbone(inputs))

    def compiled(model):
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        return model

    reference = as_reference.fit(compiled(one_nested()), x, y, BATCH)
    for strategy in (pipeline(), pipeline(split_at=["inner_out"])):
        piped = compiled(kd.DistributedModel.from_model(one_nested(), strategy=strategy))
        piped.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        as_reference.assert_weights(reference, piped)
        assert device_of(piped.get_layer("backbone").get_layer("inner_a").kernel) == CPU0
        assert device_of(piped.get_layer("backbone").get_layer("inner_out").kernel) == CPU1
    # The file holds the model's own weights only (not a second copy from the
    # inlined graph) and loads back into a fresh model of either kind.
    path = tmp_path / "nested.weights.h5"
    piped.save_weights(path)
    apart = None  # of the plain model's predictions at the saved weights
    for fresh in (one_nested(), kd.DistributedModel.from_model(one_nested(), strategy=pipeline())):
        fresh.load_weights(path)
        apart = outputs_apart(fresh, x) if apart is None else apart
        # The same weights, cut elsewhere or not at all: other orders of the sums.
        assert_within(fresh.predict(x, verbose=0), piped.predict(x, verbose=0), apart, "predict")


def test_a_mask_crossing_the_cut_is_handed_over():
    """`Embedding(mask_zero=True)` in one stage, the LSTM that reads its mask
    in the next: the mask (an operation's output in the graph) crosses the
    cut with the values. It failed ("Output with path `0` is not connected
    to `inputs`") when only layers' outputs could cross."""

    def graph():
        ids = keras.Input((5,), dtype="int32")
        masked = keras.layers.LSTM(4, name="lstm")(
            keras.layers.Embedding(9, 3, mask_zero=True)(ids)
        )
        return keras.Model(ids, keras.layers.Dense(2, name="out")(masked))

    rng = np.random.default_rng(0)
    x = rng.integers(1, 9, (32, 5)).astype("int32")
    x[::2, 2:] = 0  # padded rows: the mask matters
    y = rng.normal(size=(32, 2)).astype("float32")
    plain = graph()
    piped = kd.DistributedModel.from_model(plain, strategy=pipeline(split_at=["lstm"]))
    # The same weights: within what other orders of the sums allow.
    assert_within(
        piped.predict(x, batch_size=8, verbose=0),
        plain.predict(x, batch_size=8, verbose=0),
        outputs_apart(plain, x),
        "predict",
    )
    for model in (plain, piped):
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    reference = as_reference.fit(plain, x, y, 8)
    piped.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    as_reference.assert_weights(reference, piped)


def test_a_batch_micro_batches_cannot_share_evenly_trains_as_one_device(data):
    x, y = data
    plain, piped = build("functional", "single"), build("functional", pipeline())
    reference = as_reference.fit(plain, x, y, 30, outputs=False)
    piped.fit(x, y, batch_size=30, epochs=1, shuffle=False, verbose=0)
    as_reference.assert_weights(reference, piped)
    as_reference.assert_evaluate(
        reference, piped.evaluate(x, y, batch_size=30, verbose=0), x, y, 30
    )
    as_reference.assert_predict(reference, piped.predict(x, batch_size=30, verbose=0), x, 30)


class CustomStep(kd.DistributedModel):
    def train_step(self, data):
        return super().train_step(data)


def test_unsupported_uses_are_one_line_errors(data):
    x, y = data
    reference = plain_model()
    custom = CustomStep(reference.input, reference.output, strategy=pipeline())
    custom.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="cannot run a custom train_step") as excinfo:
        custom.fit(x, np.zeros((len(x), 3)), batch_size=BATCH, verbose=0)
    _one_line(excinfo)

    subclassed = build("subclass", pipeline())
    with pytest.raises(ValueError, match="needs a Functional or Sequential model") as excinfo:
        subclassed.fit(x, y, batch_size=BATCH, verbose=0)
    _one_line(excinfo)

    accumulating = build(
        "functional",
        pipeline(),
        optimizer=kd.optimizers.DistributedOptimizer(
            keras.optimizers.SGD(0.1), backward_passes_per_step=2
        ),
    )
    with pytest.raises(ValueError, match="backward_passes_per_step > 1") as excinfo:
        accumulating.fit(x, y, batch_size=BATCH, verbose=0)
    _one_line(excinfo)

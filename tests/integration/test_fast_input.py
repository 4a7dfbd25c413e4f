"""Array input on one process: our pipeline instead of Keras's, same results.

Keras's own array input builds a tf.data iterator per epoch; tearing down one
that a compiled step has read waits on tf.data's autotuning thread (~0.5 s
an epoch on TF 2.21, measured). `DistributedModel.fit` therefore feeds
arrays through `keras_distrib.input.sharding` even with one process: one endless
iterator, `steps_per_epoch` from the data. These tests pin that path and
that it trains exactly as plain Keras does.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras.src.trainers.data_adapters.array_slicing import train_validation_split

import as_reference
from bounds_metrics import weighted_accuracy_apart
from float_bounds import Reference, Trace, assert_within, gradient_terms
from helpers import CLASSES, build, plain_model

import keras_distrib as kd
from keras_distrib.input.fit_input import FitInput


def _given(x, y, **overrides):
    return FitInput(x=x, y=y, **{"batch_size": 32, **overrides})


@pytest.mark.parametrize("shuffle", [True, False])
def test_arrays_become_one_endless_iterator(data, shuffle):
    x, y = data
    fit = kd.strategies.get("single").distribute_fit_input(_given(x, y, shuffle=shuffle))
    assert isinstance(fit.x, tf.data.Dataset)
    # Batches of epoch after epoch without end (no per-epoch iterator).
    assert fit.steps_per_epoch == 7  # 203 samples, batch 32
    batches = list(fit.x.take(15))
    assert [int(b[0].shape[0]) for b in batches] == [32] * 6 + [11] + [32] * 6 + [11] + [32]
    assert fit.y is None and fit.shuffle is False
    epochs = [np.concatenate([b[0] for b in batches[e * 7 : (e + 1) * 7]]) for e in range(2)]
    for epoch in epochs:  # every sample once an epoch, in order unless shuffled
        order = np.argsort(epoch[:, 0])
        np.testing.assert_array_equal(epoch[order], x[np.argsort(x[:, 0])])
        assert (epoch == x).all() != shuffle
    assert (epochs[0] == epochs[1]).all() != shuffle  # reshuffled every epoch


def test_our_array_pipelines_do_not_autotune_or_rewrite(data):
    """Dropping an autotuned iterator that a step has read waits ~0.5 s (the
    validation iterator is dropped every epoch); tf.data's static rewrites
    run at every iterator's creation and find nothing to fuse here."""
    x, y = data
    fit = kd.strategies.get("single").distribute_fit_input(
        _given(x, y, validation_data=(x[:50], y[:50]))
    )
    for dataset in (fit.x, fit.validation_data):
        assert dataset.options().autotune.enabled is False
        assert dataset.options().experimental_optimization.apply_default_optimizations is False
    assert [int(b[0].shape[0]) for b in fit.validation_data] == [32, 18]


def _traced_functions(dataset):
    graph = tf.compat.v1.GraphDef()
    graph.ParseFromString(
        tf.raw_ops.DatasetToGraphV2(input_dataset=dataset._variant_tensor).numpy()
    )  # the pipeline as a GraphDef
    return [f.signature.name for f in graph.library.function]


def test_unshuffled_arrays_trace_no_function(data):
    """Tracing a function is most of what a new pipeline costs (~10 ms at
    every fit, validation and evaluate): in-order batches are slices."""
    x, y = data
    fit = kd.strategies.get("single").distribute_fit_input(
        _given(x, y, shuffle=False, validation_data=(x[:50], y[:50]))
    )
    assert _traced_functions(fit.x) == []
    assert _traced_functions(fit.validation_data) == []
    shuffled = kd.strategies.get("single").distribute_fit_input(_given(x, y))
    assert _traced_functions(shuffled.x)  # the shuffled order needs one


def test_other_input_is_left_to_keras(data):
    x, y = data
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
    fit = kd.strategies.get("single").distribute_fit_input(_given(dataset, None))
    assert fit.x is dataset


@pytest.mark.parametrize(
    "extras",
    ["plain", "sample_weight", "validation_split", "class_weight", "class_weight_of_some_classes"],
)
def test_single_trains_exactly_like_plain_keras(extras, data):
    x, y = data
    kwargs = dict(batch_size=32, epochs=3, shuffle=False, verbose=0)
    weights = None  # each row's weight, where the extras weigh them
    if extras == "sample_weight":
        kwargs["sample_weight"] = weights = np.linspace(0.5, 1.5, len(x)).astype("float32")
    elif extras == "validation_split":
        kwargs["validation_split"] = 0.2
    elif extras == "class_weight":
        kwargs["class_weight"] = {c: 1.0 + c for c in range(CLASSES)}
    elif extras == "class_weight_of_some_classes":  # the others weigh 1, as Keras does
        kwargs["class_weight"] = {0: 2.0}
    if "class_weight" in kwargs:
        weights = np.array([kwargs["class_weight"].get(c, 1.0) for c in y], "float32")
    trained, validation = (x, y), None  # the rows it trains on; the validation's
    if "validation_split" in kwargs:
        trained, validation = train_validation_split((x, y), kwargs["validation_split"])
    plain = plain_model()
    plain.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    ours = build("functional", "single")
    # Plain Keras with the extras, traced on the rows it trains on, with their weights.
    trace = Trace(*trained, 32, plain.loss, weights, outputs=True)
    h_plain = plain.fit(x, y, callbacks=[trace], **kwargs)
    reference = Reference(plain, trace, -(-len(trained[0]) // 32), logs=h_plain.history)
    h_ours = ours.fit(x, y, **kwargs)
    as_reference.assert_weights(reference, ours)
    assert h_plain.history.keys() == h_ours.history.keys()
    if weights is None:
        as_reference.assert_history(reference, h_ours.history, ("loss", "accuracy"))
    else:
        as_reference.assert_history(reference, h_ours.history, ("loss",))
        assert_within(
            h_ours.history["accuracy"],
            h_plain.history["accuracy"],
            weighted_accuracy_apart(reference, weights),
            "accuracy",
        )
    if validation is not None:
        as_reference.assert_validation(reference, h_ours.history, *validation)
    assert int(ours.optimizer.iterations) == int(plain.optimizer.iterations)


def test_shuffled_runs_repeat_under_a_fixed_seed(data):
    x, y = data

    def run(seed):
        model = build("functional", "single")  # fixed initial weights
        keras.utils.set_random_seed(seed)  # draws the shuffle seed
        model.fit(x, y, batch_size=32, epochs=2, shuffle=True, verbose=0)
        return model.get_weights()

    first, again, other = run(3), run(3), run(4)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    assert any(np.abs(a - b).max() > 1e-6 for a, b in zip(first, other))


@pytest.mark.parametrize("strategy", ["single", "mirrored"])
def test_a_list_of_inputs_stays_separate_inputs(strategy):
    """A multi-input `x=[xa, xb]` (tf.data would stack a list into one tensor)."""
    rng = np.random.default_rng(1)
    xa, xb = (rng.random((64, 4, 8), dtype=np.float32) for _ in range(2))
    y = rng.random((64, 4, 5), dtype=np.float32)

    def model(strategy_name):
        keras.utils.set_random_seed(1)
        a, b = keras.Input((4, 8)), keras.Input((4, 8))
        out = keras.layers.Add()([keras.layers.Dense(5)(a), keras.layers.Dense(5)(b)])
        made = (
            keras.Model([a, b], out)
            if strategy_name is None
            else kd.DistributedModel([a, b], out, strategy=strategy_name)
        )
        made.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        return made

    # A Dense on the rows' 4 positions adds over the positions too.
    plain = model(None)
    reference = as_reference.fit(plain, [xa, xb], y, 16, 2, terms=gradient_terms(plain, 16 * 4))
    ours = model(strategy)
    ours.fit([xa, xb], y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    as_reference.assert_weights(reference, ours)

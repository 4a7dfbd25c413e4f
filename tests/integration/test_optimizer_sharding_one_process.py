"""`optimizer_sharding` in one process: the option's values, the one-line
refusals, and sharded runs of one replica (`mirrored` on one device),
plain Keras's twins. Two real workers:
tests/distributed/test_optimizer_sharding_two_workers.py.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_distrib as kd
from keras_distrib.arithmetic import optimizer_shards
import as_reference
from float_bounds import assert_within
from helpers import CLASSES, FEATURES, make_data
from pure_helpers import assert_one_line_error


def _sharded_strategy():
    return kd.strategies.get("mirrored", devices=["/cpu:0"], optimizer_sharding="optimizer")


def _graph():
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    return inputs, keras.layers.Dense(CLASSES)(hidden)


def test_an_unknown_mode_is_one_line():
    with pytest.raises(ValueError) as excinfo:
        kd.strategies.get("mirrored", optimizer_sharding="zero1")
    assert_one_line_error(excinfo, "optimizer_sharding='zero1' is not one of", "'gradients'")


def test_loss_scaling_in_stage_2_is_one_line():
    strategy = kd.strategies.get("mirrored", devices=["/cpu:0"], optimizer_sharding="gradients")
    model = kd.DistributedModel(*_graph(), strategy=strategy)
    with pytest.raises(ValueError) as excinfo:
        model.compile(
            optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam()), loss="mse"
        )
    assert_one_line_error(
        excinfo, "cannot run a LossScaleOptimizer", "optimizer_sharding='optimizer'"
    )


def test_compressed_gradients_cannot_be_scattered():
    strategy = kd.strategies.get("mirrored", devices=["/cpu:0"], optimizer_sharding="gradients")
    model = kd.DistributedModel(*_graph(), strategy=strategy)
    with pytest.raises(ValueError) as excinfo:
        model.compile(
            optimizer=kd.optimizers.DistributedOptimizer("sgd", compression="fp16"), loss="mse"
        )
    assert_one_line_error(excinfo, "cannot compress them", "optimizer_sharding='optimizer'")


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda: keras.optimizers.Lamb(), "cannot shard Lamb"),
        (lambda: keras.optimizers.Adafactor(), "cannot shard Adafactor"),
        (
            lambda: kd.optimizers.DistributedOptimizer("sgd", backward_passes_per_step=2),
            "backward_passes_per_step",
        ),
    ],
)
def test_an_optimizer_that_cannot_be_sharded_is_one_line(make, fragment):
    model = kd.DistributedModel(*_graph(), strategy=_sharded_strategy())
    with pytest.raises(ValueError) as excinfo:
        model.compile(optimizer=make(), loss="mse")
    assert_one_line_error(excinfo, fragment)


def test_clipping_accumulated_gradients_is_one_line():
    # Where Keras's gradient_accumulation_steps runs (horovod): clipping
    # applies to the accumulated mean, which the parts cannot clip whole.
    with pytest.raises(ValueError) as excinfo:
        optimizer_shards.check_optimizer(
            keras.optimizers.SGD(gradient_accumulation_steps=2, clipnorm=1.0)
        )
    assert_one_line_error(excinfo, "cannot clip the accumulated gradients")


def _embedding_graph():
    inputs = keras.Input((4,), dtype="int32")
    pooled = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(13, 5)(inputs))
    return inputs, keras.layers.Dense(2)(pooled)


def _ids(n=32):
    rng = np.random.default_rng(0)
    return rng.integers(0, 13, size=(n, 4)).astype("int32"), rng.normal(size=(n, 2))


@pytest.mark.parametrize(
    "make",
    [
        lambda: keras.optimizers.Adam(0.05),  # adds the squares of duplicate rows
        lambda: keras.optimizers.SGD(0.5, clipnorm=0.05),  # clips the rows, as Keras
        lambda: keras.optimizers.Adagrad(0.5),  # leaves absent rows' accumulators
    ],
    ids=["adam", "sgd_clipnorm", "adagrad"],
)
def test_a_sparse_gradient_updates_its_parts_as_plain_keras(make):
    """An Embedding's gradient (`tf.IndexedSlices`) stays sparse: each
    replica's part of it is the elements of its rows in the part."""
    x, y = _ids()
    plain = keras.Model(*_embedding_graph())
    ours = kd.DistributedModel(*_embedding_graph(), strategy=_sharded_strategy())
    ours.set_weights(plain.get_weights())
    for model in (plain, ours):
        model.compile(optimizer=make(), loss="mse")
    reference = as_reference.fit(plain, x, y, 8, epochs=2, slots=True)
    ours.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    as_reference.assert_weights(reference, ours)


def test_one_replica_sharded_is_plain_kerass_twin():
    x, y = make_data()
    plain = keras.Model(*_graph())
    initial = plain.get_weights()
    ours = kd.DistributedModel(*_graph(), strategy=_sharded_strategy())
    ours.set_weights(initial)
    for model in (plain, ours):
        model.compile(
            optimizer=keras.optimizers.AdamW(0.01, weight_decay=0.1, clipnorm=0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    reference = as_reference.fit(plain, x, y, 32, epochs=2, slots=True)
    ours.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    as_reference.assert_weights(reference, ours)
    got, want = ours.optimizer.variables, plain.optimizer.variables
    assert [tuple(v.shape) for v in got] == [
        (int(np.prod(v.shape)),) if len(v.shape) else () for v in want
    ]
    memory = ours.strategy.describe(ours)
    assert memory.optimizer == sum(np.asarray(v).nbytes for v in want)


def test_mixed_float16_shards_the_loss_scale_optimizers_inner_one(tmp_path):
    """Under mixed_float16 compile wraps the optimizer in a LossScaleOptimizer:
    its inner one updates the parts, and a file holds both whole."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        x, y = make_data()
        plain = keras.Model(*_graph())
        ours = kd.DistributedModel(*_graph(), strategy=_sharded_strategy())
        ours.set_weights(plain.get_weights())
        for model in (plain, ours):
            model.compile(
                optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
            )
        # One device, one replica: the float16 forward and backward passes
        # are the same kernels on the same shapes as plain Keras's, on its
        # mean loss. What differs is float32 arithmetic after them: the
        # gradients multiplied by the batch's rows and divided by the
        # count again, two roundings (2 terms); the optimizer's update is
        # elementwise, alike on the parts.
        reference = as_reference.fit(plain, x, y, 32, epochs=2, slots=True, terms=2)
        ours.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        assert isinstance(ours.optimizer, keras.optimizers.LossScaleOptimizer)
        assert optimizer_shards.of(ours.optimizer) is not None
        as_reference.assert_weights(reference, ours)
        ours.save_weights(tmp_path / "m.weights.h5")
        loaded = keras.Model(*_graph())
        loaded.compile(optimizer="adam", loss="mse")
        loaded.optimizer.build(loaded.trainable_variables)
        loaded.load_weights(tmp_path / "m.weights.h5")
        got, want = loaded.optimizer.variables, plain.optimizer.variables
        assert len(got) == len(want) == len(reference.slots)
        for a, b, bound in zip(got, want, reference.slots):
            assert_within(np.asarray(a), np.asarray(b), bound, a.path)
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_a_custom_train_step_applies_through_the_parts():
    """`optimizer.apply_gradients` in the user's own step: the gradients
    are reduced once and each replica updates its part."""

    class GuideStep(kd.DistributedModel):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = self.compute_loss(y=y, y_pred=self(x, training=True))
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
            return {"loss": loss}

    x, y = make_data()
    plain = keras.Model(*_graph())
    ours = GuideStep(*_graph(), strategy=_sharded_strategy())
    ours.set_weights(plain.get_weights())
    for model in (plain, ours):
        model.compile(
            optimizer=keras.optimizers.Adam(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    reference = as_reference.fit(plain, x, y, 32, slots=True)
    ours.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    as_reference.assert_weights(reference, ours)
    assert ours.optimizer.variables[2].shape == (FEATURES * 16,)

"""Keras behaviours that must survive distribution, in one process.

Each test trains a model under `"mirrored"` (two logical CPUs, two real
replicas) and its plain Keras twin from the same initial weights, the way a
user ports an example: no fixed seeds beyond the shared weights. The
multi-worker counterparts run in real processes
(tests/distributed/test_keras_features_multi_worker.py).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import IdBatches, SampleIds

import keras_distrib as kd

import as_reference
from bounds_metrics import mixed_float16_fit
from float_bounds import assert_within, evaluate_apart, moving_statistics_apart, outputs_apart


def _data(n=192, features=8, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    y = (x[:, 0] > 0).astype("int32") + (x[:, 1] > 0.5).astype("int32")
    return x, y


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _twins(build_graph, strategy="mirrored", cls=None):
    """(plain Keras model, DistributedModel) with the same initial weights."""
    plain = keras.Model(*build_graph())
    model = (cls or kd.DistributedModel)(*build_graph(), strategy=strategy)
    model.set_weights(plain.get_weights())
    return plain, model


# -- mixed precision -------------------------------------------------------------------


@pytest.fixture
def mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_mixed_float16_applies_every_step_plain_keras_applies(mixed_float16):
    """The step used to differentiate the *sum* of per-sample losses times the
    loss scale, which overflows float16: 11 of 20 steps applied at batch
    8192. And a LossScaleOptimizer under mirrored applied gradients reduced
    twice (they doubled)."""

    def graph():
        inputs = keras.Input((16,))
        h = keras.layers.Dense(32, activation="relu")(inputs)
        logits = keras.layers.Dense(3)(h)
        return inputs, keras.layers.Activation("linear", dtype="float32")(logits)

    x, y = _data(n=20 * 2048, features=16)
    plain, model = _twins(graph)
    for m in (plain, model):
        m.compile(optimizer=keras.optimizers.SGD(0.05), loss=_loss())
    # The bounds count float16's roundings (bounds_metrics.mixed_float16_fit):
    # a kernel's by its matmuls' float16 results; a bias's gradient adds
    # its 2048 rows in float16, whose bound exceeds the bias's updates.
    reference = mixed_float16_fit(plain, x, y, 2048)
    model.fit(x, y, batch_size=2048, epochs=1, shuffle=False, verbose=0)
    assert type(model.optimizer).__name__ == "LossScaleOptimizer"
    steps = [int(m.optimizer.inner_optimizer.iterations.numpy()) for m in (plain, model)]
    assert steps == [20, 20]
    scales = [float(np.asarray(m.optimizer.dynamic_scale)) for m in (plain, model)]
    assert scales[0] == scales[1]
    as_reference.assert_weights(reference, model)


def test_a_multi_optimizer_applies_gradients_reduced_once():
    """A MultiOptimizer's sub-optimizers each reduced the (already reduced)
    gradients across replicas again: 0.1 off one device in 2 epochs."""

    def multi():
        by_path = keras.optimizers.OptimizerMap(default_optimizer=keras.optimizers.SGD(0.1))
        by_path["hidden.*"] = keras.optimizers.Adam(0.01)
        return keras.optimizers.MultiOptimizer(by_path)

    def graph():
        inputs = keras.Input((8,))
        h = keras.layers.Dense(16, activation="relu", name="hidden")(inputs)
        return inputs, keras.layers.Dense(3, name="logits")(h)

    x, y = _data()
    plain, model = _twins(graph)
    for m in (plain, model):
        m.compile(optimizer=multi(), loss=_loss())
    # The reference's bounds replay the MultiOptimizer (Adam and SGD by path).
    reference = as_reference.fit(plain, x, y, 32, 2)
    model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    as_reference.assert_weights(reference, model)


# -- functional model with a custom train_step -----------------------------------------


class _GuideStep:
    """The train_step of the Keras guide "Customizing what happens in fit"."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {"my_loss": loss, **{m.name: m.result() for m in self.metrics}}


class CustomModel(_GuideStep, kd.DistributedModel):
    pass


class PlainCustomModel(_GuideStep, keras.Model):
    pass


def _mlp():
    inputs = keras.Input((8,))
    return inputs, keras.layers.Dense(3)(keras.layers.Dense(16, activation="relu")(inputs))


def test_functional_model_with_custom_train_step(tmp_path):
    model = CustomModel(*_mlp(), strategy="mirrored")
    assert isinstance(model, CustomModel) and type(model).__name__ == "CustomModel"
    assert model.strategy.name == "mirrored" and model.strategy.num_replicas == 2
    plain = PlainCustomModel(*_mlp())
    plain.set_weights(model.get_weights())
    x, y = _data()
    for m in (plain, model):
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss=_loss(), metrics=["accuracy"])
    # The guide's step is Keras's own math: the trace follows it.
    reference = as_reference.fit(plain, x, y, 32, 2)
    history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0).history
    as_reference.assert_weights(reference, model)
    as_reference.assert_history(reference, history, ("accuracy",))
    assert "my_loss" in history
    path = str(tmp_path / "custom.keras")
    model.save(path)
    loaded = keras.models.load_model(path, custom_objects={"CustomModel": CustomModel})
    assert isinstance(loaded, CustomModel) and isinstance(loaded, kd.DistributedModel)
    # The same class and strategy at the same weights on the same batches:
    # the same kernels, the same results.
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))


def test_subclass_without_graph_is_still_a_subclassed_model():
    """Calling a subclass functionally must not turn other subclasses functional."""
    CustomModel(*_mlp(), strategy="single")

    class Net(kd.DistributedModel):
        def __init__(self, **kwargs):
            super().__init__(strategy="single", **kwargs)
            self.dense = keras.layers.Dense(2)

        def call(self, x):
            return self.dense(x)

    net = Net()
    assert net(np.zeros((1, 3), "float32")).shape == (1, 2)
    assert not isinstance(net, kd.model.FunctionalDistributedModel)


# -- BatchNormalization, Embedding, multi-output logs ----------------------------------


def _bn_graph(synchronized=False):
    def graph():
        inputs = keras.Input((8,))
        h = keras.layers.Dense(16, activation="relu")(inputs)
        h = keras.layers.BatchNormalization(synchronized=synchronized)(h)
        return inputs, keras.layers.Dense(3)(h)

    return graph


def _bn_layer(model):
    return next(lay for lay in model.layers if isinstance(lay, keras.layers.BatchNormalization))


def test_batch_norm_replicas_keep_one_moving_statistic():
    """Each replica normalizes its shard with the shard's statistics (as in
    tf.distribute and Horovod); the moving statistics are averaged over the
    replicas every step, so every copy holds one value and `predict` of a
    row does not depend on which replica computes it."""
    x, y = _data()
    x[96:] += 3.0  # the two replicas' shards have different statistics
    _, model = _twins(_bn_graph())
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=_loss())
    model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    layer = _bn_layer(model)
    for variable in (layer.moving_mean, layer.moving_variance):
        first, second = model.strategy.local_replica_values(variable)
        np.testing.assert_array_equal(first, second)
    rows = x[:64]
    # Each row on the other replica, at another place in its shard: sums
    # in other orders, at the same weights.
    assert_within(
        model.predict(rows, batch_size=64, verbose=0)[::-1],
        model.predict(rows[::-1], batch_size=64, verbose=0),
        outputs_apart(model, rows[::-1]),
        "predict",
    )


def test_synchronized_batch_norm_trains_like_plain_keras():
    """`BatchNormalization(synchronized=True)` (TensorFlow backend) computes
    global batch statistics: exactly plain Keras on one device."""
    x, y = _data()
    x[96:] += 3.0
    plain, model = _twins(_bn_graph(synchronized=True))
    for m in (plain, model):
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss=_loss())
    # The layer's sums over the rows count too (`float_bounds.gradient_terms`),
    # and its moving statistics have their own bounds.
    reference = as_reference.fit(plain, x, y, 64, 2)
    model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    moving = moving_statistics_apart(reference, x, 64)
    as_reference.assert_weights(reference, model, others=moving)
    variance = _bn_layer(plain).moving_variance
    assert_within(
        np.asarray(_bn_layer(model).moving_variance),
        np.asarray(variance),
        moving[id(variance)],
        "moving variance",
    )


def _sparse_data():
    rng = np.random.default_rng(0)
    dense = ((rng.random((203, 40)) < 0.1) * rng.random((203, 40))).astype("float32")
    return tf.sparse.from_dense(dense), (dense.sum(1) > 0.4).astype("int64")


def _sparse_model(make):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((40,), sparse=True)
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    model = make(inputs, keras.layers.Dense(2, activation="softmax")(hidden))
    model.compile(
        keras.optimizers.SGD(0.5), "sparse_categorical_crossentropy", metrics=["accuracy"]
    )
    return model


@pytest.fixture(scope="module")
def sparse_reference():
    """Plain Keras trained on the sparse rows in order (batches of 32, as
    the strategies' dataset), traced, and its `predict` with its bounds."""
    x, y = _sparse_data()
    reference = as_reference.fit(_sparse_model(keras.Model), x, y, 32, 2)
    return reference, reference.model.predict(x, batch_size=32, verbose=0), reference.predict(x)


@pytest.mark.parametrize(
    "strategy", ["single", "mirrored", "central_storage", "pipeline", "tensor_parallel"]
)
def test_sparse_input_trains_like_plain_keras(strategy, sparse_reference):
    """`keras.Input(sparse=True)` fed `tf.SparseTensor` batches: each replica
    gets its rows (`tf.sparse.slice`), the copy under the strategy keeps the
    input sparse (Keras's `clone_model` makes it dense), and training, the
    logs and `predict` match plain Keras."""
    x, y = _sparse_data()
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
    reference, predicted, predicted_apart = sparse_reference
    ours = _sparse_model(lambda i, o: kd.DistributedModel(i, o, strategy=strategy))
    assert ours.inputs[0].sparse
    history = ours.fit(data, epochs=2, verbose=0).history
    assert reference.logs.keys() == history.keys()
    as_reference.assert_history(reference, history, history.keys())
    assert_within(ours.predict(data, verbose=0), predicted, predicted_apart, "predict")


def _ragged_data(n=203):
    rng = np.random.default_rng(0)
    sequences = [rng.integers(1, 50, size=rng.integers(1, 10)).tolist() for _ in range(n)]
    return tf.ragged.constant(sequences), np.array([len(s) % 2 for s in sequences], "int32")


def _ragged_model(make):
    keras.utils.set_random_seed(4)
    inputs = keras.Input((None,), ragged=True, dtype="int32")
    pooled = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(50, 8)(inputs))
    model = make(inputs, keras.layers.Dense(2)(keras.layers.Dense(16, activation="relu")(pooled)))
    model.compile(keras.optimizers.SGD(0.5), _loss(), metrics=["accuracy"])
    return model


@pytest.fixture(scope="module")
def ragged_reference():
    """Plain Keras trained on the ragged rows in order (batches of 32),
    traced; its `evaluate` and `predict` with their bounds."""
    x, y = _ragged_data()
    reference = as_reference.fit(_ragged_model(keras.Model), x, y, 32, 2)
    model = reference.model
    return (
        reference,
        (model.evaluate(x, y, batch_size=32, verbose=0), reference.evaluate(x, y, 32)),
        (model.predict(x, batch_size=32, verbose=0), reference.predict(x)),
    )


@pytest.mark.parametrize(
    "strategy,feed",
    [
        ("single", "dataset"),
        ("mirrored", "dataset"),
        ("central_storage", "dataset"),
        ("pipeline", "dataset"),
        ("tensor_parallel", "dataset"),
        ("mirrored", "tensor"),
    ],
)
def test_ragged_input_trains_like_plain_keras(strategy, feed, ragged_reference):
    """`keras.Input(ragged=True)` fed `tf.RaggedTensor` batches (variable-length
    token ids): each replica gets its rows (a row slice; this used to be refused
    with "Ragged inputs cannot be split across replicas yet"), and training,
    the logs, `evaluate` and `predict` match plain Keras."""
    x, y = _ragged_data()
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
    fit = dict(x=data) if feed == "dataset" else dict(x=x, y=y, batch_size=32, shuffle=False)
    reference, (evaluated, evaluated_apart), (predicted, predicted_apart) = ragged_reference
    ours = _ragged_model(lambda i, o: kd.DistributedModel(i, o, strategy=strategy))
    history = ours.fit(epochs=2, verbose=0, **fit).history
    assert reference.logs.keys() == history.keys()
    as_reference.assert_history(reference, history, history.keys())
    assert_within(ours.evaluate(data, verbose=0), evaluated, evaluated_apart, "evaluate")
    assert_within(ours.predict(data, verbose=0), predicted, predicted_apart, "predict")
    as_reference.assert_weights(reference, ours)


def _adapted_preprocessing_graph(numbers, words, sentences):
    """Inputs through an adapted `Normalization`, `StringLookup` and
    `TextVectorization` (state outside their weights), then Dense layers."""
    norm = keras.layers.Normalization()
    norm.adapt(numbers)
    lookup = keras.layers.StringLookup(output_mode="one_hot")
    lookup.adapt(words)
    vectorize = keras.layers.TextVectorization(max_tokens=8, output_mode="multi_hot")
    vectorize.adapt(sentences)
    inputs = [keras.Input((4,)), keras.Input((1,), dtype="string"), keras.Input((), dtype="string")]
    h = keras.layers.Concatenate()([norm(inputs[0]), lookup(inputs[1]), vectorize(inputs[2])])
    return inputs, keras.layers.Dense(2)(keras.layers.Dense(8, activation="relu")(h))


def _preprocessing_data():
    rng = np.random.default_rng(0)
    numbers = rng.normal(3.0, 2.0, size=(96, 4)).astype("float32")
    words = tf.constant([["a", "b", "c", "d", "e"][i % 5] for i in range(96)])[:, None]
    sentences = tf.constant(
        [" ".join(["x", "y", "z"][(i + j) % 3] for j in range(i % 4 + 1)) for i in range(96)]
    )
    return [numbers, words, sentences], (numbers[:, 0] > 3.0).astype("int32")


@pytest.fixture(scope="module")
def preprocessing_reference():
    """Plain Keras through the adapted layers: its initial weights and
    `predict` (with their bounds), then trained in order, traced, and its
    `evaluate` (with its bounds)."""
    x, y = _preprocessing_data()
    plain = keras.Model(*_adapted_preprocessing_graph(*x))
    initial = plain.get_weights()
    predicted = plain.predict(x, verbose=0), outputs_apart(plain, x)
    plain.compile(keras.optimizers.SGD(0.1), _loss(), metrics=["accuracy"])
    reference = as_reference.fit(plain, x, y, 32, 2)
    evaluated = plain.evaluate(x, y, batch_size=32, verbose=0), reference.evaluate(x, y, 32)
    return initial, predicted, reference, evaluated


@pytest.mark.parametrize("strategy", ["mirrored", "central_storage", "pipeline", "tensor_parallel"])
def test_adapted_preprocessing_layers_keep_their_state(strategy, preprocessing_reference):
    """Strategies that rebuild the graph copy each layer: an adapted
    `Normalization` then normalized with 0 and 1 (its mean and variance are
    computed when its variables load), and an adapted vocabulary was lost
    ("Table not initialized"). Predictions, training and `evaluate` match
    plain Keras."""
    x, y = _preprocessing_data()
    initial, (predicted, predicted_apart), reference, (evaluated, evaluated_apart) = (
        preprocessing_reference
    )
    ours = kd.DistributedModel(*_adapted_preprocessing_graph(*x), strategy=strategy)
    ours.set_weights(initial)
    assert_within(ours.predict(x, verbose=0), predicted, predicted_apart, "predict")
    ours.compile(keras.optimizers.SGD(0.1), _loss(), metrics=["accuracy"])
    history = ours.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0).history
    as_reference.assert_history(reference, history, reference.logs.keys())
    assert_within(
        ours.evaluate(x, y, batch_size=32, verbose=0), evaluated, evaluated_apart, "evaluate"
    )
    # The Normalization's adapted statistics: copied, never trained (exact).
    as_reference.assert_weights(reference, ours, others=0.0)


@pytest.mark.parametrize("strategy", ["single", "mirrored"])
def test_a_pydataset_with_workers_shows_every_batch_once_per_epoch(strategy):
    """Keras reads one batch to build the model; from a PyDataset with
    workers that used to leave the enqueuer holding the rest of that epoch,
    so every later epoch began with leftovers and lost others (shuffled: some
    batches twice, some never)."""
    inputs = keras.Input((2,))
    model = kd.DistributedModel(inputs, keras.layers.Dense(1)(inputs), strategy=strategy)
    model.compile(keras.optimizers.SGD(0.01), "mse", metrics=[SampleIds()])
    history = model.fit(IdBatches(workers=2), epochs=5, shuffle=True, verbose=0).history
    assert history["ids"] == [IdBatches.SUM] * 5
    assert model.evaluate(IdBatches(workers=2), verbose=0, return_dict=True)["ids"] == IdBatches.SUM


def test_embedding_gradients_travel_as_rows_and_adam_is_plain_keras():
    """An Embedding's gradient is sparse (`tf.IndexedSlices`): the replicas'
    rows are gathered, not summed into the whole table, and Keras's
    optimizer applies them as on one device (Adam adds each row's squares
    into its second moment). Before, the table went dense: Adam then moved
    rows differently from plain Keras (0.16 off after 4 epochs) and every
    step carried the whole table. Rows never seen stay put."""

    def graph():
        inputs = keras.Input((4,), dtype="int32")
        h = keras.layers.Embedding(50, 8)(inputs)
        return inputs, keras.layers.Dense(3)(keras.layers.Flatten()(h))

    rng = np.random.default_rng(1)
    # Ids repeat within a batch: the case where a dense sum changes Adam.
    x, y = rng.integers(0, 40, size=(128, 4)).astype("int32"), rng.integers(0, 3, size=128)
    for optimizer in (keras.optimizers.SGD, keras.optimizers.Adam):
        plain, model = _twins(graph)
        initial = model.get_weights()[0]
        reduced_shapes = _all_reduce_shapes(model)
        for m in (plain, model):
            m.compile(optimizer=optimizer(0.01), loss=_loss())
        # Adam's bounds replay Keras's Adam on the reference's gradients.
        reference = as_reference.fit(plain, x, y, 32, 2)
        model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        as_reference.assert_weights(reference, model)
        for m in (plain, model):
            np.testing.assert_array_equal(m.get_weights()[0][40:], initial[40:])
        # The step's all-reduces carried the batch's rows, never the table.
        assert reduced_shapes and (50, 8) not in reduced_shapes
        assert any(shape[-1:] == (8,) and shape[:1] == (2,) for shape in reduced_shapes)


def _all_reduce_shapes(model) -> list:
    """Records the static shape of every tensor `model.strategy.all_reduce`
    is given from now on (at trace time)."""
    shapes = []
    all_reduce = model.strategy.all_reduce

    def recording(values, op="sum"):
        shapes.extend(tuple(tf.TensorShape(v.shape).as_list()) for v in values)
        return all_reduce(values, op)

    model.strategy.all_reduce = recording
    return shapes


def test_multi_output_loss_logs():
    """The total loss log and the per-output loss logs are exact whatever
    the split (203 samples, batch 32: the last batch splits 6/5; see
    tests/integration/test_output_losses.py)."""

    def graph():
        inputs = keras.Input((8,))
        h = keras.layers.Dense(16, activation="relu")(inputs)
        return inputs, {
            "a": keras.layers.Dense(3, name="a")(h),
            "b": keras.layers.Dense(1, name="b")(h),
        }

    for n in (192, 203):
        x, labels = _data(n=n)
        y = {"a": labels, "b": x[:, :1] * 2.0}
        plain, model = _twins(graph)
        for m in (plain, model):
            m.compile(optimizer=keras.optimizers.SGD(0.05), loss={"a": _loss(), "b": "mse"})
        reference = as_reference.fit(plain, x, y, 32)
        history = model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0).history
        as_reference.assert_weights(reference, model)
        as_reference.assert_history(reference, history, ("loss", "a_loss", "b_loss"))


# -- load_model inside a strategy's scope ----------------------------------------------


def test_load_model_inside_scope_uses_that_strategy(tmp_path):
    x, y = _data()
    model = kd.DistributedModel(*_mlp(), strategy="central_storage")
    model.compile(optimizer="sgd", loss=_loss(), metrics=["accuracy"])
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    strategy = kd.strategies.get("mirrored")
    with strategy.scope():
        loaded = keras.models.load_model(path)
    assert loaded.strategy is strategy
    # The same weights on two replicas and on one: sums in other orders.
    assert_within(
        loaded.evaluate(x, y, verbose=0),
        model.evaluate(x, y, verbose=0),
        evaluate_apart(model, x, y),
        "evaluate",
    )
    loaded.fit(x, y, batch_size=32, epochs=1, verbose=0)
    with strategy.scope():
        with pytest.raises(ValueError, match="inside the scope of strategy 'mirrored'"):
            kd.DistributedModel(*_mlp(), strategy="single")


# -- from_model on an unbuilt Sequential -----------------------------------------------


def test_from_model_of_unbuilt_sequential_says_add_an_input():
    model = keras.Sequential([keras.layers.Dense(4)])
    with pytest.raises(ValueError, match=r"keras\.Input"):
        kd.DistributedModel.from_model(model, strategy="single")


# -- metric objects made outside the scope ---------------------------------------------


class _Threshold(keras.metrics.Mean):
    """A custom metric whose constructor needs an argument its config lacks."""

    def __init__(self, threshold):
        super().__init__(name="threshold")
        self.threshold = threshold

    def update_state(self, y_true, y_pred, sample_weight=None):
        return super().update_state(tf.cast(y_pred[:, 0] > self.threshold, "float32"))


def test_metric_objects_made_outside_are_adopted_in_place():
    """Metric objects made outside the scope keep their identity and come
    under the strategy (their variables made again there): also a metric
    whose constructor needs an argument its config lacks, which a config
    round trip could not re-create."""
    model = kd.DistributedModel(*_mlp(), strategy="mirrored")
    outside = keras.metrics.SparseTopKCategoricalAccuracy(k=2, name="top2")
    with model.strategy.scope():
        inside = keras.metrics.SparseCategoricalAccuracy(name="inside")
    threshold = _Threshold(0.5)
    model.compile(optimizer="sgd", loss=_loss(), metrics=[outside, inside, threshold])
    x, y = _data()
    history = model.fit(x, y, batch_size=32, epochs=1, verbose=0).history
    by_name = {m.name: m for m in model.metrics[1].metrics}
    assert by_name["top2"] is outside and by_name["inside"] is inside
    assert by_name["threshold"] is threshold
    assert all(model.strategy.holds(v) for m in model.metrics for v in m.variables)
    assert 0.0 <= history["threshold"][0] <= 1.0

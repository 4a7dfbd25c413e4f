"""Small models and data shared by the tests."""

import keras
import numpy as np
import tensorflow as tf

import keras_distrib as kd

# Paths and processes (no TensorFlow there: the unit tier imports them alone).
from pure_helpers import (  # noqa: F401  (re-exported)
    CHILD_PYTHONPATH,
    KERAS_FEATURES_WORKER,
    ROOT,
    WORKERS,
    kill_pids,
    kill_process_group,
    launch,
    process_alive,
)

FEATURES, CLASSES = 8, 3


def make_data(n=203, seed=0):
    """203 samples: with batch 32 the last batch (11) splits unevenly."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, size=n).astype("int32")
    return x, y


def graph():
    inputs = keras.Input((FEATURES,), name="features")
    h = keras.layers.Dense(16, activation="relu", name="hidden")(inputs)
    outputs = keras.layers.Dense(CLASSES, name="logits")(h)
    return inputs, outputs


def plain_model(seed=7):
    keras.utils.set_random_seed(seed)
    return keras.Model(*graph(), name="net")


class Net(kd.DistributedModel):
    """The subclassed usage form: same architecture as `graph()`."""

    def __init__(self, strategy="auto", **kwargs):
        super().__init__(strategy=strategy, **kwargs)
        self.hidden = keras.layers.Dense(16, activation="relu", name="hidden")
        self.logits = keras.layers.Dense(CLASSES, name="logits")

    def call(self, x):
        return self.logits(self.hidden(x))


def build(form, strategy, compile_model=True, seed=7, **compile_kwargs):
    """A model of usage `form` with the reference initial weights."""
    reference = plain_model(seed)
    if form == "functional":
        model = kd.DistributedModel(reference.input, reference.output, strategy=strategy)
    elif form == "subclass":
        model = Net(strategy=strategy)
        model(np.zeros((1, FEATURES), "float32"))
        model.set_weights(reference.get_weights())
    elif form == "from_model":
        model = kd.DistributedModel.from_model(reference, strategy=strategy)
    else:
        raise ValueError(form)
    if compile_model:
        options = dict(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        options.update(compile_kwargs)
        model.compile(**options)
    return model


class IdBatches(keras.utils.PyDataset):
    """5 batches of 101 samples (the last one short); y is the sample id.
    With `SampleIds`: which samples an epoch trained on."""

    SUM = sum(range(101)) * 1000.0 + 101  # SampleIds of a whole epoch

    def __len__(self):
        return 5

    def __getitem__(self, i):
        ids = np.arange(101, dtype="float32")[i * 21 : (i + 1) * 21]
        return np.stack([ids / 100.0, np.ones_like(ids)], axis=1), ids[:, None]


class SampleIds(keras.metrics.Metric):
    """Sum x 1000 + count of `y_true` (sample ids) over an epoch; exact in
    float32 for `IdBatches`."""

    def __init__(self, name="ids", **kwargs):
        super().__init__(name=name, **kwargs)
        self.total = self.add_variable((), initializer="zeros", name="total")
        self.count = self.add_variable((), initializer="zeros", name="count")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.total.assign_add(tf.reduce_sum(tf.cast(y_true, "float32")))
        self.count.assign_add(tf.cast(tf.size(y_true), "float32"))

    def result(self):
        return self.total * 1000.0 + self.count

    def reset_state(self):
        self.total.assign(0.0)
        self.count.assign(0.0)


def assert_trains_like_single(form, strategy, x, y, batch_size=32, epochs=2, steps=14):
    """The core equivalence: `strategy` with global batch B == "single" with B.

    Trains both (SGD, same initial weights, no shuffle) and checks weights,
    step count, history, evaluate and predict, each within the bound of
    float32's rounding of the same math in other orders (`as_reference`).
    Returns the model trained under `strategy` for further checks.
    """
    import as_reference  # traces the reference's steps: only where asked

    single = build(form, "single")
    model = build(form, strategy)
    initial = build(form, "single", compile_model=False)
    reference = as_reference.fit(single, x, y, batch_size, epochs)
    history = model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
    assert weights_moved(single, initial)
    as_reference.assert_weights(reference, model)
    assert int(model.optimizer.iterations.numpy()) == steps
    as_reference.assert_history(reference, history.history, ("loss", "accuracy"))
    as_reference.assert_evaluate(
        reference, model.evaluate(x, y, batch_size=batch_size, verbose=0), x, y, batch_size
    )
    as_reference.assert_predict(
        reference, model.predict(x, batch_size=batch_size, verbose=0), x, batch_size
    )
    return model


def warmup_rate(step, multiplier, warmup_steps, base):
    """The rate `LearningRateWarmup` sets after `step` steps: `base` rising
    linearly to `base * multiplier` over `warmup_steps` steps."""
    return base * (1 + (multiplier - 1) * min(step / warmup_steps, 1))


def train_single(initial, samples, batch_size, epochs, validation=0):
    """One process, strategy "single", from the weights `initial`: SGD 0.1,
    unshuffled, on `make_data(samples)` (its first `validation` samples also
    as validation data), traced (`as_reference.fit`). Returns (the
    `float_bounds.Reference`, whose `model` is the trained model and `logs`
    its history, x, y)."""
    import as_reference  # traces the reference's steps: only where asked

    x, y = make_data(samples)
    reference = keras.Model(*graph())
    model = kd.DistributedModel(reference.input, reference.output, strategy="single")
    model.set_weights(initial)
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    val = (x[:validation], y[:validation]) if validation else None
    return as_reference.fit(model, x, y, batch_size, epochs, validation_data=val), x, y


def weights_moved(model, reference):
    return any(not np.allclose(x, y) for x, y in zip(model.get_weights(), reference.get_weights()))


def all_variables_on(model, strategy):
    return all(strategy.holds(v) for v in model.variables)


class Crash(Exception):
    pass


class CrashAfter(keras.callbacks.Callback):
    """Raises after global step `at` (1-based) of its `fit`, as a crash would."""

    def __init__(self, at):
        super().__init__()
        self.at, self.steps = at, 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        if self.steps == self.at:
            raise Crash(f"crash after step {self.at}")


class Batches(keras.utils.PyDataset):
    """A PyDataset over arrays, in order, with a last partial batch."""

    def __init__(self, x, y, batch_size):
        super().__init__()
        self.x, self.y, self.batch_size = x, y, batch_size

    def __len__(self):
        return -(-len(self.x) // self.batch_size)

    def __getitem__(self, i):
        s = slice(i * self.batch_size, (i + 1) * self.batch_size)
        return self.x[s], self.y[s]


def tf_dataset(x, y, batch_size):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)


COLLECTIVE_OPS = {
    "CollectiveReduceV2",
    "CollectiveReduceV3",
    "CollectiveReduce",
    "NcclAllReduce",
    "HorovodAllreduce",
    "HorovodGroupedAllreduce",
}


def collective_dtypes(model, x, y):
    """Dtypes of the all-reduce ops in the model's traced training step.

    Traces (does not run) the distributed train step and reads the dtype
    attribute of every collective op in its graph and nested functions,
    and the input dtypes of the shared-memory all-reduce (a PyFunc).
    """
    step = tf.function(lambda data: model.strategy.run(model.train_step, data))
    graph = step.get_concrete_function((tf.constant(x), tf.constant(y))).graph.as_graph_def()
    nodes = list(graph.node)
    for function in graph.library.function:
        nodes.extend(function.node_def)
    dtypes = {tf.as_dtype(n.attr["T"].type).name for n in nodes if n.op in COLLECTIVE_OPS}
    for n in nodes:
        if n.op == "PyFunc" and "kd_host_all_reduce" in n.name:
            dtypes.update(tf.as_dtype(t).name for t in n.attr["Tin"].list.type)
    return sorted(dtypes)


# The model zoo's patterns (tests/zoo/patterns.py) each multi-process
# strategy runs, in the launches of tests/conftest.py (`probes`,
# `horovod_probes`) and tests/zoo/test_zoo_processes.py (parameter_server).
_DATA_PARALLEL_ZOO = (
    "lambda",
    "user_layer",
    "user_metric",
    "gan",
    "gan_random",
    "wgan_gp",
    "guide_train_step",
    "embeddings_adam",
    "multi_io",
    "dropout_noise",
    "tf_distribute_scope",
)
ZOO_PROCESS_PATTERNS = {
    "multi_worker": _DATA_PARALLEL_ZOO,
    "horovod": _DATA_PARALLEL_ZOO,
    "parameter_server": (
        "lambda",
        "user_layer",
        "user_metric",
        "embeddings_adam",
        "gan",
        "guide_train_step",
        "tf_distribute_scope",
    ),
}


# -- activation checkpointing (keras.RematScope) ----------------------------------


class CountedDense(keras.layers.Dense):
    """A Dense that counts the times its forward pass is traced or run
    (`keras.RematScope` adds the one the backward pass recomputes)."""

    calls = 0

    def call(self, inputs):
        CountedDense.calls += 1
        return super().call(inputs)


# -- each replica's own random numbers (keras_distrib.replica_seeds) ---------------


class MCDropout(keras.layers.Dropout):
    """Dropout also in `predict`: Keras's recipe for Monte Carlo dropout."""

    def call(self, inputs, training=None):
        return super().call(inputs, training=True)


def monte_carlo_dropped(strategy) -> np.ndarray:
    """Which inputs `MCDropout(0.5)` drops in `predict` of one global batch
    of 32 rows of 64 ones (the two replicas' rows: 16 each)."""
    inputs = keras.Input((64,))
    model = kd.DistributedModel(inputs, MCDropout(0.5)(inputs), strategy=strategy)
    return model.predict(np.ones((32, 64), "float32"), batch_size=32, verbose=0) == 0


def dropout_kept_counts(strategy) -> tuple[np.ndarray, int]:
    """How many of the 32 rows of one training step keep each of 64 inputs
    (and this process's rank):
    one SGD step (learning rate 1) of the mean absolute output of
    `Dense(1, kernel ones, no bias)` after `Dropout(0.5)` on rows of ones
    moves kernel[j] by (rows keeping input j) / 16."""
    inputs = keras.Input((64,))
    dense = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")
    model = kd.DistributedModel(inputs, dense(keras.layers.Dropout(0.5)(inputs)), strategy=strategy)
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mae")
    model.fit(
        np.ones((32, 64), "float32"),
        np.zeros((32, 1), "float32"),
        batch_size=32,
        epochs=1,
        shuffle=False,
        verbose=0,
    )
    return np.rint(16 * (1 - model.get_weights()[0][:, 0])).astype(int), model.strategy.rank


def assert_replicas_drop_alike_only_by_chance(dropped) -> None:
    """The first 16 rows' masks against the last 16's: independent masks
    agree on about half of the 1,024 entries (0.5 +- 0.016); one mask for
    both replicas on all of them."""
    dropped = np.asarray(dropped)
    assert 0.4 < dropped.mean() < 0.6
    assert 0.4 < np.mean(dropped[:16] == dropped[16:]) < 0.6


def assert_kept_counts_from_own_masks(kept) -> None:
    """With one mask for both replicas, every count was twice one replica's:
    even for all 64 inputs (by chance: 2**-64)."""
    kept = np.asarray(kept)
    assert 8 < kept.mean() < 24  # about half of the 32 rows keep each input
    assert np.any(kept % 2 == 1), kept

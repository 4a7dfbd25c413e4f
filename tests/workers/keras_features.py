"""Keras behaviours that must survive `multi_worker`, probed as users write them.

Run by `keras-distrib launch -n 2`
(tests/distributed/test_keras_features_multi_worker.py). Each probe named
by `--probes` writes `--out/<probe>-rank<r>.json` (and `.npz`
weights where useful); the test compares the ranks with each other and with
a plain Keras twin trained on the whole data from the same initial weights:
here, and in the test's own process, traced, from the data and models this
module makes (the test imports it; its flags are defined when it runs).
Nothing is seeded unless the probe is about seeds.
"""

import contextlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "zoo"))

import keras  # noqa: E402
import keras_distrib as kd  # noqa: E402
from keras_distrib.input.fit_input import FitInput  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402
from helpers import (
    CountedDense,
    IdBatches,
    SampleIds,
    dropout_kept_counts,  # noqa: E402
    monte_carlo_dropped,
)

FLAGS = flags.FLAGS


def _define_flags():
    """The script's flags (defined when it runs: the test imports this
    module for the probes' data and models)."""
    flags.DEFINE_string("out", None, "Directory for results.")
    flags.DEFINE_list(
        "probes",
        ["metric_objects", "unseeded_shuffle", "load_model", "batch_norm"],
        "Probes to run.",
    )
    flags.DEFINE_integer("seed", 1, "Seed for the `seeded_shuffle` probe.")
    flags.DEFINE_list("zoo", [], "Zoo patterns (tests/zoo/patterns.py) of the `zoo` probe.")
    flags.DEFINE_string(
        "strategy",
        "multi_worker",
        "Strategy of the `sparse_input`, `ragged_input` and later probes "
        "(`horovod`: run by `keras-distrib launch --backend horovod`).",
    )


BATCH = 32


def _data(n=203):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 8)).astype("float32")
    y = (x[:, 0] > 0).astype("int32") + (x[:, 1] > 0.5).astype("int32")
    return x, y


def _graph(batch_norm=False):
    inputs = keras.Input((8,))
    h = keras.layers.Dense(16, activation="relu")(inputs)
    if batch_norm:
        h = keras.layers.BatchNormalization()(h)
    return inputs, keras.layers.Dense(3)(h)


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _twin(model, x, y, epochs, **compile_kwargs):
    """A plain Keras model with `model`'s initial weights, trained on all data."""
    twin = keras.models.clone_model(keras.Model(model.input, model.output))
    twin.set_weights(model.get_weights())
    twin.compile(optimizer=keras.optimizers.SGD(0.1), loss=_loss(), **compile_kwargs)
    history = twin.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)
    return twin, history.history


def _write(name, rank, result):
    with open(os.path.join(FLAGS.out, f"{name}-rank{rank}.json"), "w") as f:
        json.dump(result, f)


def metric_objects_metrics():
    """The `metric_objects` probe's metrics (made anew for each model)."""
    return [
        "accuracy",
        keras.metrics.SparseCategoricalAccuracy(name="acc_object"),
        keras.metrics.SparseTopKCategoricalAccuracy(k=2, name="top2"),
    ]


def metric_objects():
    """Metric objects made outside any scope report global values (and the
    weights both trainings started from)."""
    x, y = _data()
    model = kd.DistributedModel(*_graph(), strategy="multi_worker")
    initial = [w.tolist() for w in model.get_weights()]
    _, twin = _twin(model, x, y, 2, metrics=metric_objects_metrics())
    model.compile(
        optimizer=keras.optimizers.SGD(0.1), loss=_loss(), metrics=metric_objects_metrics()
    )
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
    evaluated = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    return model.strategy.rank, {
        "history": history,
        "twin": twin,
        "evaluate": evaluated,
        "initial": initial,
    }


def unseeded_shuffle():
    """An unseeded `.shuffle()` (as in TF's tutorial) still shows every sample
    once per epoch across the workers."""
    n = 96
    ids = np.arange(n, dtype="int64")
    strategy = kd.strategies.get("multi_worker")
    dataset = tf.data.Dataset.from_tensor_slices(ids).shuffle(n).batch(BATCH)
    fit = strategy.distribute_fit_input(FitInput(x=dataset, shuffle=True))
    epochs = [[int(i) for batch in fit.x for i in np.ravel(batch)] for _ in range(2)]
    # And fit on the tutorial's pipeline shape (shuffle, batch, repeat).
    x, y = _data()
    pipeline = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x)).batch(BATCH).repeat()
    model = kd.DistributedModel(*_graph(), strategy=strategy)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=_loss())
    model.fit(pipeline, epochs=2, steps_per_epoch=5, verbose=0)
    return strategy.rank, {"epochs": epochs, "iterations": int(model.optimizer.iterations.numpy())}


def seeded_shuffle():
    """`keras.utils.set_random_seed` makes `shuffle=True` runs repeat."""
    keras.utils.set_random_seed(FLAGS.seed)
    x, y = _data()
    model = kd.DistributedModel(*_graph(), strategy="multi_worker")
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=_loss())
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=True, verbose=0)
    return model.strategy.rank, {"weights": [w.tolist() for w in model.get_weights()]}


def load_model():
    """`keras.models.load_model` inside `strategy.scope()`, as TF's tutorial
    does, gives a model on that strategy."""
    x, y = _data()
    model = kd.DistributedModel(*_graph(), strategy="multi_worker")
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=_loss(), metrics=["accuracy"])
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    rank = model.strategy.rank
    path = os.path.join(FLAGS.out, f"model-rank{rank}.keras")
    model.save(path)
    with model.strategy.scope():
        restored = keras.models.load_model(path)
    same_strategy = restored.strategy is model.strategy
    before = model.evaluate(x, y, batch_size=BATCH, verbose=0)
    after = restored.evaluate(x, y, batch_size=BATCH, verbose=0)
    restored.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    gap = max(
        float(np.abs(a - b).max()) for a, b in zip(model.get_weights(), restored.get_weights())
    )
    return rank, {
        "same_strategy": same_strategy,
        "before": before,
        "after": after,
        "trained_gap": gap,
    }


def batch_norm():
    """BatchNormalization's moving statistics stay equal on every worker."""
    x, y = _data()
    model = kd.DistributedModel(*_graph(batch_norm=True), strategy="multi_worker")
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=_loss())
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=True, verbose=0)
    layer = next(lay for lay in model.layers if isinstance(lay, keras.layers.BatchNormalization))
    return model.strategy.rank, {
        "moving_mean": np.asarray(layer.moving_mean).tolist(),
        "moving_variance": np.asarray(layer.moving_variance).tolist(),
        "predict": model.predict(x[:8], verbose=0).tolist(),
    }


def _ours_and_twin(graph, ours_in=None):
    """Ours (under `--strategy`, built within `ours_in`) and a plain Keras
    model, each on its own `graph()`, both starting from one set of weights
    drawn from a fixed seed, the same on every worker (horovod broadcasts
    rank 0's weights at the first build, after a twin would have copied its
    rank's own)."""
    with contextlib.nullcontext() if ours_in is None else ours_in:
        model = kd.DistributedModel(*graph(), strategy=FLAGS.strategy)
    twin = keras.Model(*graph())
    start = fixed_start(twin)
    model.set_weights(start)
    twin.set_weights(start)
    return model, twin


def fixed_start(model):
    """Weights for `model` drawn from a fixed seed (`_ours_and_twin`'s)."""
    rng = np.random.default_rng(7)
    return [rng.normal(scale=0.3, size=w.shape).astype(w.dtype) for w in model.get_weights()]


def _weights(model):
    return [w.tolist() for w in model.get_weights()]


def sparse_data():
    """The `sparse_input` probe's rows (dense, mostly zeros) and labels."""
    rng = np.random.default_rng(0)
    dense = ((rng.random((203, 40)) < 0.1) * rng.random((203, 40))).astype("float32")
    return dense, (dense.sum(1) > 0.4).astype("int32")


def sparse_graph():
    inputs = keras.Input((40,), sparse=True)
    return inputs, keras.layers.Dense(3)(keras.layers.Dense(16, activation="relu")(inputs))


def sparse_input():
    """`keras.Input(sparse=True)` fed `tf.SparseTensor` global batches: each
    worker trains on its rows, as the plain twin does on all of them (from
    `fixed_start`, SGD 0.5, 2 epochs); the logs and our trained weights."""
    dense, y = sparse_data()
    model, twin = _ours_and_twin(sparse_graph)
    data = tf.data.Dataset.from_tensor_slices((tf.sparse.from_dense(dense), y)).batch(BATCH)
    results = {}
    for name, m in (("twin", twin), ("ours", model)):
        m.compile(optimizer=keras.optimizers.SGD(0.5), loss=_loss(), metrics=["accuracy"])
        results[name] = m.fit(data, epochs=2, verbose=0).history
    results["sparse"] = bool(model.inputs[0].sparse)
    results["weights"] = _weights(model)
    return model.strategy.rank, results


def ragged_data():
    """The `ragged_input` probe's token ids (a `tf.RaggedTensor`) and labels."""
    rng = np.random.default_rng(0)
    sequences = [rng.integers(1, 50, size=rng.integers(1, 10)).tolist() for _ in range(203)]
    return tf.ragged.constant(sequences), np.array([len(s) % 2 for s in sequences], "int32")


def ragged_graph():
    inputs = keras.Input((None,), ragged=True, dtype="int32")
    pooled = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(50, 8)(inputs))
    return inputs, keras.layers.Dense(2)(keras.layers.Dense(16, activation="relu")(pooled))


def ragged_input():
    """`keras.Input(ragged=True)` fed `tf.RaggedTensor` token ids, as a
    dataset and as a tensor (each worker gathers its rows): per feed, the
    twin's and our logs (from `fixed_start`, SGD 0.5, 2 epochs) and our
    trained weights."""
    x, y = ragged_data()
    feeds = {
        "dataset": dict(x=tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)),
        "tensor": dict(x=x, y=y, batch_size=BATCH, shuffle=False),
    }
    results = {}
    for feed, fit in feeds.items():
        model, twin = _ours_and_twin(ragged_graph)
        for name, m in (("twin", twin), ("ours", model)):
            m.compile(optimizer=keras.optimizers.SGD(0.5), loss=_loss(), metrics=["accuracy"])
            results[f"{feed}_{name}"] = m.fit(epochs=2, verbose=0, **fit).history
        results[f"{feed}_weights"] = _weights(model)
    return model.strategy.rank, results


def remat_graph():
    inputs = keras.Input((8,))
    return inputs, keras.layers.Dense(3)(CountedDense(16, activation="relu")(inputs))


def remat():
    """A model built in `keras.RematScope(mode="full")` under `--strategy`
    against the plain twin built without it, Adam 0.01, from the same
    weights (`fixed_start`), 2 epochs: the logs, our trained weights, and
    the forward passes each fit made (remat adds the one its backward pass
    recomputes)."""
    x, y = _data()
    model, twin = _ours_and_twin(remat_graph, ours_in=keras.RematScope(mode="full"))
    results = {}
    for name, m in (("twin", twin), ("ours", model)):
        m.compile(optimizer=keras.optimizers.Adam(0.01), loss=_loss())
        CountedDense.calls = 0
        results[name] = m.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
        results[f"{name}_forward_passes"] = CountedDense.calls
    results["weights"] = _weights(model)
    return model.strategy.rank, results


class _SamplesSeen(keras.metrics.Metric):
    """The samples this process has counted, in one variable of the given
    tf.distribute `aggregation` (how replicas' values combine on a read)."""

    def __init__(self, aggregation, name=None, dtype=None):
        super().__init__(name=name or f"seen_{aggregation}", dtype=dtype)
        self.aggregation = aggregation
        self.seen = self.add_variable((), "zeros", aggregation=aggregation, name="seen")

    def get_config(self):
        return {**super().get_config(), "aggregation": self.aggregation}

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.seen.assign_add(tf.cast(tf.shape(y_true)[0], self.dtype))

    def result(self):
        return self.seen


def metric_aggregation():
    """Custom metrics whose variable declares `aggregation` "sum", "mean" or
    "only_first_replica": what `fit` and `evaluate` report (203 samples,
    shared 102 / 101 by the workers)."""
    x, y = _data()
    model = kd.DistributedModel(*_graph(), strategy=FLAGS.strategy)
    metrics = [_SamplesSeen(a) for a in ("sum", "mean", "only_first_replica")]
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=_loss(), metrics=metrics)
    history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0).history
    evaluated = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    return model.strategy.rank, {"history": history, "evaluate": evaluated}


def adapted_data():
    """The `adapted_per_worker` probe's rows (4 features) and labels."""
    x, y = _data(64)
    return x[:, :4], y


def adapted_graph(x, shift):
    """A `Normalization` adapted on `x + shift`, then `Dense(3)`."""
    norm = keras.layers.Normalization()
    norm.adapt(x + shift)
    inputs = keras.Input((4,))
    return inputs, keras.layers.Dense(3)(norm(inputs))


def adapted_per_worker():
    """A `Normalization` each worker adapted on its own data (shifted by its
    rank): after `fit`, every worker's model predicts as a plain one
    normalizing with worker 0's statistics, with the trained Dense layer
    (its weights written beside the predictions, `<case>dense`)."""
    strategy = kd.strategies.get(FLAGS.strategy)
    x, y = adapted_data()

    def graph(shift):
        return adapted_graph(x, shift)

    def against_worker_0(model, shift):
        """Our predictions, and the Dense layer's weights a plain model
        normalizing with worker 0's statistics (shifted by `shift`) takes
        (the test predicts with it: `adapted_graph`)."""
        return model.predict(x, verbose=0).tolist(), _weights(model.layers[-1])

    model = kd.DistributedModel(*graph(10.0 * strategy.rank), strategy=strategy)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=_loss())
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    result = dict(zip(("predict", "dense"), against_worker_0(model, 0.0)))
    # Adapted per worker once built (before anything traced it): under
    # multi_worker `BroadcastInitialWeights` is what gives every worker
    # worker 0's values then.
    model = kd.DistributedModel(*graph(0.0), strategy=strategy)
    model.layers[1].adapt(x + 5.0 + 10.0 * strategy.rank)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=_loss())
    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=1,
        verbose=0,
        callbacks=[kd.callbacks.BroadcastInitialWeights()],
    )
    result.update(zip(("callback_predict", "callback_dense"), against_worker_0(model, 5.0)))
    # Resumed from a backup (worker 0 loads it, the others receive it) made
    # with other statistics.
    backup = os.path.join(FLAGS.out, "adapted_backup")
    for shift in (7.0, 0.0):
        model = kd.DistributedModel(*graph(shift), strategy=strategy)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=_loss())
        model.fit(
            x,
            y,
            batch_size=BATCH,
            epochs=1,
            verbose=0,
            callbacks=[kd.callbacks.BackupAndRestore(backup, delete_checkpoint=False)],
        )
    result.update(zip(("restored_predict", "restored_dense"), against_worker_0(model, 7.0)))
    return strategy.rank, result


def vocabulary_per_worker():
    """A `StringLookup` each worker adapted on its own words: the same three
    words, counted in another order, make vocabularies of one size with
    other ids. After `fit`, every worker's model predicts as a plain one
    with worker 0's vocabulary and the trained Dense layer (its weights
    written beside the predictions)."""
    strategy = kd.strategies.get(FLAGS.strategy)
    words, y = vocabulary_data()
    mine = ["abc", "cba"][strategy.rank % 2]
    model = kd.DistributedModel(*vocabulary_graph(mine), strategy=strategy)
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss=_loss())
    model.fit(words, y, batch_size=BATCH, epochs=1, verbose=0)
    return strategy.rank, {
        "vocabulary": model.layers[1].get_vocabulary(),
        "predict": model.predict(words, verbose=0).tolist(),
        "dense": _weights(model.layers[-1]),
    }


def vocabulary_data():
    """The `vocabulary_per_worker` probe's words and labels."""
    words = tf.constant([["a", "b", "c", "a", "b", "a"][i % 6] for i in range(96)])[:, None]
    return words, np.array([i % 3 for i in range(96)], "int32")


def vocabulary_graph(order):
    """A `StringLookup` adapted on the three words counted in `order` (3, 2
    and 1 times), one-hot, then `Dense(3)`."""
    lookup = keras.layers.StringLookup(output_mode="one_hot")
    lookup.adapt(tf.constant([w for w, n in zip(order, (3, 2, 1)) for _ in range(n)]))
    inputs = keras.Input((1,), dtype="string")
    return inputs, keras.layers.Dense(3)(lookup(inputs))


def pydataset_workers():
    """A PyDataset read by Keras's enqueuer (`workers=2`), shuffled: per
    epoch, the sum and count of the sample ids every worker trained on."""

    inputs = keras.Input((2,))
    model = kd.DistributedModel(inputs, keras.layers.Dense(1)(inputs), strategy="multi_worker")
    model.compile(keras.optimizers.SGD(0.01), "mse", metrics=[SampleIds()])
    history = model.fit(IdBatches(workers=2), epochs=4, shuffle=True, verbose=0).history
    return model.strategy.rank, {"ids": history["ids"]}


def replica_dropout():
    """Dropout masks of the two workers' rows in Monte Carlo dropout
    `predict` (gathered) and the kept counts of one training step (see
    tests/helpers.py). No seed anywhere."""
    dropped = monte_carlo_dropped(FLAGS.strategy)
    kept, rank = dropout_kept_counts(FLAGS.strategy)
    return rank, {"masks": dropped.tolist(), "kept": kept.tolist()}


def zoo():
    """Each pattern of `--zoo` under `--strategy`: the weights it started
    from and ended with (`zoo-<pattern>-rank<r>.npz`) and its logs or
    error (`zoo-<pattern>-rank<r>.json`); the test trains plain Keras from
    the same start and compares."""
    import patterns

    rank = 0
    for name in FLAGS.zoo:
        result = patterns.run_pattern(patterns.BY_NAME[name], FLAGS.strategy)
        rank = kd.strategies.get(FLAGS.strategy).rank
        if "error" not in result:
            arrays = {f"initial_{i}": w for i, w in enumerate(result.pop("initial"))}
            arrays.update({f"final_{i}": w for i, w in enumerate(result.pop("weights"))})
            np.savez(os.path.join(FLAGS.out, f"zoo-{name}-rank{rank}.npz"), **arrays)
        _write(f"zoo-{name}", rank, result)
    return rank, {"patterns": FLAGS.zoo}


def main(argv):
    del argv
    for probe in FLAGS.probes:
        rank, result = globals()[probe]()
        _write(probe, rank, result)


if __name__ == "__main__":
    _define_flags()
    flags.mark_flag_as_required("out")
    app.run(main)

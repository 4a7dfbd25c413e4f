"""The model, data and processes of the sharded-variables tests
(keras_distrib.strategies.parameter_server.sharded_variables): run as a script, one TF server or the
coordinator of a real cluster; imported, the model, data and plain Keras
twin the tests compare with.

`python tests/workers/sharded_ps.py server CLUSTER_JSON JOB INDEX` serves a
ps or worker task; `... chief CLUSTER_JSON MODE OUT` connects with
`ParameterServerStrategy(variable_partitioner=MinSizePartitioner(256, 2))`
and `ClusterCoordinator`, and writes what it measured to OUT (MODE `train`:
every optimizer; `save`: files saved and loaded back). Used by
tests/distributed/test_sharded_variables.py (the cluster) and
tests/integration/test_sharded_variables_in_process.py (the model and data).
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

VOCAB, LENGTH, CLASSES, BATCH, STEPS = 1000, 3, 5, 16, 30
PARTITION = dict(min_shard_bytes=256, max_shards=2)
# Expected parts (rows) of each weight under PARTITION: the embedding
# (1000, 16) and both kernels are split ((33, 5): 17 + 16 rows), biases not.
EXPECTED_PARTS = {
    "embedding/embeddings": [500, 500],
    "hidden/kernel": [24, 24],
    "hidden/bias": [33],
    "logits/kernel": [17, 16],
    "logits/bias": [5],
}
OPTIMIZERS = {
    # name: (keras class, kwargs, install before build?)
    "sgd_momentum": ("SGD", dict(learning_rate=0.3, momentum=0.9), True),
    "adam": ("Adam", dict(learning_rate=0.01), False),  # install() after build
    "adamw": ("AdamW", dict(learning_rate=0.01, weight_decay=0.05), True),
}


# -- shared by the tests and the chief --------------------------------------


def build_model():
    import keras

    inputs = keras.Input((LENGTH,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, 16, name="embedding")(inputs)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(33, activation="relu", name="hidden")(h)
    outputs = keras.layers.Dense(CLASSES, name="logits")(h)
    return keras.Model(inputs, outputs, name="net")


def initial_weights():
    import keras

    keras.utils.set_random_seed(3)
    return build_model().get_weights()


def make_optimizer(name):
    import keras

    cls, kwargs, _ = OPTIMIZERS[name]
    return getattr(keras.optimizers, cls)(**kwargs)


def data(seed=0, n=512):
    """40 tokens spread over the vocabulary (rows of both embedding parts);
    the class is a function of the first token."""
    rng = np.random.default_rng(seed)
    x = rng.choice(np.arange(0, VOCAB, 25), size=(n, LENGTH)).astype("int32")
    y = (x[:, 0] // 25 % CLASSES).astype("int32")
    return x, y


def loss_fn():
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def plain_replay(name, x, y):
    """A plain Keras model (no strategy) trained on the same batches, each
    step traced (`float_bounds.Trace`): (model, optimizer, each step's loss,
    the `float_bounds.Reference` of the run, with its optimizer variables'
    bounds)."""
    import tensorflow as tf

    from float_bounds import Reference, Trace

    model = build_model()
    model.set_weights(initial_weights())
    optimizer = make_optimizer(name)
    loss = loss_fn()
    model.compile(optimizer=optimizer, loss=loss)  # what the trace reads
    trace = Trace(model=model)
    losses = []
    for xb, yb in zip(x, y):
        trace.record(xb, yb)
        with tf.GradientTape() as tape:
            value = loss(yb, model(xb, training=True))
        grads = tape.gradient(value, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(value))
    trace.on_train_end()
    return model, optimizer, losses, Reference(model, trace, logs={"loss": losses}, slots=True)


# -- the processes ----------------------------------------------------------------


def serve(cluster, job, index):
    import tensorflow as tf

    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=4)
    tf.distribute.Server(
        tf.train.ClusterSpec(cluster),
        job_name=job,
        task_index=index,
        protocol="grpc",
        config=config,
        start=True,
    ).join()


def _connect(cluster):
    import tensorflow as tf

    tf.config.threading.set_inter_op_parallelism_threads(4)
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster), task_type="chief", task_id=0, rpc_layer="grpc"
    )
    partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(**PARTITION)
    strategy = tf.distribute.ParameterServerStrategy(resolver, variable_partitioner=partitioner)
    return strategy, tf.distribute.coordinator.ClusterCoordinator(strategy)


def _layout(variables):
    """{path: [[rows, device], ...]} of each variable's parts."""
    from keras_distrib.strategies.parameter_server import sharded_variables

    return {
        v.path: [
            [int(p.shape[0]) if p.shape.rank else 0, p.device] for p in sharded_variables.shards(v)
        ]
        for v in variables
    }


def _scheduled_step(strategy, coordinator, model, optimizer, seed, shuffle=False, record=None):
    """`(step, iterator)`: one training step to schedule on a worker, which
    returns the loss and the batch it used, and the workers' iterator.
    `record`, if given, gets the gradient types seen when the step is traced."""
    import tensorflow as tf

    from keras_distrib.strategies.parameter_server import sharded_variables

    loss = loss_fn()

    def dataset_fn():
        x, y = data(seed)
        dataset = tf.data.Dataset.from_tensor_slices((x, y))
        return (dataset.shuffle(512) if shuffle else dataset).repeat().batch(BATCH)

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    def replica_step(batch):
        x, y = batch
        with tf.GradientTape() as tape:
            value = loss(y, model(x, training=True))
        grads = sharded_variables.gradients(tape, value, model.trainable_variables)
        if record is not None:
            record.update(
                {v.path: type(g).__name__ for v, g in zip(model.trainable_variables, grads)}
            )
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return value, x, y

    @tf.function
    def step(iterator):
        return strategy.run(replica_step, args=(next(iterator),))

    return step, iterator


def _train(strategy, coordinator, model, optimizer, steps, seed, record):
    """`steps` steps scheduled one at a time (join after each); returns the
    losses and the batches the workers used, in order. `record` gets the
    gradient types seen when the step was traced."""
    step, iterator = _scheduled_step(strategy, coordinator, model, optimizer, seed, record=record)
    losses, xs, ys = [], [], []
    for _ in range(steps):
        result = coordinator.schedule(step, args=(iterator,))
        coordinator.join()
        value, x, y = result.fetch()
        losses.append(float(value))
        xs.append(x)
        ys.append(y)
    return losses, np.stack(xs), np.stack(ys)


def _sharded_model(strategy, weights, optimizer_name=None, install_first=True):
    from keras_distrib.strategies.parameter_server import sharded_variables

    with strategy.scope():
        model = build_model()
        model.set_weights(weights)
        if optimizer_name is None:
            return model, None
        optimizer = make_optimizer(optimizer_name)
        if install_first:
            sharded_variables.install(optimizer)
        optimizer.build(model.trainable_variables)
        if not install_first:
            sharded_variables.install(optimizer)
    return model, optimizer


def chief_train(strategy, coordinator, out):
    """Trains the sharded model with each optimizer for STEPS steps."""
    report = {}
    for name, (_, _, install_first) in OPTIMIZERS.items():
        model, optimizer = _sharded_model(strategy, initial_weights(), name, install_first)
        grad_types = {}
        losses, xs, ys = _train(strategy, coordinator, model, optimizer, STEPS, 0, grad_types)
        report[name] = dict(
            weights=_layout(model.weights),
            slots=_layout(optimizer.variables),
            grad_types=grad_types,
            losses=losses,
        )
        np.savez(
            os.path.join(out, f"{name}.npz"),
            x=xs,
            y=ys,
            **{f"w{i}": w for i, w in enumerate(model.get_weights())},
            **{f"o{i}": v.numpy() for i, v in enumerate(optimizer.variables)},
        )
    # Both workers at once (no join between steps): updates of the same
    # parts race, as in any asynchronous PS training; the loss still falls.
    model, optimizer = _sharded_model(strategy, initial_weights(), "sgd_momentum")
    report["async"] = _train_async(strategy, coordinator, model, optimizer, STEPS)
    np.savez(os.path.join(out, "async.npz"), *model.get_weights())
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f)


def _train_async(strategy, coordinator, model, optimizer, steps):
    step, iterator = _scheduled_step(strategy, coordinator, model, optimizer, 2, shuffle=True)
    results = [coordinator.schedule(step, args=(iterator,)) for _ in range(steps)]
    coordinator.join()
    return dict(
        losses=[float(r.fetch()[0]) for r in results], iterations=int(optimizer.iterations.numpy())
    )


def chief_save(strategy, coordinator, out):
    """Trains a little, saves; loads files back into fresh sharded models."""
    import keras

    model, optimizer = _sharded_model(strategy, initial_weights(), "adam")
    with strategy.scope():
        model.compile(optimizer=optimizer, loss=loss_fn())
    _train(strategy, coordinator, model, optimizer, 5, 1, {})
    model.save_weights(os.path.join(out, "sharded.weights.h5"))
    model.save(os.path.join(out, "sharded.keras"))
    np.savez(
        os.path.join(out, "saved.npz"),
        **{f"w{i}": w for i, w in enumerate(model.get_weights())},
        **{f"o{i}": v.numpy() for i, v in enumerate(optimizer.variables)},
    )

    # A plain model's file (no strategy in scope), and the sharded model's
    # own file, loaded into fresh sharded models.
    keras.utils.set_random_seed(11)
    plain = build_model()
    plain.save_weights(os.path.join(out, "plain.weights.h5"))
    from keras_distrib.strategies.parameter_server import sharded_variables

    loaded = {}
    for name in ("plain", "sharded"):
        fresh, _ = _sharded_model(strategy, [w * 0 + 7 for w in model.get_weights()])
        fresh.load_weights(os.path.join(out, f"{name}.weights.h5"))
        loaded[name] = fresh
        np.savez(
            os.path.join(out, f"loaded_{name}.npz"),
            **{f"w{i}": w for i, w in enumerate(fresh.get_weights())},
            **{
                f"p{i}_{j}": p.numpy()
                for i, v in enumerate(fresh.weights)
                for j, p in enumerate(sharded_variables.shards(v))
            },
        )
    np.savez(
        os.path.join(out, "plain.npz"), **{f"w{i}": w for i, w in enumerate(plain.get_weights())}
    )

    # The .keras file loaded in the strategy's scope: sharded weights, and
    # slots Keras puts unsharded on the coordinator until install().
    with strategy.scope():
        reloaded = keras.models.load_model(os.path.join(out, "sharded.keras"))
        slots_as_loaded = _layout(reloaded.optimizer.variables)
        sharded_variables.install(reloaded.optimizer)
    same = all(np.array_equal(a, b) for a, b in zip(model.get_weights(), reloaded.get_weights()))
    same_slots = all(
        np.array_equal(a.numpy(), b.numpy())
        for a, b in zip(optimizer.variables, reloaded.optimizer.variables)
    )
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(
            dict(
                loaded=_layout(loaded["sharded"].weights),
                reloaded=dict(
                    weights=_layout(reloaded.weights),
                    slots=_layout(reloaded.optimizer.variables),
                    slots_as_loaded=slots_as_loaded,
                    same_weights=same,
                    same_slots=same_slots,
                ),
            ),
            f,
        )


def chief(cluster, mode, out):
    strategy, coordinator = _connect(cluster)
    {"train": chief_train, "save": chief_save}[mode](strategy, coordinator, out)


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    role, cluster_json, *rest = sys.argv[1:]
    if role == "server":
        serve(json.loads(cluster_json), rest[0], int(rest[1]))
    else:
        started = time.time()
        chief(json.loads(cluster_json), rest[0], rest[1])
        print(f"chief {rest[0]} done in {time.time() - started:.1f}s", flush=True)

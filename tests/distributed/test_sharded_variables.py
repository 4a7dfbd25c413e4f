"""Keras 3 variables sharded over parameter servers (keras_distrib.sharded_variables).

A real cluster: 2 ps and 2 worker TF servers, processes shared by the tests
of this file; each test's coordinator ("chief") is a fresh process running
this file as a script (`python tests/distributed/test_sharded_variables.py chief ...`),
with `ParameterServerStrategy(variable_partitioner=MinSizePartitioner(256, 2))`
and `ClusterCoordinator`. The chief writes what it measured to a directory;
the test compares with a plain Keras model (no strategy) in this process.

The tests not marked slow need no cluster: a variable creator splits
variables into `ShardedVariable`s in this process, as the strategy does.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))  # the repository

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


# -- shared by this process and the chief --------------------------------------


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


# -- the processes ----------------------------------------------------------------


def serve(cluster, job, index):
    import tensorflow as tf

    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=4)
    tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name=job, task_index=index,
                         protocol="grpc", config=config, start=True).join()


def _connect(cluster):
    import tensorflow as tf

    tf.config.threading.set_inter_op_parallelism_threads(4)
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster), task_type="chief", task_id=0, rpc_layer="grpc")
    partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(**PARTITION)
    strategy = tf.distribute.ParameterServerStrategy(resolver, variable_partitioner=partitioner)
    return strategy, tf.distribute.coordinator.ClusterCoordinator(strategy)


def _layout(variables):
    """{path: [[rows, device], ...]} of each variable's parts."""
    from keras_distrib import sharded_variables

    return {v.path: [[int(p.shape[0]) if p.shape.rank else 0, p.device]
                     for p in sharded_variables.shards(v)]
            for v in variables}


def _scheduled_step(strategy, coordinator, model, optimizer, seed, shuffle=False,
                    record=None):
    """`(step, iterator)`: one training step to schedule on a worker, which
    returns the loss and the batch it used, and the workers' iterator.
    `record`, if given, gets the gradient types seen when the step is traced."""
    import tensorflow as tf

    from keras_distrib import sharded_variables

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
            record.update({v.path: type(g).__name__
                           for v, g in zip(model.trainable_variables, grads)})
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
    step, iterator = _scheduled_step(strategy, coordinator, model, optimizer, seed,
                                     record=record)
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
    from keras_distrib import sharded_variables

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
        report[name] = dict(weights=_layout(model.weights), slots=_layout(optimizer.variables),
                            grad_types=grad_types, losses=losses)
        np.savez(os.path.join(out, f"{name}.npz"), x=xs, y=ys,
                 **{f"w{i}": w for i, w in enumerate(model.get_weights())},
                 **{f"o{i}": v.numpy() for i, v in enumerate(optimizer.variables)})
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
    return dict(losses=[float(r.fetch()[0]) for r in results],
                iterations=int(optimizer.iterations.numpy()))


def chief_save(strategy, coordinator, out):
    """Trains a little, saves; loads files back into fresh sharded models."""
    import keras

    model, optimizer = _sharded_model(strategy, initial_weights(), "adam")
    with strategy.scope():
        model.compile(optimizer=optimizer, loss=loss_fn())
    _train(strategy, coordinator, model, optimizer, 5, 1, {})
    model.save_weights(os.path.join(out, "sharded.weights.h5"))
    model.save(os.path.join(out, "sharded.keras"))
    np.savez(os.path.join(out, "saved.npz"),
             **{f"w{i}": w for i, w in enumerate(model.get_weights())},
             **{f"o{i}": v.numpy() for i, v in enumerate(optimizer.variables)})

    # A plain model's file (no strategy in scope), and the sharded model's
    # own file, loaded into fresh sharded models.
    keras.utils.set_random_seed(11)
    plain = build_model()
    plain.save_weights(os.path.join(out, "plain.weights.h5"))
    from keras_distrib import sharded_variables

    loaded = {}
    for name in ("plain", "sharded"):
        fresh, _ = _sharded_model(strategy, [w * 0 + 7 for w in model.get_weights()])
        fresh.load_weights(os.path.join(out, f"{name}.weights.h5"))
        loaded[name] = fresh
        np.savez(os.path.join(out, f"loaded_{name}.npz"),
                 **{f"w{i}": w for i, w in enumerate(fresh.get_weights())},
                 **{f"p{i}_{j}": p.numpy() for i, v in enumerate(fresh.weights)
                    for j, p in enumerate(sharded_variables.shards(v))})
    np.savez(os.path.join(out, "plain.npz"),
             **{f"w{i}": w for i, w in enumerate(plain.get_weights())})

    # The .keras file loaded in the strategy's scope: sharded weights, and
    # slots Keras puts unsharded on the coordinator until install().
    with strategy.scope():
        reloaded = keras.models.load_model(os.path.join(out, "sharded.keras"))
        slots_as_loaded = _layout(reloaded.optimizer.variables)
        sharded_variables.install(reloaded.optimizer)
    same = all(np.array_equal(a, b) for a, b in zip(model.get_weights(), reloaded.get_weights()))
    same_slots = all(np.array_equal(a.numpy(), b.numpy())
                     for a, b in zip(optimizer.variables, reloaded.optimizer.variables))
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(dict(loaded=_layout(loaded["sharded"].weights),
                       reloaded=dict(weights=_layout(reloaded.weights), slots=_layout(
                           reloaded.optimizer.variables), slots_as_loaded=slots_as_loaded,
                           same_weights=same, same_slots=same_slots)), f)


def chief(cluster, mode, out):
    strategy, coordinator = _connect(cluster)
    {"train": chief_train, "save": chief_save}[mode](strategy, coordinator, out)


# -- the tests ----------------------------------------------------------------------


def _spawn(*args, log):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)
    return subprocess.Popen([sys.executable, HERE, *args], cwd=ROOT, env=env,
                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _kill(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """2 ps and 2 worker servers; yields the cluster spec (chief included)."""
    from keras_distrib.cluster import free_ports

    logs = tmp_path_factory.mktemp("servers")
    ports = free_ports(5)
    spec = {"chief": [f"127.0.0.1:{ports[0]}"],
            "worker": [f"127.0.0.1:{p}" for p in ports[1:3]],
            "ps": [f"127.0.0.1:{p}" for p in ports[3:5]]}
    procs = []
    try:
        for job in ("ps", "worker"):
            for index in range(len(spec[job])):
                with open(logs / f"{job}{index}.log", "w") as log:
                    procs.append(_spawn("server", json.dumps(spec), job, str(index), log=log))
        _wait_listening(ports[1:], procs, logs)
        yield spec
    finally:
        for proc in procs:
            _kill(proc)


def _wait_listening(ports, procs, logs, timeout=120):
    """Until every server accepts connections; fails if one exits."""
    deadline = time.monotonic() + timeout
    waiting = list(ports)
    while waiting:
        dead = [p.args[4:] for p in procs if p.poll() is not None]
        assert not dead and time.monotonic() < deadline, (
            f"servers not up (exited: {dead}):\n"
            + "\n".join(f.read_text()[-2000:] for f in sorted(logs.iterdir())))
        try:
            socket.create_connection(("127.0.0.1", waiting[0]), timeout=1).close()
            waiting.pop(0)
        except OSError:
            time.sleep(0.2)


def run_chief(cluster, mode, out, timeout=240):
    """Runs a fresh coordinator process; fails with its output's tail."""
    with open(out / "chief.log", "w") as log:
        proc = _spawn("chief", json.dumps(cluster), mode, str(out), log=log)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = "timeout"
        finally:
            _kill(proc)
    output = (out / "chief.log").read_text()
    assert code == 0, f"chief exited {code}:\n{output[-5000:]}"
    with open(out / "report.json") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def trained(cluster, tmp_path_factory):
    out = tmp_path_factory.mktemp("train")
    return out, run_chief(cluster, "train", out)


def plain_replay(name, x, y):
    """A plain Keras model (no strategy) trained on the same batches."""
    import tensorflow as tf

    model = build_model()
    model.set_weights(initial_weights())
    optimizer = make_optimizer(name)
    loss = loss_fn()
    losses = []
    for xb, yb in zip(x, y):
        with tf.GradientTape() as tape:
            value = loss(yb, model(xb, training=True))
        grads = tape.gradient(value, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(value))
    return model, optimizer, losses


def assert_sharded_as_expected(weights, slots):
    """Weights split as EXPECTED_PARTS, parts on distinct ps; each slot of a
    weight split the same way, part i on weight part i's ps."""
    assert {p: [rows for rows, _ in layout] for p, layout in weights.items()} == EXPECTED_PARTS
    for path, layout in weights.items():
        devices = [device for _, device in layout]
        assert len(set(devices)) == len(devices), (path, devices)
        assert all("/job:ps/" in d for d in devices), (path, devices)
        mine = [layout_ for p, layout_ in slots.items()
                if p.split("/", 1)[1].startswith(path.replace("/", "_") + "_")]
        assert mine, path
        for slot in mine:
            assert slot == layout, (path, slot, layout)


@pytest.mark.slow
def test_variables_and_slots_are_sharded_on_the_weights_ps(trained):
    _, report = trained
    for name in OPTIMIZERS:
        run = report[name]
        assert_sharded_as_expected(run["weights"], run["slots"])
        assert run["grad_types"]["embedding/embeddings"] == "IndexedSlices", run["grad_types"]
        assert run["grad_types"]["hidden/kernel"] != "IndexedSlices", run["grad_types"]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_sharded_training_equals_plain_training(trained, name):
    """One step at a time: the same as a plain model on the same batches."""
    out, report = trained
    run = np.load(out / f"{name}.npz")
    losses = report[name]["losses"]
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.2, losses
    model, optimizer, plain_losses = plain_replay(name, run["x"], run["y"])
    np.testing.assert_allclose(losses, plain_losses, atol=1e-5)
    for i, w in enumerate(model.get_weights()):
        np.testing.assert_allclose(run[f"w{i}"], w, atol=1e-5, rtol=0)
    assert len(optimizer.variables) == len([k for k in run.files if k.startswith("o")])
    for i, v in enumerate(optimizer.variables):
        np.testing.assert_allclose(run[f"o{i}"], v.numpy(), atol=1e-5, rtol=0, err_msg=v.path)


@pytest.mark.slow
def test_asynchronous_workers_train_sharded_variables(trained):
    out, report = trained
    run = report["async"]
    # Keras counts steps with `iterations.assign(iterations + 1)`, which
    # concurrent steps can overlap (measured: 26 of 30); weights are written
    # by TF assign_sub/assign_add only.
    assert 0 < run["iterations"] <= STEPS
    # Learned: the loss over the whole training set (not the racing steps'
    # own 16-row batch losses, whose first/last means are too noisy to
    # compare) falls from the initial weights to the trained ones.
    x, y = data(2)
    model = build_model()
    trained_weights = np.load(out / "async.npz")
    whole_set_loss = {}
    for when, weights in (("initial", initial_weights()),
                          ("trained", [trained_weights[f"arr_{i}"]
                                       for i in range(len(trained_weights.files))])):
        model.set_weights(weights)
        whole_set_loss[when] = float(loss_fn()(y, model(x)))
    assert whole_set_loss["trained"] < whole_set_loss["initial"] - 0.1, whole_set_loss


@pytest.mark.slow
def test_saved_files_load_into_plain_and_sharded_models(cluster, tmp_path):
    import keras

    report = run_chief(cluster, "save", tmp_path)
    saved = np.load(tmp_path / "saved.npz")
    weights = [saved[f"w{i}"] for i in range(len(EXPECTED_PARTS))]
    reference = build_model()
    reference.set_weights(weights)
    x, _ = data(seed=5, n=64)
    expected = reference.predict(x, verbose=0)

    plain = build_model()
    plain.load_weights(tmp_path / "sharded.weights.h5")
    np.testing.assert_array_equal(plain.predict(x, verbose=0), expected)

    loaded = keras.models.load_model(tmp_path / "sharded.keras")
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), expected)
    slots = loaded.optimizer.variables
    assert len(slots) == len([k for k in saved.files if k.startswith("o")])
    for i, v in enumerate(slots):
        np.testing.assert_array_equal(v.numpy(), saved[f"o{i}"], err_msg=v.path)

    # load_weights into fresh sharded models: whole values and their parts.
    assert {p: [r for r, _ in layout] for p, layout in report["loaded"].items()} == EXPECTED_PARTS
    plain_file = np.load(tmp_path / "plain.npz")
    for name, source in (("sharded", saved), ("plain", plain_file)):
        loaded = np.load(tmp_path / f"loaded_{name}.npz")
        for i, rows in enumerate(EXPECTED_PARTS.values()):
            np.testing.assert_array_equal(loaded[f"w{i}"], source[f"w{i}"])
            starts = np.cumsum([0] + rows)
            for j in range(len(rows)):
                np.testing.assert_array_equal(loaded[f"p{i}_{j}"],
                                              source[f"w{i}"][starts[j]:starts[j + 1]])

    # The .keras file loaded in the strategy's scope, then install().
    reloaded = report["reloaded"]
    assert reloaded["same_weights"] and reloaded["same_slots"]
    assert any("/job:chief/" in layout[0][1] for layout in reloaded["slots_as_loaded"].values())
    assert_sharded_as_expected(reloaded["weights"], reloaded["slots"])


# -- in one process: sharded variables without a cluster ------------------------------


def _split_in_two(next_creator, **kwargs):
    """A variable creator that, like ParameterServerStrategy with a
    partitioner, splits variables of >= 512 bytes in two along axis 0
    (parts on this process's device) and never a colocated one."""
    import tensorflow as tf

    from keras_distrib import _compat

    if kwargs.pop("colocate_with", None) is not None:
        return next_creator(**kwargs)
    value = kwargs.pop("initial_value")
    value = tf.convert_to_tensor(value() if callable(value) else value, dtype=kwargs.get("dtype"))
    if value.shape.rank == 0 or value.shape.num_elements() * value.dtype.size < 512:
        return next_creator(initial_value=value, **kwargs)
    kwargs.pop("shape", None)
    name, cut = kwargs.pop("name", "v"), (value.shape[0] + 1) // 2
    return _compat.sharded_variable_class()([
        next_creator(initial_value=value[:cut], name=f"{name}/part_0", **kwargs),
        next_creator(initial_value=value[cut:], name=f"{name}/part_1", **kwargs)])


def _sharded_in_process(optimizer_name=None, install_first=True):
    import tensorflow as tf

    from keras_distrib import sharded_variables

    with tf.variable_creator_scope(_split_in_two):
        model = build_model()
        model.set_weights(initial_weights())
        if optimizer_name is None:
            return model, None
        optimizer = make_optimizer(optimizer_name)
        if install_first:
            sharded_variables.install(optimizer)
            optimizer.build(model.trainable_variables)
            return model, optimizer
    # Built outside: unsharded slots, as Keras makes them under the strategy.
    optimizer.build(model.trainable_variables)
    return model, optimizer


IN_PROCESS_OPTIMIZERS = {
    "sgd": ("SGD", dict(learning_rate=0.1), True),
    "sgd_nesterov": ("SGD", dict(learning_rate=0.1, momentum=0.9, nesterov=True), True),
    **OPTIMIZERS,
}


def _writes(function, variables):
    """{variable part name: op types that write it} in a traced function."""
    names = {id(p.handle): p.name for v in variables for p in _parts(v)}
    captured = {inner.name: names[id(outer)]
                for outer, inner in function.graph.captures if id(outer) in names}
    writes = {}
    for op in function.graph.get_operations():
        if op.inputs and op.inputs[0].name in captured:
            if "Assign" in op.type or "Scatter" in op.type:
                writes.setdefault(captured[op.inputs[0].name], set()).add(op.type)
    return writes


def _parts(variable):
    from keras_distrib import sharded_variables

    return sharded_variables.shards(variable)


def test_gradients_of_sharded_variables_are_whole_variable_gradients():
    import tensorflow as tf

    from keras_distrib import sharded_variables

    model, _ = _sharded_in_process()
    assert [sharded_variables.is_sharded(v) for v in model.weights] == [
        len(rows) > 1 for rows in EXPECTED_PARTS.values()]
    plain = build_model()
    plain.set_weights(initial_weights())
    x, y = data(n=32)
    with tf.GradientTape() as tape:
        value = loss_fn()(y, model(x, training=True))
    ours = sharded_variables.gradients(tape, value, model.trainable_variables)
    with tf.GradientTape() as tape:
        value = loss_fn()(y, plain(x, training=True))
    theirs = tape.gradient(value, plain.trainable_variables)
    assert [type(g) for g in ours] == [type(g) for g in theirs]
    assert isinstance(ours[0], tf.IndexedSlices)
    assert ours[0].dense_shape.numpy().tolist() == [VOCAB, 16]
    for v, a, b in zip(model.trainable_variables, ours, theirs):
        assert tuple(a.shape) == tuple(v.shape)
        np.testing.assert_allclose(tf.convert_to_tensor(a), tf.convert_to_tensor(b),
                                   atol=1e-6, err_msg=v.path)


@pytest.mark.parametrize("name", list(IN_PROCESS_OPTIMIZERS))
def test_sharded_updates_are_assign_sub_or_scatter_sub_of_parts(name, monkeypatch):
    import tensorflow as tf

    from keras_distrib import sharded_variables

    monkeypatch.setitem(OPTIMIZERS, name, IN_PROCESS_OPTIMIZERS[name])
    model, optimizer = _sharded_in_process(name)
    x, y = data(n=64)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            value = loss_fn()(y, model(x, training=True))
        grads = sharded_variables.gradients(tape, value, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    writes = _writes(step.get_concrete_function(x, y), model.trainable_variables)
    # Never an assignment of a value computed from the weight: the increments
    # of asynchronous workers add up. The embedding's sparse gradient stays
    # sparse where Keras's update keeps it so (plain SGD).
    allowed = {"AssignSubVariableOp", "AssignAddVariableOp"}
    for v in model.trainable_variables:
        for part in _parts(v):
            sparse = name == "sgd" and "embedding" in v.path
            expected = {"ResourceScatterSub"} if sparse else allowed
            assert writes[part.name] and writes[part.name] <= expected, (part.name, writes)
    xs, ys = x.reshape(4, 16, LENGTH), y.reshape(4, 16)
    for xb, yb in zip(xs, ys):
        step(xb, yb)
    plain, plain_optimizer, _ = plain_replay(name, xs, ys)
    for a, b in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)
    for a, b in zip(optimizer.variables, plain_optimizer.variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-6, err_msg=a.path)


def test_install_after_build_shards_the_slots_keeping_values():
    import tensorflow as tf

    from keras_distrib import sharded_variables

    model, optimizer = _sharded_in_process("adam", install_first=False)
    slots = list(optimizer.variables)
    sharded = [v.path for v in slots if sharded_variables.is_sharded(v)]
    assert sharded == []  # Keras alone: one unsharded slot per weight
    for v in slots:
        v.assign(tf.random.normal(v.shape) if v.shape.rank else v + 3)
    before = [v.numpy() for v in slots]
    with tf.variable_creator_scope(_split_in_two):
        sharded_variables.install(optimizer)
    assert optimizer.variables == slots  # the same Keras variables
    expected = {f"{optimizer.name}/{w.path.replace('/', '_')}_{slot}"
                for w in model.trainable_variables if sharded_variables.is_sharded(w)
                for slot in ("momentum", "velocity")}
    assert {v.path for v in slots if sharded_variables.is_sharded(v)} == expected
    for v, value in zip(slots, before):
        np.testing.assert_array_equal(v.numpy(), value)


def test_gradients_is_tape_gradient_when_nothing_is_sharded():
    import tensorflow as tf

    from keras_distrib import sharded_variables

    model = build_model()
    model.set_weights(initial_weights())
    x, y = data(n=32)
    with tf.GradientTape(persistent=True) as tape:
        value = loss_fn()(y, model(x, training=True))
    ours = sharded_variables.gradients(tape, value, model.trainable_variables)
    theirs = tape.gradient(value, model.trainable_variables)
    assert [type(g) for g in ours] == [type(g) for g in theirs]
    assert isinstance(ours[0], tf.IndexedSlices)
    for a, b in zip(ours, theirs):
        np.testing.assert_array_equal(tf.convert_to_tensor(a), tf.convert_to_tensor(b))
    assert not any(sharded_variables.is_sharded(v) for v in model.weights)


def test_install_leaves_unsharded_training_unchanged():
    import tensorflow as tf

    from keras_distrib import sharded_variables

    x, y = data(n=64)
    results = []
    for install in (False, True):
        model = build_model()
        model.set_weights(initial_weights())
        optimizer = make_optimizer("adamw")
        if install:
            sharded_variables.install(optimizer)
            sharded_variables.install(optimizer)  # idempotent
        for xb, yb in zip(np.split(x, 4), np.split(y, 4)):
            with tf.GradientTape() as tape:
                value = loss_fn()(yb, model(xb, training=True))
            grads = sharded_variables.gradients(tape, value, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
        results.append(model.get_weights() + [v.numpy() for v in optimizer.variables])
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    role, cluster_json, *rest = sys.argv[1:]
    if role == "server":
        serve(json.loads(cluster_json), rest[0], int(rest[1]))
    else:
        started = time.time()
        chief(json.loads(cluster_json), rest[0], rest[1])
        print(f"chief {rest[0]} done in {time.time() - started:.1f}s", flush=True)

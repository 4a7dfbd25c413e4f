"""Small models and data shared by the tests."""

import os
import signal
import subprocess
import sys
import threading

import keras
import numpy as np
import tensorflow as tf

import keras_distrib as kd

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
        ids = np.arange(101, dtype="float32")[i * 21:(i + 1) * 21]
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


def assert_weights_close(a, b, atol=1e-5):
    wa, wb = a.get_weights(), b.get_weights()
    assert len(wa) == len(wb)
    for x, y in zip(wa, wb):
        np.testing.assert_allclose(x, y, atol=atol, rtol=0)


def assert_trains_like_single(form, strategy, x, y, batch_size=32, epochs=2, steps=14):
    """The core equivalence: `strategy` with global batch B == "single" with B.

    Trains both (SGD, same initial weights, no shuffle) and checks weights,
    step count, history, evaluate and predict (atol 1e-5). Returns the model
    trained under `strategy` for further checks.
    """
    single = build(form, "single")
    model = build(form, strategy)
    initial = build(form, "single", compile_model=False)
    fit = dict(batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
    h_single, h_model = single.fit(x, y, **fit), model.fit(x, y, **fit)
    assert weights_moved(single, initial)
    assert_weights_close(single, model)
    assert int(model.optimizer.iterations.numpy()) == steps
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(h_single.history[key], h_model.history[key], atol=1e-5)
    np.testing.assert_allclose(single.evaluate(x, y, batch_size=batch_size, verbose=0),
                               model.evaluate(x, y, batch_size=batch_size, verbose=0), atol=1e-5)
    np.testing.assert_allclose(single.predict(x, batch_size=batch_size, verbose=0),
                               model.predict(x, batch_size=batch_size, verbose=0), atol=1e-5)
    return model


def weights_moved(model, reference):
    return any(
        not np.allclose(x, y) for x, y in zip(model.get_weights(), reference.get_weights())
    )


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


COLLECTIVE_OPS = {"CollectiveReduceV2", "CollectiveReduceV3", "CollectiveReduce", "NcclAllReduce",
                  "HorovodAllreduce", "HorovodGroupedAllreduce"}


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


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The scripts the tests run as worker processes (shared by every tier).
WORKERS = os.path.join(ROOT, "tests", "workers")
KERAS_FEATURES_WORKER = os.path.join(WORKERS, "keras_features.py")

# The model zoo's patterns (tests/zoo/patterns.py) each multi-process
# strategy runs, in the launches of tests/conftest.py (`probes`,
# `horovod_probes`) and tests/zoo/test_zoo_processes.py (parameter_server).
_DATA_PARALLEL_ZOO = ("lambda", "user_layer", "user_metric", "gan", "gan_random", "wgan_gp",
                      "guide_train_step", "embeddings_adam", "multi_io", "dropout_noise",
                      "tf_distribute_scope")
ZOO_PROCESS_PATTERNS = {
    "multi_worker": _DATA_PARALLEL_ZOO,
    "horovod": _DATA_PARALLEL_ZOO,
    "parameter_server": ("lambda", "user_layer", "user_metric", "embeddings_adam", "gan",
                         "guide_train_step", "tf_distribute_scope"),
}


def process_alive(pid, zombies_count=True):
    """Whether process `pid` exists (an exited, unreaped one only if
    `zombies_count`: a worker whose launcher is gone waits for init to
    reap it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    if zombies_count:
        return True
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


# TensorFlow's gRPC server answers a request it fails to parse with INTERNAL
# "Unable to parse request" (tensorflow/core/distributed_runtime/rpc/
# grpc_call.h). CI saw it once, in a parameter-server job on a loaded
# 2-core machine (a remote copy from a worker to the chief; the coordinator
# does not count it as a worker failure, so `fit` fails); no other run of
# this suite has shown it, and no upstream issue was found. A job that
# fails with it, and nothing was done to it meanwhile, runs once more.
_TRANSPORT_FLAKE = 'grpc_message:"Unable to parse request"'


def launch(out, n, script, *script_args, launch_flags=(), timeout=300, expect=0, env=None,
           during=None):
    """Runs `keras-distrib launch -n n script ...` for real; returns its output.

    Fails with the output's tail unless the launcher exits with `expect`
    (every rank exited 0, by default); with `expect=None` returns
    `(exit code, output)` instead. `env` adds environment variables;
    `during(proc)`, if given, runs while the job does (to kill a task, say).
    The process group is killed whatever happens, so no worker outlives the
    test. A job that fails with TensorFlow's rare transport error (see
    `_TRANSPORT_FLAKE`) runs once more, unless `during` acted on it.
    """
    code, output = _launch_once(out, n, script, script_args, launch_flags, timeout, env, during)
    if code != 0 and during is None and _TRANSPORT_FLAKE in output:
        print(f"helpers.launch: {_TRANSPORT_FLAKE} (TensorFlow's gRPC transport); "
              "running the job once more", file=sys.stderr)
        code, output = _launch_once(out, n, script, script_args, launch_flags, timeout, env,
                                    during)
    if expect is None:
        return code, output
    assert code == expect, output[-5000:]
    return output


def _launch_once(out, n, script, script_args, launch_flags, timeout, env, during):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TMPDIR=str(out), **(env or {}))
    argv = [sys.executable, "-m", "keras_distrib.launch", "launch", "-n", str(n),
            "--timeout", str(timeout - 30), *launch_flags, script, *script_args]
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    chunks = []
    reader = threading.Thread(target=lambda: chunks.append(proc.stdout.read()), daemon=True)
    reader.start()
    try:
        if during is not None:
            during(proc)
        proc.wait(timeout=timeout)
        reader.join(timeout=10)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
    return proc.returncode, "".join(chunks)


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
    model = kd.DistributedModel(inputs, dense(keras.layers.Dropout(0.5)(inputs)),
                                strategy=strategy)
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mae")
    model.fit(np.ones((32, 64), "float32"), np.zeros((32, 1), "float32"),
              batch_size=32, epochs=1, shuffle=False, verbose=0)
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

"""The chief's script for parameter-server tests: `python ps_train.py MODES DIR`.

Started by `keras-distrib launch --workers N --ps M` (the chief runs it; the
workers and ps tasks are servers). Runs each of MODES (comma-separated) in
turn, on the same cluster, and writes each one's JSON report to DIR/MODE.json.

Modes:
    digits    the digits MLP, 10 epochs, and the same model trained by plain
              Keras in this process for comparison (validation accuracy)
    inputs    every input form: arrays, a dataset, a dataset function, a
              PyDataset, steps_per_execution=4, a custom train_step
    warmup    LearningRateWarmup with a float rate, and a schedule
    long      many small steps (a worker is killed meanwhile by the test)
    sharded   an embedding split over 2 ps tasks: trains, saves, loads
    callbacks Keras's epoch-level callbacks and ours in one fit
    resume    BackupAndRestore; the test kills the ps, then runs it again
    errors    bad input: one-line error messages
    remat     a model built in keras.RematScope against the same without it
"""

import contextlib
import json
import os
import sys
import time
import warnings

import keras_distrib as kd  # first: connects this chief to its cluster
from keras_distrib._compat import learning_rate_or_schedule

import keras
import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from _digits import digits_arrays  # noqa: E402
from helpers import CountedDense  # noqa: E402

DIRECTORY = sys.argv[2]


def digits():
    x, y = digits_arrays()
    order = np.random.RandomState(0).permutation(len(x))
    x, y = (x[order] / 16.0).astype("float32"), y[order].astype("int32")
    return (x[:1500], y[:1500]), (x[1500:], y[1500:])


def layers():
    inputs = keras.Input((64,))
    hidden = keras.layers.Dense(64, activation="relu")(inputs)
    return inputs, keras.layers.Dense(10)(hidden)


def compile_model(model, optimizer=None, **kwargs):
    model.compile(
        optimizer=optimizer or keras.optimizers.SGD(0.05),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[keras.metrics.SparseCategoricalAccuracy(name="acc")],
        **kwargs,
    )
    return model


(x, y), (x_val, y_val) = digits()


def steps_of(model):
    return int(model.optimizer.iterations.numpy())


def mode_digits(report, out):
    model = compile_model(
        kd.DistributedModel(*layers(), strategy="parameter_server"), keras.optimizers.SGD(0.1)
    )
    report["strategy"] = repr(model.strategy)
    report["placement"] = sorted({v.value.device.split("/device")[0] for v in model.weights})
    history = model.fit(x, y, batch_size=32, epochs=10, validation_data=(x_val, y_val), verbose=2)
    report["history"] = history.history
    report["iterations"] = steps_of(model)
    report["applied"] = model.strategy.steps_applied
    report["evaluate"] = model.evaluate(x_val, y_val, verbose=0, return_dict=True)
    plain = compile_model(keras.Model(*layers()), keras.optimizers.SGD(0.1))
    plain.fit(x, y, batch_size=32, epochs=10, verbose=0)
    report["plain_acc"] = plain.evaluate(x_val, y_val, verbose=0, return_dict=True)["acc"]


def mode_inputs(report, out):
    class Rows(keras.utils.PyDataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return x[i * 50 : (i + 1) * 50], y[i * 50 : (i + 1) * 50]

    class Custom(kd.DistributedModel):
        """The Keras guide's custom train_step, with a metric object of its own."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.hidden = keras.layers.Dense(32, activation="relu")
            self.out = keras.layers.Dense(10)
            self.seen = keras.metrics.Sum(name="seen")

        def call(self, inputs):
            return self.out(self.hidden(inputs))

        def train_step(self, data):
            features, labels = data
            with tf.GradientTape() as tape:
                logits = self(features, training=True)
                loss = self.compute_loss(y=labels, y_pred=logits)
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply(grads, self.trainable_variables)
            self.seen.update_state(tf.cast(tf.shape(features)[0], "float32"))
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(loss)
                elif metric.name != "seen":
                    metric.update_state(labels, logits)
            return {m.name: m.result() for m in self.metrics}

    dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(1500).batch(50)
    cases = {
        "arrays": dict(x=x, y=y, batch_size=50),
        "dataset": dict(x=dataset),
        "dataset_fn": dict(
            x=lambda: tf.data.Dataset.from_tensor_slices((x, y)).batch(50), steps_per_epoch=12
        ),
        "pydataset": dict(x=Rows()),
    }
    for name, kwargs in cases.items():
        model = compile_model(kd.DistributedModel(*layers(), strategy="parameter_server"))
        history = model.fit(epochs=2, verbose=0, **kwargs)
        report[name] = {"iterations": steps_of(model), "history": history.history}
    model = compile_model(
        kd.DistributedModel(*layers(), strategy="parameter_server"), steps_per_execution=4
    )
    history = model.fit(x, y, batch_size=50, epochs=2, verbose=0)
    report["steps_per_execution"] = {"iterations": steps_of(model), "history": history.history}
    model = compile_model(Custom(strategy="parameter_server"))
    history = model.fit(x, y, batch_size=50, epochs=2, verbose=0)
    report["custom"] = {"iterations": steps_of(model), "history": history.history}
    report["predict_rows"] = int(model.predict(x_val, batch_size=64, verbose=0).shape[0])


def mode_warmup(report, out):
    for kind in ("float", "schedule"):
        rate = (
            0.05 if kind == "float" else keras.optimizers.schedules.ExponentialDecay(0.05, 100, 1.0)
        )
        model = compile_model(
            kd.DistributedModel(*layers(), strategy="parameter_server"),
            optimizer=keras.optimizers.SGD(rate),
        )
        warmup = kd.callbacks.LearningRateWarmup(warmup_epochs=1, target_multiplier=3)
        model.fit(x, y, batch_size=50, epochs=2, verbose=0, callbacks=[warmup])
        report[kind] = {
            "iterations": steps_of(model),
            "final_lr": float(np.asarray(model.optimizer.learning_rate)),
            "schedule": type(learning_rate_or_schedule(model.optimizer)).__name__,
        }


def mode_long(report, out):
    model = compile_model(kd.DistributedModel(*layers(), strategy="parameter_server"))

    class Ready(keras.callbacks.Callback):
        """Says when epoch 0 is done; with PS_HOLD, waits after epoch 1
        until the test writes out + ".go" (the test's fault is over)."""

        def on_epoch_end(self, epoch, logs=None):
            if epoch == 0:
                with open(out + ".ready", "w") as f:
                    f.write("1")
            if epoch == 1 and os.environ.get("PS_HOLD"):
                deadline = time.time() + 120
                while not os.path.exists(out + ".go") and time.time() < deadline:
                    time.sleep(0.05)

    started = time.time()
    history = model.fit(
        x,
        y,
        batch_size=16,
        epochs=int(os.environ.get("PS_EPOCHS", "4")),
        verbose=0,
        callbacks=[Ready()],
    )
    report["seconds"] = time.time() - started
    report["iterations"] = steps_of(model)
    report["applied"] = model.strategy.steps_applied
    report["lost_results"] = model.strategy.lost_results
    report["scheduled"] = int(history.params["steps"]) * len(history.history["loss"])
    report["loss"] = history.history["loss"]


def mode_sharded(report, out):
    partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=256, max_shards=2
    )
    strategy = kd.strategies.get("parameter_server", variable_partitioner=partitioner)

    def embedding_layers():
        tokens = keras.Input((4,), dtype="int32")
        vectors = keras.layers.Embedding(500, 16)(tokens)
        return tokens, keras.layers.Dense(3)(keras.layers.Flatten()(vectors))

    rng = np.random.RandomState(1)
    ids = rng.randint(0, 500, (2000, 4)).astype("int32")
    labels = (ids[:, 0] % 3).astype("int32")
    model = kd.DistributedModel(*embedding_layers(), strategy=strategy)
    compile_model(model, optimizer=keras.optimizers.Adam(0.01))
    report["parts"] = {v.path: len(getattr(v.value, "variables", [v.value])) for v in model.weights}
    history = model.fit(ids, labels, batch_size=50, epochs=3, verbose=0)
    report["loss"] = history.history["loss"]
    report["iterations"] = steps_of(model)
    model.save_weights(out + ".weights.h5")
    model.save(out + ".keras")
    plain = keras.Model(*embedding_layers())
    plain.load_weights(out + ".weights.h5")
    loaded = keras.saving.load_model(out + ".keras", compile=False)
    mine = model.predict(ids[:64], verbose=0)
    report["weights_h5_max_diff"] = float(np.abs(plain.predict(ids[:64], verbose=0) - mine).max())
    report["keras_max_diff"] = float(np.abs(loaded.predict(ids[:64], verbose=0) - mine).max())
    again = kd.DistributedModel(*embedding_layers(), strategy=strategy)
    again.load_weights(out + ".weights.h5")
    report["reloaded_max_diff"] = float(np.abs(again.predict(ids[:64], verbose=0) - mine).max())


def mode_callbacks(report, out):
    # Keras's epoch-level callbacks and ours, all in one fit.
    model = compile_model(kd.DistributedModel(*layers(), strategy="parameter_server"))
    files = out + ".files"
    report["files"] = files
    callbacks = [
        keras.callbacks.ModelCheckpoint(
            files + "/epoch-{epoch}.weights.h5", save_weights_only=True
        ),
        keras.callbacks.ModelCheckpoint(
            files + "/best.keras", monitor="val_loss", save_best_only=True
        ),
        kd.callbacks.BackupAndRestore(files + "/backup", delete_checkpoint=False),
        keras.callbacks.TensorBoard(files + "/tensorboard"),
        keras.callbacks.CSVLogger(files + "/log.csv"),
        # The loss never falls by 10 after the first epoch: stops after the
        # third and puts the first epoch's weights back (on the ps).
        keras.callbacks.EarlyStopping(
            monitor="loss", min_delta=10.0, patience=2, restore_best_weights=True
        ),
        kd.callbacks.ThroughputMonitor(global_batch_size=32),
    ]
    started = time.time()
    history = model.fit(
        x,
        y,
        batch_size=32,
        epochs=10,
        validation_data=(x_val, y_val),
        verbose=0,
        callbacks=callbacks,
    )
    report["seconds"] = time.time() - started
    report["history"] = history.history
    report["iterations"] = steps_of(model)
    report["steps_per_epoch"] = history.params["steps"]
    report["predict"] = model.predict(x_val, verbose=0).tolist()
    report["profile_error"] = None
    try:
        model.fit(
            x,
            y,
            batch_size=32,
            epochs=1,
            verbose=0,
            callbacks=[keras.callbacks.TensorBoard(files + "/profile", profile_batch=2)],
        )
    except ValueError as error:
        report["profile_error"] = str(error)


def mode_resume(report, out):
    # Trains with a backup every 20 steps (mid-epoch too); the test kills the
    # ps after the second epoch (this run then fails) and runs the job
    # again, which resumes.
    model = compile_model(kd.DistributedModel(*layers(), strategy="parameter_server"))
    backup_dir = os.environ["PS_BACKUP_DIR"]

    class Ready(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                with open(out + ".ready", "w") as f:
                    f.write("1")

    class Begins(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            report["iterations_at_start"] = steps_of(self.model)

    history = model.fit(
        x,
        y,
        batch_size=32,
        epochs=int(os.environ["PS_EPOCHS"]),
        verbose=0,
        callbacks=[kd.callbacks.BackupAndRestore(backup_dir, save_freq=20), Begins(), Ready()],
    )
    report["epochs_run"] = len(history.history["loss"])
    report["iterations"] = steps_of(model)
    report["steps_per_epoch"] = history.params["steps"]
    report["val_acc"] = model.evaluate(x_val, y_val, verbose=0, return_dict=True)["acc"]


def mode_errors(report, out):
    def error_of(call):
        try:
            call()
        except Exception as e:  # noqa: BLE001 - the message is the test
            return f"{type(e).__name__}: {e}"
        return None

    model = compile_model(kd.DistributedModel(*layers(), strategy="parameter_server"))

    def generator():
        for i in range(10):
            yield x[i * 10 : (i + 1) * 10], y[i * 10 : (i + 1) * 10]

    python_data = tf.data.Dataset.from_generator(
        generator,
        output_signature=(tf.TensorSpec([None, 64], tf.float32), tf.TensorSpec([None], tf.int32)),
    )
    report["generator"] = error_of(lambda: model.fit(python_data, epochs=1, verbose=0))
    endless = tf.data.Dataset.from_tensor_slices((x, y)).batch(32).repeat()
    report["endless"] = error_of(lambda: model.fit(endless, epochs=1, verbose=0))
    report["class_weight"] = error_of(
        lambda: model.fit(x, y, epochs=1, verbose=0, class_weight={0: 2.0})
    )
    report["muon"] = error_of(
        lambda: model.compile(
            optimizer=keras.optimizers.Muon(0.01), loss="sparse_categorical_crossentropy"
        )
    )

    def muon_without_decay():
        model.compile(
            optimizer=keras.optimizers.Muon(0.01, weight_decay=None, adam_weight_decay=None),
            loss="sparse_categorical_crossentropy",
        )
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)

    report["muon_without_decay"] = error_of(muon_without_decay)

    def jit_compile():  # XLA cannot read the ps's variables: runs without, says so
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", jit_compile=True)
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)
        model.evaluate(x, y, batch_size=32, verbose=0)
        model.predict(x[:40], batch_size=32, verbose=0)
        return [str(w.message) for w in caught if "jit_compile" in str(w.message)]

    def inputs_and_outputs_as_list_and_dict():  # each leaf an array of its own
        a, b = keras.Input((64,), name="a"), keras.Input((4,), name="b")
        h = keras.layers.Dense(8, activation="relu")(keras.layers.Concatenate()([a, b]))
        two = kd.DistributedModel(
            [a, b],
            {"c": keras.layers.Dense(10, name="c")(h), "r": keras.layers.Dense(1, name="r")(h)},
            strategy="parameter_server",
        )
        two.compile(
            optimizer="sgd",
            loss={"c": keras.losses.SparseCategoricalCrossentropy(from_logits=True), "r": "mse"},
        )
        inputs, targets = [x, x[:, :4]], {"c": y, "r": x[:, :1]}
        two.fit(inputs, targets, batch_size=32, epochs=1, verbose=0)
        two.evaluate(inputs, targets, batch_size=32, verbose=0)

    report["list_and_dict"] = error_of(inputs_and_outputs_as_list_and_dict)

    jit_warnings = []
    report["jit_compile"] = error_of(lambda: jit_warnings.extend(jit_compile()))
    report["jit_compile_warnings"] = jit_warnings


def mode_remat(report, out):
    """The same model with and without `keras.RematScope(mode="full")`:
    the forward passes traced for the workers' step (remat recomputes one
    in the backward pass) and the losses."""

    def counted_layers():
        inputs = keras.Input((64,))
        return inputs, keras.layers.Dense(10)(CountedDense(64, activation="relu")(inputs))

    for name, scope in (
        ("plain", contextlib.nullcontext()),
        ("remat", keras.RematScope(mode="full")),
    ):
        with scope:
            model = compile_model(
                kd.DistributedModel(*counted_layers(), strategy="parameter_server")
            )
        CountedDense.calls = 0
        history = model.fit(x, y, batch_size=50, epochs=2, verbose=0)
        report[name] = {
            "loss": history.history["loss"],
            "iterations": steps_of(model),
            "forward_passes": CountedDense.calls,
        }


MODES = {
    "digits": mode_digits,
    "inputs": mode_inputs,
    "warmup": mode_warmup,
    "long": mode_long,
    "sharded": mode_sharded,
    "callbacks": mode_callbacks,
    "resume": mode_resume,
    "errors": mode_errors,
    "remat": mode_remat,
}

for mode in sys.argv[1].split(","):
    # Each mode's report (and side files: its path + ".ready", ...) by its name.
    path = os.path.join(DIRECTORY, f"{mode}.json")
    report = {}
    MODES[mode](report, path)
    with open(path, "w") as f:
        json.dump(report, f, default=str)

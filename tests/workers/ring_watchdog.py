"""A worker of the collective-timeout tests: `ring_watchdog.py MODE OUT [IMPL]`.

Strategy `multi_worker` with implementation IMPL (default "ring": TensorFlow's
gRPC ring, the path between hosts; "auto": gradients through shared memory,
predict's gathers on TensorFlow's collectives).

Modes:
    threads  fits 1 epoch, counts this process's threads, fits 1 epoch of
             200 steps more with the default collective_timeout (300 s),
             counts again, predicts 200 batches, counts, evaluates 200
             batches, counts; writes {"before", "after", "steps",
             "after_predict", "after_evaluate"} to OUT.rankR.json
    stuck    collective_timeout=5; rank 1 sleeps 120 s in a callback at the
             4th batch; rank 0 writes the error `fit` raised to OUT.rank0.json
    stuck_predict  the same in `predict` (whose gathers are watched on
             every path), the error `predict` raised
"""

import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras_distrib as kd  # noqa: E402  (first: connects this worker to its cluster)

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras_distrib.strategies import multi_worker  # noqa: E402

MODE, OUT = sys.argv[1], sys.argv[2]
IMPLEMENTATION = sys.argv[3] if len(sys.argv) > 3 else "ring"


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


timeout = 5.0 if MODE.startswith("stuck") else multi_worker.DEFAULT_COLLECTIVE_TIMEOUT
strategy = kd.strategies.get(
    "multi_worker", implementation=IMPLEMENTATION, collective_timeout=timeout
)
rank = strategy.cluster.rank
inputs = keras.Input((8,))
outputs = keras.layers.Dense(3)(keras.layers.Dense(16, activation="relu")(inputs))
model = kd.DistributedModel(inputs, outputs, strategy=strategy)
model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
rng = np.random.default_rng(0)
x = rng.normal(size=(640, 8)).astype("float32")
y = rng.integers(0, 3, 640).astype("int32")
report = {}

if MODE == "threads":
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    report["before"] = threads()
    # One epoch of 200 steps (each epoch's own few collectives, outside the
    # steps, keep TensorFlow's timeout: a thread each, once per epoch).
    model.fit(np.tile(x, (10, 1)), np.tile(y, 10), batch_size=32, epochs=1, verbose=0)
    report["after"] = threads()
    report["steps"] = int(model.optimizer.iterations.numpy())
    model.predict(np.tile(x, (10, 1)), batch_size=32, verbose=0)  # 200 steps
    report["after_predict"] = threads()
    model.evaluate(np.tile(x, (10, 1)), np.tile(y, 10), batch_size=32, verbose=0)
    report["after_evaluate"] = threads()


class SleepOnRankOne(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if rank == 1 and batch == 3:
            time.sleep(120)

    on_predict_batch_begin = on_train_batch_begin


if MODE.startswith("stuck"):
    try:
        if MODE == "stuck":
            model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[SleepOnRankOne()])
        else:
            model.predict(x, batch_size=32, verbose=0, callbacks=[SleepOnRankOne()])
    except Exception as error:  # what the user sees
        report["error"] = f"{type(error).__name__}: {error}"
        with open(f"{OUT}.rank{rank}.json", "w") as f:
            json.dump(report, f)
        raise

with open(f"{OUT}.rank{rank}.json", "w") as f:
    json.dump(report, f)

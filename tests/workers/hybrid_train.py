"""A worker of the hybrid data x model parallelism tests (via `keras-distrib launch`).

Splits the CPU into 2 logical devices, then trains the test MLP under
`tensor_parallel` and `pipeline` (both schedules) in turn: each worker holds
a model split over its 2 devices. Rank r builds its model from seed 7 + r,
so only the broadcast from worker 0 makes the replicas start equal. Writes
to --out, per strategy: whole weights, history, evaluate and predict
results, iterations, and the devices the variables are on.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tensorflow as tf  # noqa: E402

# Before `import keras_distrib`, which starts the collective runtime (and
# with it TensorFlow's devices) under the launcher.
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2
)

import keras  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

import keras_distrib as kd  # noqa: E402
from helpers import build, make_data  # noqa: E402
from keras_distrib.optimizers import DistributedOptimizer  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "Directory for results.")
flags.DEFINE_integer("batch", 32, "Global batch size.")
flags.DEFINE_integer("epochs", 2, "Epochs.")
flags.DEFINE_string("implementation", "auto", "Collectives across workers.")
flags.DEFINE_list(
    "runs",
    ["tensor_parallel", "gpipe", "1f1b", "tensor_parallel_spe3", "1f1b_ours"],
    "What to train, in turn.",
)

# A global batch the pipeline runs' 4 micro-batches x 2 workers cannot share evenly.
UNEVEN_BATCH = 36

# run -> (strategy, its options, compile options)
RUNS = {
    "tensor_parallel": ("tensor_parallel", {}, {}),
    "gpipe": ("pipeline", {"num_micro_batches": 4, "schedule": "gpipe"}, {}),
    "1f1b": ("pipeline", {"num_micro_batches": 4, "schedule": "1f1b"}, {}),
    "tensor_parallel_spe3": ("tensor_parallel", {}, {"steps_per_execution": 3}),
    # DistributedOptimizer and our callbacks (see `callbacks`).
    "1f1b_ours": ("pipeline", {"num_micro_batches": 4, "schedule": "1f1b"}, "ours"),
}


def callbacks(run, strategy):
    """Keras's checkpoint on every run; ours where the run asks for them."""
    found = [
        keras.callbacks.ModelCheckpoint(
            os.path.join(FLAGS.out, f"{run}.weights.h5"), save_weights_only=True
        )
    ]
    if run.endswith("_ours"):
        found += [
            kd.callbacks.BackupAndRestore(
                os.path.join(FLAGS.out, f"{run}-backup"), save_freq=5, delete_checkpoint=False
            ),
            kd.callbacks.ReplicaConsistencyCheck(),
            kd.callbacks.ThroughputMonitor(FLAGS.batch),
        ]
    return found


def train(run, x, y):
    name, options, compile_options = RUNS[run]
    strategy = kd.strategies.get(name, workers={"implementation": FLAGS.implementation}, **options)
    if compile_options == "ours":
        compile_options = {"optimizer": DistributedOptimizer(keras.optimizers.SGD(0.1))}
    model = build("functional", strategy, seed=7 + strategy.rank, **compile_options)
    history = model.fit(
        x,
        y,
        batch_size=FLAGS.batch,
        epochs=FLAGS.epochs,
        shuffle=False,
        verbose=0,
        callbacks=callbacks(run, strategy),
    )
    whole = model.get_weights()  # whole values, also from the split model
    devices = sorted(
        {tf.DeviceSpec.from_string(v.value.device).device_index for v in model.trainable_variables}
    )
    result = {
        "rank": strategy.rank,
        "world_size": strategy.world_size,
        "num_replicas": strategy.num_replicas,
        "implementation": strategy.implementation,
        "devices": devices,
        "history": history.history,
        "evaluate": model.evaluate(x, y, batch_size=FLAGS.batch, verbose=0),
        "iterations": int(model.optimizer.iterations.numpy()),
    }
    prefix = os.path.join(FLAGS.out, f"{run}-rank{strategy.rank}")
    np.savez(prefix + ".npz", *whole, predict=model.predict(x, batch_size=FLAGS.batch, verbose=0))
    if name == "pipeline" and run != "1f1b_ours":
        # 36 rows a step: 18 per worker, micro-batches of 5, 5, 4 and 4.
        uneven = build("functional", strategy, seed=7 + strategy.rank)
        uneven.fit(x, y, batch_size=UNEVEN_BATCH, epochs=1, shuffle=False, verbose=0)
        np.savez(prefix + "-uneven.npz", *uneven.get_weights())
    with open(prefix + ".json", "w") as f:
        json.dump(result, f)


def main(argv):
    del argv
    x, y = make_data()
    for run in FLAGS.runs:
        train(run, x, y)


if __name__ == "__main__":
    flags.mark_flag_as_required("out")
    app.run(main)

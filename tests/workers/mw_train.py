"""A worker of the multi-worker tests (run through `keras-distrib launch`).

Trains the test MLP on fixed data with SGD and writes what the test checks
to --out: final weights, history, evaluate/predict results, and the sample
ids each worker's input pipeline produced per epoch for every input kind.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

import keras_distrib as kd  # noqa: E402
from keras_distrib import cluster  # noqa: E402
from keras_distrib.input import sharding  # noqa: E402
from helpers import Batches, build, make_data  # noqa: E402
from step_graph import matmuls_before_each_all_reduce, matmuls_in_step  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "Directory for results.")
flags.DEFINE_string("strategy", "multi_worker", "Strategy name.")
flags.DEFINE_integer("batch", 32, "Global batch size.")
flags.DEFINE_integer("epochs", 2, "Epochs.")
flags.DEFINE_integer("bytes_per_pack", 0, "Gradient pack size.")
flags.DEFINE_string("implementation", "auto", "multi_worker collective implementation.")
flags.DEFINE_integer(
    "without_horovod",
    -1,
    "The rank on which `import horovod` fails as where it is not installed (-1: none).",
)


def seen_ids(strategy, x_ids, files_dir, batch):
    """Ids each input kind yields on this worker, per epoch (2 epochs)."""
    ids = x_ids.astype("float32")[:, None]
    kinds = {
        "arrays_shuffled": lambda: sharding.shard(
            strategy, ids, ids[:, 0], None, batch, True, strategy.agree_on_seed()
        )[0],
        "tf_data": lambda: sharding.shard(
            strategy, tf.data.Dataset.from_tensor_slices(ids).batch(batch)
        )[0],
        "py_dataset": lambda: sharding.shard(
            strategy,
            Batches(ids, ids[:, 0], batch),
            None,
            None,
            None,
            True,
            strategy.agree_on_seed(),
        )[0],
        "tf_files": lambda: sharding.shard(strategy, _file_dataset(files_dir, batch))[0],
    }
    seen = {}
    for kind, make in kinds.items():
        source = make()
        epochs = []
        for _ in range(2):
            got = []
            if isinstance(source, keras.utils.PyDataset):
                for i in range(len(source)):
                    got.extend(np.ravel(source[i][0]).tolist())
                source.on_epoch_end()
            else:
                for element in source:
                    first = element[0] if isinstance(element, tuple) else element
                    got.extend(np.ravel(first.numpy()).tolist())
            epochs.append([int(v) for v in got])
        seen[kind] = epochs
    return seen


def _file_dataset(files_dir, batch):
    files = sorted(os.path.join(files_dir, f) for f in os.listdir(files_dir))
    return (
        tf.data.Dataset.from_tensor_slices(files)
        .interleave(tf.data.TFRecordDataset, cycle_length=1)
        .map(lambda r: tf.reshape(tf.io.parse_tensor(r, tf.float32), [1]))
        .batch(batch)
    )


class _NoHorovod:
    """A finder that makes `import horovod` fail as an absent package does."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "horovod":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


def main(argv):
    del argv
    if FLAGS.without_horovod == json.loads(os.environ["TF_CONFIG"])["task"]["index"]:
        sys.meta_path.insert(0, _NoHorovod())
    strategy = (
        kd.strategies.get(
            FLAGS.strategy, bytes_per_pack=FLAGS.bytes_per_pack, implementation=FLAGS.implementation
        )
        if FLAGS.strategy == "multi_worker"
        else kd.strategies.get(FLAGS.strategy)
    )
    rank = strategy.rank
    worker_hosts = [
        cluster.parse_address(a)[0]
        for a in json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"]
    ]
    x, y = make_data()
    model = build("functional", strategy)
    files = os.path.join(FLAGS.out, "files")
    callbacks = [
        keras.callbacks.ModelCheckpoint(os.path.join(files, "ckpt-{epoch}.keras")),
        keras.callbacks.CSVLogger(os.path.join(files, "log.csv")),
        keras.callbacks.TensorBoard(os.path.join(files, "tb")),
        keras.callbacks.BackupAndRestore(os.path.join(files, "backup"), delete_checkpoint=False),
    ]
    history = model.fit(
        x,
        y,
        batch_size=FLAGS.batch,
        epochs=FLAGS.epochs,
        shuffle=False,
        callbacks=callbacks,
        verbose=2,
    )
    result = {
        "rank": rank,
        "world_size": strategy.world_size,
        "implementation": getattr(strategy, "implementation", None),
        "describe": str(strategy.describe(model)),
        # The workers' hosts that are this machine's (on a multi-host test
        # bed, this worker's own address alone).
        "local_hosts": [h for h in worker_hosts if cluster.is_local_host(h)],
        "history": history.history,
        "evaluate": model.evaluate(x, y, batch_size=FLAGS.batch, verbose=0),
        "iterations": int(model.optimizer.iterations.numpy()),
        "matmuls_before_each_all_reduce": matmuls_before_each_all_reduce(model),
        "matmuls_in_step": matmuls_in_step(model),
    }
    np.savez(
        os.path.join(FLAGS.out, f"rank{rank}.npz"),
        *model.get_weights(),
        predict=model.predict(x, batch_size=FLAGS.batch, verbose=0),
    )
    if strategy.world_size > 1:
        result["seen"] = seen_ids(
            strategy, np.arange(len(x)), os.path.join(FLAGS.out, "records"), FLAGS.batch
        )
    with open(os.path.join(FLAGS.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    flags.mark_flag_as_required("out")
    app.run(main)

"""A rank of the Horovod tests (run under `horovodrun --gloo` or `keras-distrib
launch --backend horovod`).

Builds the test MLP from a seed, trains it with SGD on fixed data, and writes
what the test checks to --out: initial and final weights, history,
evaluate/predict results, and the sample ids this rank's input pipeline
produced.

Modes:
  default    strategy "horovod"; with --seed_per_rank every rank starts from
             different random weights (the broadcast must make them equal);
             with --rank0_extra_model rank 0's Keras names differ from the
             others' (the collectives must still pair up).
  --control  afterwards, the same without a strategy: plain "single" on
             this rank's shard of the data, every rank from the same initial
             weights (they must diverge); written as control_* arrays.
"""

import json
import os
import socket
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

import keras_distrib as kd  # noqa: E402
from keras_distrib.input import sharding  # noqa: E402
from helpers import build, make_data  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "Directory for results.")
flags.DEFINE_integer("samples", 203, "Samples.", short_name="n")
flags.DEFINE_integer("batch", 32, "Global batch size.")
flags.DEFINE_integer("epochs", 2, "Epochs.")
flags.DEFINE_integer("seed", 100, "Seed of the initial weights (of rank 0).")
flags.DEFINE_bool("seed_per_rank", False, "Rank r builds its weights from seed + r.")
flags.DEFINE_bool("control", False, "Then also train plain 'single' on this rank's shard.")
flags.DEFINE_integer("validation", 0, "Validate on the first N samples during fit.")
flags.DEFINE_bool(
    "rank0_extra_model",
    False,
    "Rank 0 makes a model of its own first, so Keras numbers its layer and "
    "model names differently from the other ranks'.",
)


def collectives(strategy):
    """The strategy's collectives on known per-rank values, as JSON."""
    r = strategy.rank
    dtypes = ["float32", "float16", "bfloat16", "int32", "float64", "int64"]

    def mixed():
        return [tf.fill([3], tf.cast(r + 1, d)) for d in dtypes]

    @tf.function
    def in_graph():
        return (
            strategy.all_reduce(mixed(), "sum"),
            strategy.all_reduce({"m": tf.constant([2.0 * r, 4.0])}, "mean"),
            strategy.concat(tf.fill([r + 1, 2], float(r))),
            strategy.concat(tf.constant(float(r))),
        )

    def listed(values):
        return [[str(v.dtype.name), np.asarray(tf.cast(v, "float64")).tolist()] for v in values]

    graph_sum, graph_mean, rows, scalars = in_graph()
    variables = [
        keras.Variable(np.full([2], 10.0 * (r + 1), "float32")),
        tf.Variable(np.int64(r + 7)),
        tf.Variable(r == 0),
    ]
    strategy.broadcast_variables(variables, root=0)
    return {
        "eager_sum": listed(strategy.all_reduce(mixed(), "sum")),
        "graph_sum": listed(graph_sum),
        "graph_mean": np.asarray(graph_mean["m"]).tolist(),
        "concat_rows": np.asarray(rows).tolist(),
        "concat_scalars": np.asarray(scalars).tolist(),
        "sync_sum": [
            np.asarray(v).tolist() for v in strategy.sync_sum([np.float32(r + 1), np.arange(3) * r])
        ],
        "sync_gather": strategy.sync_gather(np.array([r, 10 * r])).tolist(),
        "seed": strategy.agree_on_seed(1234 if r == 0 else 999),
        "broadcast": [np.asarray(v).tolist() for v in variables],
    }


def main(argv):
    del argv
    hvd_strategy = kd.strategies.get("horovod")
    rank = hvd_strategy.rank
    x, y = make_data(FLAGS.samples)
    seed = FLAGS.seed + (rank if FLAGS.seed_per_rank else 0)
    broadcasts = []
    if FLAGS.rank0_extra_model and rank == 0:
        inputs = keras.Input((3,))
        kd.DistributedModel(inputs, keras.layers.Dense(1)(inputs), strategy="single")
    broadcast = hvd_strategy.broadcast_variables
    hvd_strategy.broadcast_variables = lambda v, root=0: (
        broadcasts.append(len(v)),
        broadcast(v, root),
    )
    model = build("functional", hvd_strategy, seed=seed)
    initial = model.get_weights()
    validation = None
    if FLAGS.validation:
        validation = (x[: FLAGS.validation], y[: FLAGS.validation])
    history = model.fit(
        x,
        y,
        batch_size=FLAGS.batch,
        epochs=FLAGS.epochs,
        shuffle=False,
        validation_data=validation,
        verbose=2,
    )
    result = {
        "rank": rank,
        "hostname": socket.gethostname(),  # on the multi-host test bed, the host's address
        "world_size": hvd_strategy.world_size,
        "num_replicas": hvd_strategy.num_replicas,
        "history": history.history,
        "iterations": int(model.optimizer.iterations.numpy()),
        "names": [model.name] + [w.path for w in model.weights],
    }
    arrays = {f"initial_{i}": w for i, w in enumerate(initial)}
    arrays.update({f"final_{i}": w for i, w in enumerate(model.get_weights())})
    result["evaluate"] = model.evaluate(x, y, batch_size=FLAGS.batch, verbose=0)
    arrays["predict"] = model.predict(x, batch_size=FLAGS.batch, verbose=0)
    ids = np.arange(len(x), dtype="float32")[:, None]
    seen, _ = sharding.shard(hvd_strategy, ids, ids[:, 0], None, FLAGS.batch)
    result["seen"] = [int(v) for batch in seen for v in np.ravel(batch[0].numpy())]
    result["broadcasts"] = list(broadcasts)
    result["num_variables"] = [len(model.variables), len(model.optimizer.variables)]
    result["collectives"] = collectives(hvd_strategy)
    if FLAGS.control:
        control = build("functional", "single", seed=FLAGS.seed)
        arrays.update({f"control_initial_{i}": w for i, w in enumerate(control.get_weights())})
        shard, _ = sharding.shard(hvd_strategy, x, y, None, FLAGS.batch)
        control.fit(shard, epochs=FLAGS.epochs, shuffle=False, verbose=0)
        arrays.update({f"control_final_{i}": w for i, w in enumerate(control.get_weights())})
        result["control_iterations"] = int(control.optimizer.iterations.numpy())
    np.savez(os.path.join(FLAGS.out, f"rank{rank}.npz"), **arrays)
    with open(os.path.join(FLAGS.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    flags.mark_flag_as_required("out")
    app.run(main)

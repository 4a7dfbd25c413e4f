"""A worker of the overlap test (run through `keras-distrib launch`).

Sets TensorFlow's intra-op threads (`--intra_op_threads`) before the
runtime starts, then trains a small MLP whose last layer holds 1 MiB of
gradients on `multi_worker` over the TCP ring with the default
`bytes_per_pack`, and writes to --out: the strategy's packing, the
compiled step's all-reduces (how many matrix products each waits for),
the initial and final weights.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

from overlap_model import BATCH, build, data  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "Directory for results.")
flags.DEFINE_integer("intra_op_threads", 0, "TensorFlow's intra-op threads (0: its default).")


def main(argv):
    del argv
    if FLAGS.intra_op_threads:
        tf.config.threading.set_intra_op_parallelism_threads(FLAGS.intra_op_threads)
    import keras

    import keras_distrib as kd
    from step_graph import matmuls_before_each_all_reduce

    strategy = kd.strategies.get("multi_worker", implementation="tcp")
    model = kd.DistributedModel.from_model(build(), strategy=strategy)
    initial = model.get_weights()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x, y = data()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    result = {
        "packing": str(strategy.packing),
        "bytes_per_pack": strategy.packing.bytes_per_pack,
        "describe": str(strategy.describe(model)),
        "matmuls_before_each_all_reduce": matmuls_before_each_all_reduce(model),
    }
    rank = strategy.rank
    np.savez(os.path.join(FLAGS.out, f"rank{rank}.npz"), *initial, *model.get_weights())
    with open(os.path.join(FLAGS.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    flags.mark_flag_as_required("out")
    app.run(main)

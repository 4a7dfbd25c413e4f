"""A worker of the DistributedOptimizer multi-process tests.

Under the strategy given by --strategy (default multi_worker), trains:
  accumulate: 4 steps of global batch 16 with backward_passes_per_step=4
  fp16/bf16: one epoch of batch 64 with compressed all-reduce
and writes each run's final weights and collective dtypes to --out.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

import keras_distrib as kd  # noqa: E402
from keras_distrib.optimizers import DistributedOptimizer  # noqa: E402
from helpers import build, collective_dtypes, make_data  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "Directory for results.")
flags.DEFINE_string("strategy", "multi_worker", "Strategy name.")

RUNS = {
    "accumulate": dict(
        batch=16,
        optimizer=lambda: DistributedOptimizer(
            keras.optimizers.SGD(0.1), backward_passes_per_step=4
        ),
    ),
    "fp16": dict(
        batch=64,
        optimizer=lambda: DistributedOptimizer(keras.optimizers.SGD(0.1), compression="fp16"),
    ),
    "bf16": dict(
        batch=64,
        optimizer=lambda: DistributedOptimizer(keras.optimizers.SGD(0.1), compression="bf16"),
    ),
}


def main(argv):
    del argv
    strategy = kd.strategies.get(FLAGS.strategy)
    x, y = make_data(192)
    results, arrays = {}, {}
    for name, run in RUNS.items():
        model = build("functional", strategy, optimizer=run["optimizer"]())
        model.fit(x, y, batch_size=run["batch"], epochs=1, shuffle=False, verbose=0)
        results[name] = {
            "iterations": int(model.optimizer.iterations.numpy()),
            "dtypes": collective_dtypes(model, x[:64], y[:64]),
        }
        for i, w in enumerate(model.get_weights()):
            arrays[f"{name}_{i}"] = w
    np.savez(os.path.join(FLAGS.out, f"opt{strategy.rank}.npz"), **arrays)
    with open(os.path.join(FLAGS.out, f"opt{strategy.rank}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    flags.mark_flag_as_required("out")
    app.run(main)

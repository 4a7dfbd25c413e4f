"""A user's first script, run by `keras-distrib launch` or `horovodrun`.

Imports Keras first, then keras_distrib, creates TensorFlow objects before
any model, then builds each usage form (functional, subclass, from_model)
with the strategy given *as a string* (`--names`), trains it with SGD and
saves its final weights to `--out/<name>-<form>-rank<r>.npz`.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402, F401  (Keras before keras_distrib, as users write it)
import keras_distrib as kd  # noqa: E402, F401  (before any TensorFlow object, as users do)
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "Directory for results.")
flags.DEFINE_list("names", ["multi_worker", "auto"], "Strategy names to train with.")
flags.DEFINE_list("forms", ["functional", "subclass", "from_model"], "Usage forms.")
flags.DEFINE_integer("batch", 32, "Global batch size.")
flags.DEFINE_integer("epochs", 2, "Epochs.")
flags.DEFINE_integer("steps_per_execution", 1, "Steps per execution (compile).")


def main(argv):
    del argv
    # TensorFlow objects that exist before any model or strategy.
    before = tf.Variable(tf.ones([3])) * 2.0
    dataset_before = tf.data.Dataset.range(4).map(lambda i: i * 2)
    from helpers import build, make_data  # noqa: E402  (defines a DistributedModel subclass)

    x, y = make_data()
    results = {}
    for name in FLAGS.names:
        for form in FLAGS.forms:
            model = build(form, name, steps_per_execution=FLAGS.steps_per_execution)
            model.fit(x, y, batch_size=FLAGS.batch, epochs=FLAGS.epochs, shuffle=False, verbose=0)
            strategy = model.strategy
            np.savez(
                os.path.join(FLAGS.out, f"{name}-{form}-rank{strategy.rank}.npz"),
                *model.get_weights(),
            )
            results[f"{name}-{form}"] = {
                "strategy": strategy.name,
                "rank": strategy.rank,
                "world_size": strategy.world_size,
                "iterations": int(model.optimizer.iterations.numpy()),
                "evaluate": model.evaluate(x, y, batch_size=FLAGS.batch, verbose=0),
            }
    results["before"] = [float(before.numpy().sum()), int(sum(dataset_before))]
    with open(os.path.join(FLAGS.out, f"summary-rank{strategy.rank}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    flags.mark_flag_as_required("out")
    app.run(main)

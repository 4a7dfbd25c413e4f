"""Train a digit classifier with DistributedModel and print accuracy/throughput.

The data set is the UCI 8x8 handwritten digits (1797 images, in
examples/data: nothing is downloaded). The config file picks the strategy;
with no GPU, `"logical_cpus": 2` splits the CPU into two logical devices so
`"mirrored"` trains two real replicas.

Run, one per strategy family (model parallel: examples/train_split_model.py):
  python examples/train_digits.py --config configs/digits.json [--strategy single]
  keras-distrib launch -n 2 examples/train_digits.py --config configs/digits_2workers.json
  keras-distrib launch --workers 2 --ps 1 examples/train_digits.py --config configs/digits_ps.json
  keras-distrib launch --backend horovod -n 2 examples/train_digits.py \
      --config configs/digits_horovod.json
"""

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# First: on the chief of a parameter-server cluster the import connects to
# the cluster, which must happen before TensorFlow makes any tensor.
import keras_distrib as kd  # noqa: E402

import keras  # noqa: E402
from absl import app, flags, logging  # noqa: E402
from _digits import EpochTimer, load_digits, split_devices  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("config", "configs/digits.json", "JSON training config.")
flags.DEFINE_string("strategy", None, "Override the config's strategy name.")
flags.DEFINE_integer("epochs", None, "Override the config's epoch count.")


def load_config(path):
    with open(path) as f:
        config = json.load(f)
    if FLAGS.strategy:
        config["strategy"] = FLAGS.strategy
    if FLAGS.epochs:
        config["epochs"] = FLAGS.epochs
    return config


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # TF's INFO lines would drown the output
    config = load_config(FLAGS.config)
    split_devices(config.get("logical_cpus", 0))
    # Strategies that start TensorFlow's distributed runtime must exist
    # before any layer or tensor does: make it first.
    strategy = kd.strategies.get(config["strategy"])
    keras.utils.set_random_seed(config["seed"])
    (x, y), (x_val, y_val) = load_digits(config["validation_fraction"], config["seed"])

    inputs = keras.Input((64,), name="pixels")
    h = keras.layers.Dense(config["hidden_units"], activation="relu")(inputs)
    outputs = keras.layers.Dense(10, activation="softmax")(h)
    model = kd.DistributedModel(inputs, outputs, strategy=strategy)
    model.compile(
        optimizer=keras.optimizers.SGD(config["learning_rate"], momentum=0.9),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    say = print if model.strategy.is_chief else (lambda *a: None)
    asynchronous = model.strategy.capabilities.asynchronous
    # Asynchronous: the chief is one process; num_workers counts the worker tasks.
    workers = model.strategy.num_workers if asynchronous else model.strategy.world_size
    say(
        f"strategy={model.strategy.name} replicas={model.strategy.num_replicas} "
        f"workers={workers} devices={list(model.strategy.devices)} "
        f"train={len(x)} val={len(x_val)}"
    )
    timer = EpochTimer()
    model.fit(
        x,
        y,
        batch_size=config["batch_size"],
        epochs=config["epochs"],
        validation_data=(x_val, y_val),
        callbacks=[timer],
        verbose=2,  # non-chief workers print nothing (keras_distrib.training.chief_only)
    )
    loss, accuracy = model.evaluate(x_val, y_val, batch_size=config["batch_size"], verbose=0)
    # The first epoch includes tracing; report the steady state.
    steady = timer.seconds[1:] or timer.seconds
    samples_per_second = len(x) / (sum(steady) / len(steady))
    if asynchronous:
        say(f"steps applied (asynchronous): {model.strategy.steps_applied}")
    say(f"validation accuracy: {accuracy:.4f}  loss: {loss:.4f}")
    say(
        f"throughput: {samples_per_second:,.0f} samples/s in total "
        f"(mean of {len(steady)} epochs after the first)"
    )


if __name__ == "__main__":
    app.run(main)

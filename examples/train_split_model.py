"""Train a model too large for one device's memory budget, split over two.

The model is a wide MLP on the UCI 8x8 digits in examples/data (nothing is
downloaded). Its weights plus Adam's state (two slots per weight, so 3x the
weights) exceed `device_budget_mb` (1 MB = 10^6 bytes), the memory one
device may use for them, so it must be split: the script trains it with
`"pipeline"` (stages of whole layers, one per device) and with
`"tensor_parallel"` (every Dense kernel split over the devices), in turn.

For each strategy it builds the optimizer state, reads the bytes of weights
and optimizer state on each device from where the variables actually are
(the strategy's `describe(model)`), and stops with a one-line error if any
device exceeds the budget; then it trains and prints validation accuracy
and throughput. Activations and gradients are transient and not counted.
With no GPU, `"logical_cpus": 2` splits the CPU into two logical devices.

Its data-parallel sibling, configs/sharded_optimizer.json, keeps the model
whole on each of two workers and shards Adam's state over them
(`multi_worker` with `optimizer_sharding="optimizer"`): each worker holds
the weights and half of the optimizer state, within the same budget.

Run:
  python examples/train_split_model.py                       # both strategies
  python examples/train_split_model.py --strategy pipeline --epochs 2
  python examples/train_split_model.py --device_budget_mb 5  # fails: a device needs more
  keras-distrib launch -n 2 examples/train_split_model.py --config configs/sharded_optimizer.json
"""

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras_distrib as kd  # noqa: E402

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags, logging  # noqa: E402
from _digits import EpochTimer, load_digits, split_devices  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("config", "configs/split_model.json", "JSON training config.")
flags.DEFINE_enum(
    "strategy",
    None,
    ["pipeline", "tensor_parallel", "multi_worker"],
    "Train only this strategy (default: every one the config lists).",
)
flags.DEFINE_integer("epochs", None, "Override the config's epoch count.")
flags.DEFINE_float("device_budget_mb", None, "Override the config's per-device budget (MB).")

MB = 1e6
ADAM_SLOTS = 2  # Adam keeps a first and a second moment per weight


def load_config(path):
    with open(path) as f:
        config = json.load(f)
    if FLAGS.strategy:
        config["strategies"] = {FLAGS.strategy: config["strategies"].get(FLAGS.strategy, {})}
    for name in ("epochs", "device_budget_mb"):
        if FLAGS[name].value is not None:
            config[name] = FLAGS[name].value
    return config


def build_layers(config):
    """The model's graph (inputs, outputs). Its layers are built whole, in
    host memory (on GPUs, device 0 could not hold them), and DistributedModel
    then rebuilds them over the strategy's devices."""
    with tf.device("/device:CPU:0"):
        inputs = keras.Input((64,), name="pixels")
        h = inputs
        for i in range(config["hidden_layers"]):
            h = keras.layers.Dense(config["hidden_units"], activation="relu", name=f"hidden_{i}")(h)
        outputs = keras.layers.Dense(10, activation="softmax", name="digit")(h)
    return inputs, outputs


def short(device):
    spec = tf.DeviceSpec.from_string(device)
    return f"{spec.device_type}:{spec.device_index}"


def bytes_per_device(strategy, model):
    """{device: (weight bytes, optimizer bytes)}, from the variables' placement."""
    plan = strategy.describe(model)
    print(plan)
    if isinstance(plan, kd.strategies.ReplicaMemory):
        # Data parallel: this worker's device holds a whole copy of the
        # weights and its part of a sharded optimizer's state.
        return {f"worker{strategy.rank}": (plan.weights, plan.optimizer)}
    weights = {short(d): n for d, n in plan.bytes_per_device.items()}
    slots = {short(d): n for d, n in plan.optimizer_bytes_per_device.items()}
    # The strategy's devices first, then any other device found holding a variable.
    devices = dict.fromkeys([short(d) for d in strategy.devices] + [*weights, *slots])
    return {d: (weights.get(d, 0), slots.get(d, 0)) for d in devices}


def check_budget(name, usage, budget):
    print(
        f"{'device':<8} {'weights MB':>11} {'optimizer MB':>13} {'total MB':>9} {'budget MB':>10}"
    )
    for device, (weights, slots) in usage.items():
        print(
            f"{device:<8} {weights / MB:>11.1f} {slots / MB:>13.1f} "
            f"{(weights + slots) / MB:>9.1f} {budget / MB:>10.1f}"
        )
    for device, (weights, slots) in usage.items():
        if weights + slots > budget:
            raise SystemExit(
                f"error: {name}: device {device} holds {(weights + slots) / MB:.1f} MB "
                f"(weights {weights / MB:.1f} + optimizer {slots / MB:.1f}) > budget "
                f"{budget / MB:.1f} MB; raise device_budget_mb or shrink the model"
            )
    return max(w + s for w, s in usage.values())


def train(name, options, config, data):
    (x, y), (x_val, y_val) = data
    budget = config["device_budget_mb"] * MB
    keras.utils.set_random_seed(config["seed"])
    strategy = kd.strategies.get(name, **options)
    model = kd.DistributedModel(*build_layers(config), strategy=strategy)
    model.compile(
        optimizer=keras.optimizers.Adam(config["learning_rate"]),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    model.optimizer.build(model.trainable_variables)  # Adam's slots, next to their weights
    print(
        f"\n== {name}: {model.count_params():,} parameters over "
        f"{[short(d) for d in strategy.devices]} =="
    )
    largest = check_budget(name, bytes_per_device(strategy, model), budget)

    timer = EpochTimer()
    model.fit(
        x,
        y,
        batch_size=config["batch_size"],
        epochs=config["epochs"],
        validation_data=(x_val, y_val),
        callbacks=[timer],
        verbose=2,
    )
    loss, accuracy = model.evaluate(x_val, y_val, batch_size=config["batch_size"], verbose=0)
    steady = timer.seconds[1:] or timer.seconds  # the first epoch includes tracing
    samples_per_second = len(x) / (sum(steady) / len(steady))
    timed = (
        f"mean of {len(steady)} epochs after the first"
        if len(timer.seconds) > 1
        else "one epoch, tracing included"
    )
    print(f"validation accuracy: {accuracy:.4f}  loss: {loss:.4f}")
    print(f"throughput: {samples_per_second:,.0f} samples/s ({timed})")
    print(
        f"result: {name}: at most {largest / MB:.1f} MB per device <= budget "
        f"{budget / MB:.1f} MB, validation accuracy {accuracy:.4f}, "
        f"{samples_per_second:,.0f} samples/s"
    )


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # TF's INFO lines would drown the output
    config = load_config(FLAGS.config)
    split_devices(config.get("logical_cpus", 0))
    data = load_digits(config["validation_fraction"], config["seed"])

    budget = config["device_budget_mb"] * MB
    params = keras.Model(*build_layers(config)).count_params()
    one_device = params * 4 * (1 + ADAM_SLOTS)  # float32 weights + Adam's slots
    if one_device <= budget:
        raise SystemExit(
            f"error: the model fits one device ({one_device / MB:.1f} MB <= budget "
            f"{budget / MB:.1f} MB): nothing to split; lower device_budget_mb or raise "
            "hidden_units"
        )
    print(
        f"{params:,} parameters: one device would need {one_device / MB:.1f} MB "
        f"(weights + Adam's {ADAM_SLOTS} slots) > budget {budget / MB:.1f} MB"
    )
    for name, options in config["strategies"].items():
        train(name, options, config, data)


if __name__ == "__main__":
    app.run(main)

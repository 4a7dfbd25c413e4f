"""The ways to fit a bigger model, on one model: bytes per device.

The model is examples/train_split_model.py's: an MLP of `--layers` x
Dense(`--units`) on 64 inputs, Adam. For each way the bytes of weights and
optimizer state on each device are read from the variables where they live
(the strategy's `describe(model)`), after the optimizer has built its slots:

  data_parallel       `single` (what every replica of `mirrored`,
                      `multi_worker` or `horovod` holds): everything whole
  tensor_parallel     every Dense kernel split over 2 logical CPUs
  pipeline            2 stages of whole layers on 2 logical CPUs
  optimizer_sharding  `multi_worker`, 2 workers, `optimizer_sharding=
                      "optimizer"`: weights whole, Adam's state halved

Activation checkpointing keeps the weights and the optimizer state as they
are and trades activations for recompute: benchmarks/remat.py measures
that (the step's peak memory).

Run:
    python benchmarks/bigger_models.py [--units 1024] [--layers 3]
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from absl import app, flags  # noqa: E402

import _harness  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_enum("config", "in_process", ["in_process", "sharded"], "Worker only.")
flags.DEFINE_integer("units", 1024, "Hidden width.")
flags.DEFINE_integer("layers", 3, "Hidden layers.")
flags.DEFINE_integer("timeout", 300, "Seconds per run.")
flags.DEFINE_string(
    "json",
    os.path.join(_harness.RESULTS_DIR, "bigger_models.json"),
    "Where the driver saves its measurements (empty: nowhere).",
)
flags.DEFINE_bool("quick", False, "A small model: tests the chain, numbers not for reading.")

WAYS = ("data_parallel", "tensor_parallel", "pipeline", "optimizer_sharding")


def _per_device(kd, strategy, model) -> dict:
    """{device: [weight bytes, optimizer bytes]} of this process."""
    model.optimizer.build(model.trainable_variables)
    plan = strategy.describe(model)
    if isinstance(plan, kd.strategies.ReplicaMemory):
        return {f"worker{strategy.rank}": [plan.weights, plan.optimizer]}
    devices = dict.fromkeys([*plan.bytes_per_device, *plan.optimizer_bytes_per_device])
    return {
        d.rsplit("device:", 1)[-1]: [
            plan.bytes_per_device.get(d, 0),
            plan.optimizer_bytes_per_device.get(d, 0),
        ]
        for d in devices
    }


def run_worker() -> None:
    _harness.worker_setup()
    import tensorflow as tf

    if FLAGS.config == "in_process":
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2
        )
    import keras

    import keras_distrib as kd

    def graph():
        inputs = keras.Input((64,))
        h = inputs
        for _ in range(FLAGS.layers):
            h = keras.layers.Dense(FLAGS.units, activation="relu")(h)
        return inputs, keras.layers.Dense(10, activation="softmax")(h)

    ways = (
        {
            "data_parallel": ("single", {}),
            "tensor_parallel": ("tensor_parallel", {}),
            "pipeline": ("pipeline", {"num_micro_batches": 4}),
        }
        if FLAGS.config == "in_process"
        else {"optimizer_sharding": ("multi_worker", {"optimizer_sharding": "optimizer"})}
    )
    result = {}
    for way, (name, options) in ways.items():
        strategy = kd.strategies.get(name, **options)
        model = kd.DistributedModel(*graph(), strategy=strategy)
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy")
        result[way] = {
            "parameters": model.count_params(),
            "per_device": _per_device(kd, strategy, model),
        }
    _harness.write_result(FLAGS.out_dir, _harness.worker_rank(), result)


def _in_process() -> dict:
    out_dir = tempfile.mkdtemp(prefix="kd-bench-")
    subprocess.run(
        [
            sys.executable,
            os.path.abspath(__file__),
            "--role=worker",
            f"--out_dir={out_dir}",
            "--config=in_process",
            f"--units={FLAGS.units}",
            f"--layers={FLAGS.layers}",
        ],
        check=True,
        timeout=FLAGS.timeout,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    return _harness.read_results(out_dir, 1)[0]


def run_driver() -> int:
    load = _harness.load_note()
    if FLAGS.quick:
        _harness.quick_defaults(units=128, layers=2)
    found = _in_process()
    out_dir, _ = _harness.launch_workers(
        os.path.abspath(__file__),
        2,
        ["--config=sharded", f"--units={FLAGS.units}", f"--layers={FLAGS.layers}"],
        timeout=FLAGS.timeout,
    )
    sharded = _harness.read_results(out_dir, 2)
    found["optimizer_sharding"] = {
        "parameters": sharded[0]["optimizer_sharding"]["parameters"],
        "per_device": {
            k: v for r in sharded for k, v in r["optimizer_sharding"]["per_device"].items()
        },
    }
    whole = max(sum(v) for v in found["data_parallel"]["per_device"].values())
    print(
        f"\nMLP {FLAGS.layers} x Dense({FLAGS.units}) on 64 inputs "
        f"({found['data_parallel']['parameters']:,} parameters), Adam: weights + optimizer "
        "state per device"
    )
    print(f"{'way':20s} {'devices':>8s} {'largest device':>15s} {'/ data parallel':>16s}")
    rows = {}
    for way in WAYS:
        per_device = found[way]["per_device"]
        largest = max(sum(v) for v in per_device.values())
        rows[way] = {
            "devices": len(per_device),
            "largest_bytes": largest,
            "over_data_parallel": largest / whole,
            "per_device": per_device,
        }
        print(
            f"{way:20s} {len(per_device):8d} {_harness.human(largest):>15s} {largest / whole:16.3f}"
        )
    print(f"load: {load}")
    _harness.save_results(
        FLAGS.json,
        "bigger_models",
        {
            "units": FLAGS.units,
            "layers": FLAGS.layers,
            "parameters": found["data_parallel"]["parameters"],
            "ways": rows,
        },
        quick=FLAGS.quick,
        load=load,
    )
    return 0


def main(argv):
    return _harness.driver_or_worker(argv, run_worker, run_driver)


if __name__ == "__main__":
    app.run(main)

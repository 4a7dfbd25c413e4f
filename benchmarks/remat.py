"""Activation checkpointing: peak memory and step time with and without it.

What it measures: one training epoch of a deep MLP (`--depth` hidden
layers of `--width`, ReLU, global batch `--batch`, SGD), whose activations
outweigh its weights, from the same initial weights in every configuration:

  none     no checkpointing
  layers   built in `keras.RematScope(mode="full")`: every layer's forward
           pass runs again in the backward pass (the inputs of each layer
           are kept, what a layer makes inside is not)
  blocks   `keras.remat` around blocks of `--block` layers (a layer of our
           own whose `call` is `keras.remat(block)(x)`): only each block's
           input is kept, its layers' outputs are made again

each under `--strategies` (`single`; `pipeline`, 2 stages on 2 logical
CPUs, 1F1B at 4 micro-batches, where checkpointing trades the activations
a stage stashes for the micro-batches in flight for recompute).

Peak memory is TensorFlow's own count (`tf.config.experimental.
get_memory_info("CPU:0")["peak"]`, which counts on CPU only with
`TF_CPU_ALLOCATOR_USE_BFC=1`, set here for the workers), reset after a
warm-up epoch and read after the timed one, minus what was allocated
before it (the weights, the optimizer, the data): the memory the
training steps themselves need. Every configuration is its own process
(peaks are per process) with one intra-op thread; the final weights are
compared with `none` of the same strategy (checkpointing changes no
result). Results: `--json` (default benchmarks/results/remat.json).

Run:
    python benchmarks/remat.py [--strategies single,pipeline] [--depth 8]
        [--width 512] [--batch 2048] [--block 4] [--repeats 2] [--quick]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from absl import app, flags  # noqa: E402

import _harness  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("config", None, "Worker only: STRATEGY/MODE.")
flags.DEFINE_string("out", None, "Worker only: where to write its result.")
flags.DEFINE_list("strategies", ["single", "pipeline"], "Strategies to measure.")
flags.DEFINE_list("modes", ["none", "layers", "blocks"], "Checkpointing modes.")
flags.DEFINE_integer("depth", 8, "Hidden layers.")
flags.DEFINE_integer("width", 512, "Input features and hidden width.")
flags.DEFINE_integer("batch", 2048, "Global batch.")
flags.DEFINE_integer("steps", 3, "Steps per epoch.")
flags.DEFINE_integer("block", 4, "Layers per `keras.remat` block (mode `blocks`).")
flags.DEFINE_integer("repeats", 2, "Alternating repetitions of every configuration.")
flags.DEFINE_float("timeout", 300.0, "Seconds one run (process) may take.")
flags.DEFINE_bool(
    "quick",
    False,
    "To test the chain: --repeats 1 --depth 4 --batch 256 "
    "--width 128 --block 2 (flags given explicitly win).",
)
flags.DEFINE_string(
    "json",
    os.path.join(_harness.RESULTS_DIR, "remat.json"),
    "Where the driver saves its measurements (empty: nowhere).",
)

STAGES = 2


# -- worker ----------------------------------------------------------------------------


def _model(kd, keras, strategy, mode):
    class Block(keras.layers.Layer):
        """`--block` Dense layers, recomputed as one in the backward pass."""

        def __init__(self, count, **kwargs):
            super().__init__(**kwargs)
            self.dense = [keras.layers.Dense(FLAGS.width, activation="relu") for _ in range(count)]

        def _forward(self, x):
            for layer in self.dense:
                x = layer(x)
            return x

        def call(self, x):
            return keras.remat(self._forward)(x)

    keras.utils.set_random_seed(0)
    inputs = keras.Input((FLAGS.width,))
    h = inputs
    if mode == "blocks":
        for start in range(0, FLAGS.depth, FLAGS.block):
            h = Block(min(FLAGS.block, FLAGS.depth - start))(h)
    else:
        for _ in range(FLAGS.depth):
            h = keras.layers.Dense(FLAGS.width, activation="relu")(h)
    outputs = keras.layers.Dense(10)(h)
    if mode == "layers":
        with keras.RematScope(mode="full"):
            return kd.DistributedModel(inputs, outputs, strategy=strategy)
    return kd.DistributedModel(inputs, outputs, strategy=strategy)


def run_worker() -> None:
    name, mode = FLAGS.config.split("/")
    _harness.worker_setup()
    import numpy as np
    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * (STAGES if name == "pipeline" else 1)
    )
    tf.config.threading.set_intra_op_parallelism_threads(1)
    import keras

    import keras_distrib as kd

    strategy = (
        kd.strategies.get("pipeline", num_micro_batches=4, schedule="1f1b")
        if name == "pipeline"
        else kd.strategies.get(name)
    )
    rng = np.random.default_rng(0)
    samples = FLAGS.steps * FLAGS.batch
    x = rng.standard_normal((samples, FLAGS.width), dtype=np.float32)
    y = rng.integers(0, 10, size=(samples,)).astype(np.int32)
    model = _model(kd, keras, strategy, mode)
    model.compile(
        optimizer=keras.optimizers.SGD(0.001),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(x, y, batch_size=FLAGS.batch, epochs=1, shuffle=False, verbose=0)  # warm-up
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    tf.config.experimental.reset_memory_stats("CPU:0")
    start = time.perf_counter()
    model.fit(x, y, batch_size=FLAGS.batch, epochs=1, shuffle=False, verbose=0)
    seconds = time.perf_counter() - start
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    weights = model.get_weights()
    np.savez(FLAGS.out + ".npz", *weights)
    with open(FLAGS.out, "w") as f:
        json.dump(
            {
                "config": FLAGS.config,
                "step_seconds": seconds / FLAGS.steps,
                "step_peak_bytes": peak - before,
                "held_bytes": before,
                "weight_bytes": int(sum(w.nbytes for w in weights)),
            },
            f,
        )


# -- driver ----------------------------------------------------------------------------


def _run(config: str, directory: str) -> dict:
    out = os.path.join(directory, config.replace("/", "-") + ".json")
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="1", TF_CPP_MIN_LOG_LEVEL="3")
    flags_ = [f"--{k}={getattr(FLAGS, k)}" for k in ("depth", "width", "batch", "steps", "block")]
    subprocess.run(
        [
            sys.executable,
            os.path.abspath(__file__),
            "--role=worker",
            f"--config={config}",
            f"--out={out}",
            *flags_,
        ],
        env=env,
        check=True,
        timeout=FLAGS.timeout,
    )
    with open(out) as f:
        result = json.load(f)
    import numpy as np

    with np.load(out + ".npz") as arrays:
        result["weights"] = [
            arrays[k] for k in sorted(arrays.files, key=lambda k: int(k.split("_")[1]))
        ]
    return result


def run_driver() -> int:
    import numpy as np

    if FLAGS.quick:
        _harness.quick_defaults(repeats=1, depth=4, batch=256, width=128, block=2)
    configs = [f"{s}/{m}" for s in FLAGS.strategies for m in FLAGS.modes]
    runs = {c: [] for c in configs}
    with tempfile.TemporaryDirectory(prefix="kd-remat-") as directory:
        for repeat in range(FLAGS.repeats):
            for config in configs[repeat % len(configs) :] + configs[: repeat % len(configs)]:
                runs[config].append(_run(config, directory))
    rows = []
    print(
        f"\n{FLAGS.depth} x Dense({FLAGS.width}), batch {FLAGS.batch}, SGD "
        f"({_harness.human(runs[configs[0]][0]['weight_bytes'])} of weights)"
    )
    print(
        f"{'strategy/mode':20s} {'step peak':>12s} {'/ none':>8s} {'step time / none':>18s} "
        f"{'max |w - none|':>15s}"
    )
    for config in configs:
        name, mode = config.split("/")
        base = runs.get(f"{name}/none")
        peak = _harness.stats([r["step_peak_bytes"] for r in runs[config]])[0]
        row = {
            "config": config,
            "step_peak_bytes": peak,
            "step_seconds": _harness.run_summary([r["step_seconds"] for r in runs[config]]),
        }
        line = f"{config:20s} {_harness.human(peak):>12s}"
        if base:
            base_peak = _harness.stats([r["step_peak_bytes"] for r in base])[0]
            times = [r["step_seconds"] / b["step_seconds"] for r, b in zip(runs[config], base)]
            gap = max(
                float(np.abs(a - b).max())
                for a, b in zip(runs[config][0]["weights"], base[0]["weights"])
            )
            row.update(peak_over_none=peak / base_peak, time_over_none=times, weight_gap=gap)
            line += f" {peak / base_peak:8.2f} {_harness.fmt_stats(times):>18s} {gap:15.2e}"
        rows.append(row)
        print(line)
    print(_harness.load_note())
    _harness.save_results(
        FLAGS.json,
        "remat",
        {
            "depth": FLAGS.depth,
            "width": FLAGS.width,
            "batch": FLAGS.batch,
            "block": FLAGS.block,
            "repeats": FLAGS.repeats,
            "results": rows,
        },
        quick=FLAGS.quick,
    )
    return 0


def main(argv):
    return _harness.driver_or_worker(argv, run_worker, run_driver)


if __name__ == "__main__":
    app.run(main)

"""Overhead of DistributedModel against plain Keras, a raw loop and raw tf.distribute.

What it measures: the wall time of `model.fit(x, y, epochs=--epochs)` on
numpy arrays (MLP 64-512-512-1, SGD, MSE, batch `--batch`, `--steps` steps
per epoch, `shuffle=False`, `verbose=0`), the whole call, so what a user
waits for, fit's own start and end included. Every variant is built,
compiled and fitted once (warm-up, tracing) first; then all run interleaved
in one process (2 logical CPUs, TensorFlow's default threads), one fit per
variant per round, `--rounds` rounds, so machine noise hits them alike.
Step time = fit time / (epochs x steps).

Variants:

  plain            `keras.Model.fit`
  kd_single        `DistributedModel(strategy="single")`
  raw_loop         the floor: a hand-written `tf.function` train step
                   (GradientTape, `optimizer.apply_gradients`, no strategy)
                   called over pre-made tensor batches, epochs x steps
                   calls; no input pipeline, no callbacks, no logs.
  raw_mirrored_N   raw Keras under `tf.distribute.MirroredStrategy` on N
                   logical CPUs (docs/design.md 1.1)
  kd_mirrored_N    `DistributedModel(strategy="mirrored")` on N logical CPUs

Printed: each variant's step time, median [min, max], and per-round ratios
(median [min, max]) with targets:

  kd single / plain fit, throughput     >= 1.0   (at least as fast)
  kd single / raw loop, step time       <= 1.15  (within 15% of
                                                  the raw loop's; = raw loop /
                                                  kd single throughput)
  kd mirrored(1) / plain, time          <= 1.10
  kd mirrored(2) / raw Mirrored(2), time <= 1.0

"target met" or "TARGET NOT MET" is judged on the median; the exit code is
0 either way unless --strict. The measurements are saved as JSON (`--json`,
default benchmarks/results/overhead.json).

Run: python benchmarks/overhead.py [--rounds 7] [--steps 32] [--epochs 3]
    [--batch 256] [--quick] [--strict] [--json benchmarks/results/overhead.json]
"""

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from absl import app, flags  # noqa: E402

import _harness  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("rounds", 7, "Interleaved timing rounds.")
flags.DEFINE_integer("steps", 32, "Optimizer steps per epoch.")
flags.DEFINE_integer("epochs", 3, "Epochs per fit (one fit per variant per round).")
flags.DEFINE_integer("batch", 256, "Global batch size.")
flags.DEFINE_integer("width", 512, "Hidden layer width of the MLP.")
flags.DEFINE_bool(
    "quick",
    False,
    "Seconds, to test the chain: --rounds 3 --steps 16 --epochs 2 (flags given explicitly win).",
)
flags.DEFINE_bool("strict", False, "Exit with code 1 when a target is not met.")
flags.DEFINE_string(
    "json",
    os.path.join(_harness.RESULTS_DIR, "overhead.json"),
    "Where to save the measurements (empty: nowhere).",
)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    watch = _harness.Stopwatch()
    load = _harness.load_note()
    if FLAGS.quick:
        _harness.quick_defaults(rounds=3, steps=16, epochs=2)
    from absl import logging

    logging.set_verbosity(logging.WARNING)  # not MirroredStrategy's INFO lines
    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras
    import numpy as np

    import keras_distrib as kd

    rng = np.random.default_rng(0)
    n = FLAGS.steps * FLAGS.batch
    x = rng.normal(size=(n, 64)).astype("float32")
    y = rng.normal(size=(n, 1)).astype("float32")
    cpus = [d.name for d in tf.config.list_logical_devices("CPU")]

    def layers(inputs):
        h = keras.layers.Dense(FLAGS.width, activation="relu")(inputs)
        h = keras.layers.Dense(FLAGS.width, activation="relu")(h)
        return keras.layers.Dense(1)(h)

    def plain():
        inputs = keras.Input((64,))
        return keras.Model(inputs, layers(inputs))

    def raw_mirrored(devices):
        def build():
            strategy = tf.distribute.MirroredStrategy(devices)
            with strategy.scope():
                model = plain()
                model.compile(optimizer="sgd", loss="mse")
            return model

        return build

    def ours(name, **options):
        def build():
            inputs = keras.Input((64,))
            strategy = kd.strategies.get(name, **options)
            return kd.DistributedModel(inputs, layers(inputs), strategy=strategy)

        return build

    def compiled(build):
        def make():
            model = build()
            if not model.compiled:
                model.compile(optimizer="sgd", loss="mse")
            return model

        return make

    class RawLoop:
        """The floor: a tf.function step over pre-made tensor batches, no strategy."""

        def __init__(self):
            self.model = plain()
            self.optimizer = keras.optimizers.SGD()  # = optimizer="sgd"
            self.loss_fn = keras.losses.MeanSquaredError()  # = loss="mse"
            self.batches = [
                (tf.constant(x[i : i + FLAGS.batch]), tf.constant(y[i : i + FLAGS.batch]))
                for i in range(0, n, FLAGS.batch)
            ]
            model, optimizer, loss_fn = self.model, self.optimizer, self.loss_fn

            @tf.function
            def step(xb, yb):
                with tf.GradientTape() as tape:
                    loss = loss_fn(yb, model(xb, training=True))
                grads = tape.gradient(loss, model.trainable_variables)
                optimizer.apply_gradients(zip(grads, model.trainable_variables))
                return loss

            self.step = step

        def fit(self, x_, y_, batch_size, epochs, verbose=0, shuffle=False):
            loss = None
            for _ in range(epochs):
                for xb, yb in self.batches:
                    loss = self.step(xb, yb)
            float(loss)  # wait for the last step

    variants = {
        "plain": compiled(plain),
        "kd_single": compiled(ours("single")),
        "raw_loop": RawLoop,
        "raw_mirrored_1": raw_mirrored(cpus[:1]),
        "kd_mirrored_1": compiled(ours("mirrored", devices=cpus[:1])),
        "raw_mirrored_2": raw_mirrored(cpus),
        "kd_mirrored_2": compiled(ours("mirrored", devices=cpus)),
    }
    models = {}
    for name, make in variants.items():
        models[name] = make()
        models[name].fit(x, y, batch_size=FLAGS.batch, epochs=1, verbose=0)

    times = {name: [] for name in variants}
    names = list(variants)
    for rnd in range(FLAGS.rounds):
        shift = rnd % len(names)  # rotate the order: no variant always first
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            models[name].fit(
                x, y, batch_size=FLAGS.batch, epochs=FLAGS.epochs, verbose=0, shuffle=False
            )
            times[name].append(time.perf_counter() - start)
    step_ms = {k: [t / (FLAGS.epochs * FLAGS.steps) * 1e3 for t in v] for k, v in times.items()}

    print(
        f"MLP 64-{FLAGS.width}-{FLAGS.width}-1, batch {FLAGS.batch}, {FLAGS.steps} steps/epoch, "
        f"fit of {FLAGS.epochs} epochs per variant per round, {FLAGS.rounds} interleaved rounds"
        + (" (--quick: for testing, not for reading)" if FLAGS.quick else "")
    )
    print(f"\n{'variant':>15s} | step ms median [min, max]")
    for name in variants:
        print(f"{name:>15s} | {_harness.fmt_stats(step_ms[name], 2)}")

    def time_ratio(a, b):
        return [ta / tb for ta, tb in zip(times[a], times[b])]

    # (label, ratio values, target, at_least)
    rows = [
        ("kd single / plain fit (throughput)", time_ratio("plain", "kd_single"), 1.0, True),
        ("kd single / raw loop (step time)", time_ratio("kd_single", "raw_loop"), 1.15, False),
        ("plain fit / raw loop (step time)", time_ratio("plain", "raw_loop"), None, None),
        (
            "raw keras+Mirrored(1 cpu) / plain (time)",
            time_ratio("raw_mirrored_1", "plain"),
            None,
            None,
        ),
        ("kd mirrored(1 cpu) / plain (time)", time_ratio("kd_mirrored_1", "plain"), 1.10, False),
        (
            "raw keras+Mirrored(2 cpu) / plain (time)",
            time_ratio("raw_mirrored_2", "plain"),
            None,
            None,
        ),
        ("kd mirrored(2 cpu) / plain (time)", time_ratio("kd_mirrored_2", "plain"), None, None),
        (
            "kd mirrored(2) / raw Mirrored(2) (time)",
            time_ratio("kd_mirrored_2", "raw_mirrored_2"),
            1.0,
            False,
        ),
    ]
    print(f"\n{'ratio (paired per round)':42s} {'median [min, max]':^22s}  target")
    misses, ratios = [], {}
    for label, values, target, at_least in rows:
        mark = ""
        if target is not None:
            med = _harness.stats(values)[0]
            met = _harness.verdict(med, target, at_least)
            shown = f"{'>=' if at_least else '<='} {target:g}"
            mark = f"{shown}: " + ("target met" if met else "TARGET NOT MET")
            if not met:
                misses.append(f"{label} = {med:.3f}, target {shown}")
        ratios[label] = {**_harness.run_summary(values), "target": target, "at_least": at_least}
        print(f"{label:42s} {_harness.fmt_stats(values, 3):^22s}  {mark}")
    print("\ntarget misses: " + ("; ".join(misses) if misses else "none"))
    print(f"{load}; total time {watch.elapsed():.0f}s")
    _harness.save_results(
        FLAGS.json,
        "overhead",
        {
            "model": f"MLP 64-{FLAGS.width}-{FLAGS.width}-1",
            "batch": FLAGS.batch,
            "steps": FLAGS.steps,
            "epochs": FLAGS.epochs,
            "rounds": FLAGS.rounds,
            "step_ms": {k: _harness.run_summary(v) for k, v in step_ms.items()},
            "ratios": ratios,
            "misses": misses,
        },
        quick=FLAGS.quick,
        load=load,
    )
    return 1 if FLAGS.strict and misses else 0


if __name__ == "__main__":
    app.run(main)

"""Overhead of DistributedModel against plain Keras and raw tf.distribute.

All variants run interleaved in one process (2 logical CPUs), one epoch per
round after a warm-up epoch, so machine noise hits them alike. Printed:
per-round time ratios (median, min, max) for

  kd single            / plain keras.Model.fit         (target <= 1.03)
  raw keras+Mirrored 1 / plain                          (docs/design.md 1.1: 1.70)
  kd mirrored 1        / plain                          (target <= 1.10)
  kd mirrored 2        / raw keras+Mirrored 2           (target < 1.00)

Run: python benchmarks/overhead.py [--rounds 7] [--steps 32] [--batch 256]
"""

import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("rounds", 7, "Interleaved timing rounds.")
flags.DEFINE_integer("steps", 32, "Optimizer steps per epoch.")
flags.DEFINE_integer("batch", 256, "Global batch size.")
flags.DEFINE_integer("width", 512, "Hidden layer width of the MLP.")


def main(argv):
    del argv
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2
    )
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

    variants = {
        "plain": compiled(plain),
        "kd_single": compiled(ours("single")),
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
    for _ in range(FLAGS.rounds):
        for name, model in models.items():
            start = time.perf_counter()
            model.fit(x, y, batch_size=FLAGS.batch, epochs=1, verbose=0, shuffle=False)
            times[name].append(time.perf_counter() - start)

    def ratio(a, b):
        r = [ta / tb for ta, tb in zip(times[a], times[b])]
        return statistics.median(r), min(r), max(r)

    print(
        f"MLP 64-{FLAGS.width}-{FLAGS.width}-1, batch {FLAGS.batch}, "
        f"{FLAGS.steps} steps/epoch, {FLAGS.rounds} interleaved rounds"
    )
    print(f"plain keras epoch: median {statistics.median(times['plain']):.3f}s")
    print(f"{'ratio':42s} {'median':>7s} {'min':>7s} {'max':>7s}  target")
    rows = [
        ("kd single / plain", "kd_single", "plain", "<= 1.03"),
        ("raw keras+Mirrored(1 cpu) / plain", "raw_mirrored_1", "plain", "(peer)"),
        ("kd mirrored(1 cpu) / plain", "kd_mirrored_1", "plain", "<= 1.10"),
        ("raw keras+Mirrored(2 cpu) / plain", "raw_mirrored_2", "plain", "(peer)"),
        ("kd mirrored(2 cpu) / plain", "kd_mirrored_2", "plain", ""),
        ("kd mirrored(2 cpu) / raw keras+Mirrored(2)", "kd_mirrored_2", "raw_mirrored_2", "< 1.00"),
    ]
    for label, a, b, target in rows:
        med, lo, hi = ratio(a, b)
        print(f"{label:42s} {med:7.3f} {lo:7.3f} {hi:7.3f}  {target}")


if __name__ == "__main__":
    app.run(main)

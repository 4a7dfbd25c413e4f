"""Optimizer-state sharding (ZeRO stages 1 and 2) against the unsharded step, 2 workers.

The model: an MLP of `--depth` hidden layers of `--width` (4 x 1024 by
default: 3.2 M parameters, 12.6 MB in float32), Adam, global batch
`--batch`, `strategy="multi_worker"` on 2 workers (shared memory on one
host). Three configurations, each in its own launch, alternating:

  none       `optimizer_sharding=None`: every worker keeps Adam's two
             moments for every weight;
  optimizer  `optimizer_sharding="optimizer"`: each keeps them for half of
             every weight, updates its half, and the halves travel back in
             one all-gather;
  gradients  `optimizer_sharding="gradients"`: the same, with the
             gradients reduce-scattered instead of all-reduced.

Per configuration: time per step (median over the timed epochs' steps,
slowest worker) and the bytes per worker that `strategy.describe(model)`
reads from the variables (weights, gradients, optimizer state). The
step-time ratios are paired by repetition. The final weights of the
configurations are compared (sharding changes no result).

Run:
    python benchmarks/optimizer_sharding.py [--repeats 3] [--width 1024] [--depth 4]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from absl import app, flags  # noqa: E402

import _harness  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_enum("config", "none", ["none", "optimizer", "gradients"], "Worker only.")
flags.DEFINE_integer("width", 1024, "Input features and hidden width.")
flags.DEFINE_integer("depth", 4, "Hidden layers.")
flags.DEFINE_integer("batch", 256, "Global batch.")
flags.DEFINE_integer("steps", 10, "Steps per epoch.")
flags.DEFINE_integer("epochs", 3, "Epochs per launch (the first is warm-up).")
flags.DEFINE_integer("repeats", 3, "Launches per configuration.")
flags.DEFINE_integer("timeout", 900, "Seconds per launch.")
flags.DEFINE_string(
    "json",
    os.path.join(_harness.RESULTS_DIR, "optimizer_sharding.json"),
    "Where the driver saves its measurements (empty: nowhere).",
)
flags.DEFINE_bool("quick", False, "Few small steps: tests the chain, numbers not for reading.")

CONFIGS = ("none", "optimizer", "gradients")
TARGET = 1.05  # sharded / unsharded step time, at most (each stage)


def run_worker() -> None:
    rank = _harness.worker_rank()
    _harness.worker_setup(pin_core=rank)
    import keras
    import numpy as np

    import keras_distrib as kd

    sharding = None if FLAGS.config == "none" else FLAGS.config
    strategy = kd.strategies.get("multi_worker", optimizer_sharding=sharding)
    rng = np.random.default_rng(0)
    samples = FLAGS.batch * FLAGS.steps
    x = rng.normal(size=(samples, FLAGS.width)).astype("float32")
    y = rng.integers(0, 10, samples).astype("int32")
    keras.utils.set_random_seed(0)  # the same initial weights in both configurations
    inputs = keras.Input((FLAGS.width,))
    hidden = inputs
    for _ in range(FLAGS.depth):
        hidden = keras.layers.Dense(FLAGS.width, activation="relu")(hidden)
    model = kd.DistributedModel(inputs, keras.layers.Dense(10)(hidden), strategy=strategy)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-4),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )

    steps = _harness.steady_step_seconds(
        model, x, y, batch_size=FLAGS.batch, epochs=FLAGS.epochs, shuffle=False, verbose=0
    )
    memory = strategy.describe(model)
    weights = model.get_weights()
    _harness.write_result(
        FLAGS.out_dir,
        rank,
        {
            "step_ms": 1000 * float(np.median(steps)),
            "weights": memory.weights,
            "gradients": memory.gradients,
            "optimizer": memory.optimizer,
            "checksum": [float(np.sum(w, dtype=np.float64)) for w in weights],
        },
    )


def run_config(name: str) -> dict:
    args = [
        "--config",
        name,
        "--width",
        str(FLAGS.width),
        "--depth",
        str(FLAGS.depth),
        "--batch",
        str(FLAGS.batch),
        "--steps",
        str(FLAGS.steps),
        "--epochs",
        str(FLAGS.epochs),
    ]
    out_dir, _ = _harness.launch_workers(os.path.abspath(__file__), 2, args, timeout=FLAGS.timeout)
    results = _harness.read_results(out_dir, 2)
    return {
        "step_ms": max(r["step_ms"] for r in results),
        **{k: results[0][k] for k in ("weights", "gradients", "optimizer", "checksum")},
    }


def run_driver() -> int:
    watch, load = _harness.Stopwatch(), _harness.load_note()
    if FLAGS.quick:
        _harness.quick_defaults(repeats=1, width=128, depth=2, steps=4, epochs=2)
    runs = _harness.interleaved(CONFIGS, FLAGS.repeats, run_config)
    if runs is None:
        return 1
    params = FLAGS.depth * FLAGS.width * (FLAGS.width + 1) + FLAGS.width * 10 + 10
    print(
        f"\nMLP {FLAGS.depth} x {FLAGS.width} ({params:,} parameters), Adam, global batch "
        f"{FLAGS.batch}; multi_worker, 2 workers"
    )
    print(
        f"{'sharding':10s} {'step ms median [min, max]':^28s} "
        f"{'weights':>10s} {'gradients':>10s} {'optimizer':>10s}  (per worker)"
    )
    for name in CONFIGS:
        r = runs[name]
        print(
            f"{name:10s} {_harness.fmt_stats([x['step_ms'] for x in r], 1):^28s} "
            + " ".join(
                f"{_harness.human(r[0][k]):>10s}" for k in ("weights", "gradients", "optimizer")
            )
        )
    ratios, met = {}, True
    for stage in ("optimizer", "gradients"):
        ratios[stage] = _harness.paired_ratios(runs[stage], runs["none"], key="step_ms")
        line, stage_met = _harness.target_line(
            f"step time {stage} / unsharded", ratios[stage], TARGET, at_least=False
        )
        print(line)
        met = met and stage_met
    optimizer_ratio = runs["optimizer"][0]["optimizer"] / runs["none"][0]["optimizer"]
    gradient_ratio = runs["gradients"][0]["gradients"] / runs["none"][0]["gradients"]
    print(f"{'optimizer bytes sharded / unsharded':44s} {optimizer_ratio:.3f}")
    print(f"{'gradient bytes stage 2 / unsharded':44s} {gradient_ratio:.3f}")
    same = all(
        abs(a - b) <= 1e-3 * max(1.0, abs(b))
        for stage in ("optimizer", "gradients")
        for a, b in zip(runs[stage][0]["checksum"], runs["none"][0]["checksum"])
    )
    print(f"final weights equal: {'yes' if same else 'NO'}")
    print(f"load: {load}; wall time {watch.elapsed():.0f} s")
    _harness.save_results(
        FLAGS.json,
        "optimizer_sharding",
        {
            "width": FLAGS.width,
            "depth": FLAGS.depth,
            "batch": FLAGS.batch,
            "parameters": params,
            "configs": {
                n: {
                    "step_ms": _harness.run_summary([x["step_ms"] for x in runs[n]]),
                    **{k: runs[n][0][k] for k in ("weights", "gradients", "optimizer")},
                }
                for n in CONFIGS
            },
            "ratios": {
                "step time sharded / unsharded": _harness.run_summary(ratios["optimizer"]),
                "step time stage 2 / unsharded": _harness.run_summary(ratios["gradients"]),
                "optimizer bytes sharded / unsharded": optimizer_ratio,
                "gradient bytes stage 2 / unsharded": gradient_ratio,
            },
            "target": TARGET,
            "target_met": met,
            "final_weights_equal": same,
        },
        quick=FLAGS.quick,
        load=load,
    )
    return 0


def main(argv):
    return _harness.driver_or_worker(argv, run_worker, run_driver)


if __name__ == "__main__":
    app.run(main)

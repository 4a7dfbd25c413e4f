"""Model parallelism on one host: pipeline stages (and, later, tensor parallelism).

Pipeline part. What it measures: training throughput (samples / second)
of a deep MLP of 1024-wide layers (`--depth` hidden layers, about 8.4M
parameters by default), SGD, global batch `--batch` (1024, so that a
micro-batch at m = 8 still has 128 rows and matrix products dominate the
step: at batch 256 the per-micro-batch weight gradients, 4 MB per layer
each, cost as much as the products), synthetic numpy data from a fixed
seed.
Every run is its own process (TensorFlow fixes its devices and thread
pools when it starts), with 1 intra-op thread:

  one      strategy "single" on 1 logical CPU, 1 inter-op thread, pinned
           to one core: the one-device baseline.
  m1..m16  strategy "pipeline", 2 stages on 2 logical CPUs (2 inter-op
           threads, so the two stages' ops can run at once), schedule
           1F1B, 1, 2, 4, 8, 16 micro-batches per batch.
  gpipe8   the same with schedule GPipe at 8 micro-batches.

Each throughput is compared with `one` in the same repetition and with the
ideal of a pipeline of p = 2 stages, `p * (1 - bubble)` with bubble
`(p-1)/(m+p-1)` (devices idle while the pipeline fills and drains).
Target (the pipeline's issue): >= 1.5x `one` at m = 8, judged on the
median; "target met" or "TARGET NOT MET" is printed, exit code 0 either
way unless --strict. The peak number of micro-batches whose activations a
stage holds (GPipe vs 1F1B at m = 8) is printed from the schedule
(`keras_distrib.strategies.pipeline.schedule`), with what that is in bytes for this
model (the inputs a stage's layers keep for their backward pass).

The configurations run alternately (order rotated every repetition)
`--repeats` times; each run fits `--epochs` epochs of `--steps` steps with
`verbose=0`, the first epoch (tracing, warm-up) untimed, and a run's
epoch time is the median of the rest. The process's CPU time per step
is printed too: a run whose wall time per step is not below it ran
nothing at once. (It over-counts the work of the 2-thread runs, whose
idle TensorFlow threads spin a while before they sleep.)
On a shared 2-core machine the absolute times are noise; the ratios are
what to read, and only when the load printed at the end is low.

The tensor-parallel part is not written yet: see `tensor_parallel_configs`
below, the one place it plugs in.

Run:
    python benchmarks/model_parallel.py [--repeats 3] [--steps 4] [--epochs 3]
        [--depth 8] [--width 1024] [--batch 1024]
        [--configs one,m1,m2,m4,m8,m16,gpipe8] [--quick] [--strict]
        [--json benchmarks/results/model_parallel.json]
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from absl import app, flags  # noqa: E402

import _harness  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("config", None, "Worker only: the configuration to run.")
flags.DEFINE_list(
    "configs",
    ["one", "m1", "m2", "m4", "m8", "m16", "gpipe8", "tp2"],
    "Configurations to run (one, m1, m2, m4, m8, m16, gpipe8); `one` is the "
    "baseline every ratio needs.",
)
flags.DEFINE_integer("repeats", 3, "Alternating repetitions of every configuration.")
flags.DEFINE_integer("batch", 1024, "Global batch (divisible by every micro-batch count).")
flags.DEFINE_integer("steps", 4, "Steps per epoch.")
flags.DEFINE_integer("epochs", 3, "Epochs per run; the first is not timed.")
flags.DEFINE_integer("depth", 8, "Hidden layers.")
flags.DEFINE_integer("width", 1024, "Input features and hidden layer width.")
flags.DEFINE_integer("classes", 10, "Output classes.")
flags.DEFINE_float("timeout", 300.0, "Seconds one run (process) may take.")
flags.DEFINE_bool(
    "quick",
    False,
    "A minute or two, to test the chain: --repeats 1 --steps 2 "
    "--epochs 2 --configs one,m1,m8,gpipe8 (flags given explicitly win).",
)
flags.DEFINE_bool("strict", False, "Exit with code 1 when a target is not met.")
flags.DEFINE_string(
    "json",
    os.path.join(_harness.RESULTS_DIR, "model_parallel.json"),
    "Where the driver saves its measurements (empty: nowhere).",
)

STAGES = 2
TARGET_AT_8 = 1.5

# name -> (logical CPUs, inter-op threads, strategy options or None for "single")
_PIPELINE_CONFIGS = {
    "one": (1, 1, None),
    **{
        f"m{m}": (STAGES, 2, {"num_micro_batches": m, "schedule": "1f1b"}) for m in (1, 2, 4, 8, 16)
    },
    "gpipe8": (STAGES, 2, {"num_micro_batches": 8, "schedule": "gpipe"}),
}


# ----------------------------------------------------------------------------
# Tensor-parallel part: TO BE ADDED by the tensor_parallel work.


def tensor_parallel_configs() -> dict:
    """The tensor-parallel configurations, in the form of `_PIPELINE_CONFIGS`.

    `tp2`: every Dense layer split over 2 logical CPUs (the default plan:
    column, row, column, ...), 2 inter-op threads so both halves of a layer
    can run at once. The options name the strategy (`_strategy` reads it).
    """
    return {"tp2": (2, 2, {"strategy": "tensor_parallel"})}


def print_tensor_parallel(runs: dict) -> None:
    """Tensor parallel vs `one`: speed (paired ratio) and weight bytes per device."""
    if "tp2" not in runs:
        print("\ntensor-parallel part: tp2 not in --configs, not measured")
        return
    ratio = _harness.paired_ratios(runs["tp2"], runs["one"])
    print(
        f"\n{'tensor parallel (2 devices) throughput / one':44s} {_harness.fmt_stats(ratio):^22s}"
    )
    per_device = runs["tp2"][0].get("bytes_per_device", {})
    total = sum(per_device.values()) or 1
    print(
        "weight bytes per device (tp2): "
        + ", ".join(
            f"{d.rsplit('device:', 1)[-1]} {_harness.human(b)} ({100 * b / total:.1f}%)"
            for d, b in sorted(per_device.items())
        )
        + "  (ideal 50% each)"
    )


# ----------------------------------------------------------------------------
# Worker


def _all_configs() -> dict:
    return {**_PIPELINE_CONFIGS, **tensor_parallel_configs()}


def _strategy(kd, options):
    if options is None:
        return kd.strategies.get("single")
    options = dict(options)
    return kd.strategies.get(options.pop("strategy", "pipeline"), **options)


def run_worker() -> None:
    logical_cpus, inter_op, options = _all_configs()[FLAGS.config]
    if logical_cpus == 1 and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {0})  # one core, before TensorFlow sizes its pools
    _harness.worker_setup()
    import numpy as np
    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * logical_cpus
    )
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(inter_op)
    import keras

    import keras_distrib as kd

    rng = np.random.default_rng(0)
    samples = FLAGS.steps * FLAGS.batch
    x = rng.standard_normal((samples, FLAGS.width), dtype=np.float32)
    y = rng.integers(0, FLAGS.classes, size=(samples,)).astype(np.int32)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((FLAGS.width,))
    h = inputs
    for _ in range(FLAGS.depth):
        h = keras.layers.Dense(FLAGS.width, activation="relu")(h)
    outputs = keras.layers.Dense(FLAGS.classes)(h)
    strategy = _strategy(kd, options)
    model = kd.DistributedModel(inputs, outputs, strategy=strategy)
    model.compile(
        optimizer=keras.optimizers.SGD(learning_rate=0.001),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )

    class EpochTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times, self.cpu_times, self._start = [], [], None

        def on_epoch_begin(self, epoch, logs=None):
            self._start = (time.perf_counter(), time.process_time())

        def on_epoch_end(self, epoch, logs=None):
            self.times.append(time.perf_counter() - self._start[0])
            self.cpu_times.append(time.process_time() - self._start[1])

    timer = EpochTimer()
    history = model.fit(
        x,
        y,
        batch_size=FLAGS.batch,
        epochs=FLAGS.epochs,
        verbose=0,
        shuffle=False,
        callbacks=[timer],
    )
    epoch = sorted(timer.times[1:])[len(timer.times[1:]) // 2]
    cpu = sorted(timer.cpu_times[1:])[len(timer.cpu_times[1:]) // 2]
    result = {
        "config": FLAGS.config,
        "params": int(model.count_params()),
        "devices": sorted({v.value.device.rsplit("device:", 1)[-1] for v in model.variables}),
        "epoch_times": timer.times,
        "throughput": samples / epoch,
        "step_ms": 1000 * epoch / FLAGS.steps,
        # CPU time of the process per step: the work, whatever the overlap
        # (wall time shrinks below it only when ops ran at once).
        "cpu_step_ms": 1000 * cpu / FLAGS.steps,
        "loss": [float(v) for v in history.history["loss"]],
    }
    if options is not None:
        plan = strategy.describe(model)
        result["bytes_per_device"] = plan.bytes_per_device
        if hasattr(plan, "peak_live_activations"):  # pipeline plans only
            result["peak_live_activations"] = plan.peak_live_activations
    _harness.write_result(FLAGS.out_dir, 0, result)


# ----------------------------------------------------------------------------
# Driver


def run_config(name: str) -> dict:
    """Runs configuration `name` in a fresh process; its result."""
    out_dir = tempfile.mkdtemp(prefix="kd-bench-")
    argv = [
        sys.executable,
        os.path.abspath(__file__),
        "--role=worker",
        f"--config={name}",
        f"--out_dir={out_dir}",
        f"--batch={FLAGS.batch}",
        f"--steps={FLAGS.steps}",
        f"--epochs={FLAGS.epochs}",
        f"--depth={FLAGS.depth}",
        f"--width={FLAGS.width}",
        f"--classes={FLAGS.classes}",
    ]
    env = {
        **os.environ,
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(
            p for p in (_harness.REPO_ROOT, os.environ.get("PYTHONPATH", "")) if p
        ),
    }
    try:
        done = subprocess.run(
            argv,
            cwd=_harness.REPO_ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=FLAGS.timeout,
        )
    except subprocess.TimeoutExpired as e:
        raise _harness.WorkersFailed(
            f"{name} did not finish within {FLAGS.timeout:g}s", str(e.output or "")
        ) from None
    if done.returncode != 0:
        raise _harness.WorkersFailed(f"{name} exited with code {done.returncode}", done.stdout)
    return _harness.read_results(out_dir, 1)[0]


def ideal(m: int, p: int = STAGES) -> float:
    """Throughput of a perfect p-stage pipeline over one device: p (1 - bubble)."""
    from keras_distrib.strategies.pipeline import schedule as pipeline_schedule

    return p * (1 - pipeline_schedule.bubble_fraction(m, p))


def run_driver() -> int:
    watch = _harness.Stopwatch()
    load = _harness.load_note()
    if FLAGS.quick:
        _harness.quick_defaults(repeats=1, steps=2, epochs=2, configs=["one", "m1", "m8", "gpipe8"])
    if FLAGS.epochs < 2:
        raise app.UsageError("--epochs must be >= 2 (the first epoch is not timed).")
    configs = _harness.chosen_configs(FLAGS.configs, _all_configs())
    if "one" not in configs:
        raise app.UsageError("--configs must include `one`: every ratio is against it.")
    runs = _harness.interleaved(configs, FLAGS.repeats, run_config)
    if runs is None:
        return 1
    some = runs["one"][0]
    print(
        f"model parallelism: MLP {FLAGS.width} -> {FLAGS.depth} x {FLAGS.width} -> "
        f"{FLAGS.classes} ({some['params'] / 1e6:.1f}M parameters), SGD, batch "
        f"{FLAGS.batch}, {FLAGS.steps} steps/epoch, {FLAGS.epochs} epochs (first untimed), "
        f"{FLAGS.repeats} alternating repetitions"
        + (" (--quick: for testing, not for reading)" if FLAGS.quick else "")
    )
    print(
        "1 intra-op thread everywhere; `one`: 1 logical CPU, 1 inter-op thread, one core; "
        f"pipeline: {STAGES} stages on {STAGES} logical CPUs, 2 inter-op threads"
    )

    print(
        f"\n{'config':10s} {'step ms median [min, max]':^26s} {'CPU ms/step':>11s} "
        f"{'vs one (paired)':^22s} {'ideal p(1-bubble)':>17s}  devices"
    )
    ratios, misses = {}, []
    for name in configs:
        step = _harness.fmt_stats([r["step_ms"] for r in runs[name]], 1)
        cpu = _harness.stats([r["cpu_step_ms"] for r in runs[name]])[0]
        line = f"{name:10s} {step:^26s} {cpu:11.1f}"
        if name != "one":
            ratios[name] = _harness.paired_ratios(runs[name], runs["one"])
            m = (
                _PIPELINE_CONFIGS[name][2]["num_micro_batches"]
                if name in _PIPELINE_CONFIGS and _PIPELINE_CONFIGS[name][2]
                else None
            )
            line += f" {_harness.fmt_stats(ratios[name]):^22s}"
            line += f" {ideal(m):17.2f}" if m else f" {'':17s}"
        else:
            line += f" {'1':^22s} {'1.00':>17s}"
        print(f"{line}  {','.join(runs[name][0]['devices'])}")

    if "m8" in ratios:
        line, met = _harness.target_line(
            "\npipeline m=8 (1F1B) throughput / one", ratios["m8"], TARGET_AT_8
        )
        print(line)
        if not met:
            misses.append(f"m8 / one = {_harness.stats(ratios['m8'])[0]:.2f} < {TARGET_AT_8}")
    else:
        print("\nthe m=8 target needs m8 in --configs: not judged")
    if "m8" in ratios and "gpipe8" in ratios:
        versus = _harness.paired_ratios(runs["m8"], runs["gpipe8"])
        print(f"{'1F1B / GPipe throughput at m=8':44s} {_harness.fmt_stats(versus):^22s}")

    from keras_distrib.strategies.pipeline import schedule as pipeline_schedule

    # A stage's layers keep their inputs for the backward pass: per micro-batch,
    # (batch / m) rows x width floats x its layers (about depth / 2 + 1).
    per_micro_batch = FLAGS.batch // 8 * FLAGS.width * 4 * (FLAGS.depth // STAGES + 1)
    print("\npeak live activations at m=8 (micro-batches held per stage; bytes on stage 0):")
    for schedule in pipeline_schedule.SCHEDULES:
        peaks = pipeline_schedule.peak_live_activations(
            pipeline_schedule.stage_orders(schedule, 8, STAGES)
        )
        print(f"  {schedule:6s} {peaks}  ~{_harness.human(peaks[0] * per_micro_batch)}")
    print_tensor_parallel(runs)
    bad = [
        n
        for n, rs in runs.items()
        for r in rs
        if not all(v == v and abs(v) != float("inf") for v in r["loss"])
    ]
    if bad:
        misses.append(f"non-finite training loss in {sorted(set(bad))}")
    print("\ntarget misses: " + ("; ".join(misses) if misses else "none"))
    print(f"{load}; total time {watch.elapsed():.0f}s")
    _harness.save_results(
        FLAGS.json,
        "model_parallel",
        {
            "model": f"MLP {FLAGS.width}x{FLAGS.depth}",
            "params": some["params"],
            "batch": FLAGS.batch,
            "steps": FLAGS.steps,
            "epochs": FLAGS.epochs,
            "repeats": FLAGS.repeats,
            "runs": runs,
            "ratios_vs_one": {k: _harness.run_summary(v) for k, v in ratios.items()},
            "ideal": {
                n: ideal(_PIPELINE_CONFIGS[n][2]["num_micro_batches"])
                for n in ratios
                if n in _PIPELINE_CONFIGS
            },
            "target_m8": TARGET_AT_8,
            "misses": misses,
        },
        quick=FLAGS.quick,
        load=load,
    )
    return 1 if misses and FLAGS.strict else 0


def main(argv) -> int:
    return _harness.driver_or_worker(argv, run_worker, run_driver)


if __name__ == "__main__":
    app.run(main)

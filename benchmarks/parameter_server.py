"""Asynchronous parameter-server training vs synchronous multi-worker training.

What it measures, on the digits MLP (the UCI 8x8 digits in examples/data, 1438
training / 359 validation images, 64 -> `--hidden` -> 10, SGD with
momentum, `--batch` samples per step):

  throughput   samples/s of *applied* steps: steps the strategy reports
               applied (`model.strategy.steps_applied`, re-runs included)
               x batch / training seconds, over the epochs after the first
               (tracing); an epoch's training time runs from
               on_epoch_begin to on_test_begin (validation starts only once
               every scheduled step is applied: `fit` settles first).
  2w / 1w      the scaling ratio of the asynchronous throughput, paired per
               repetition: ps2 / ps1 (ideal 2.0).
  time to acc  seconds from on_train_begin to the end of the first epoch
               whose validation accuracy is >= `--target` (validation each
               epoch, on the chief; its time counts, for every config).
               "-" if never reached in `--epochs` epochs.
  staleness    per applied step: how many *other* steps were applied to the
               shared weights between this step's read of the weights and its
               own update (0 = as fresh as synchronous SGD).

Configurations (processes this driver starts; all on this host):

  ps1     1 ps + 1 worker (+ the chief, which runs fit and validation):
          strategy "parameter_server"; the ps and worker run
          `python -m keras_distrib.strategies.parameter_server.task_server` with their TF_CONFIG.
  ps2     1 ps + 2 workers, the configuration under test.
  mw2     the synchronous peer: strategy "multi_worker" through
          `keras-distrib launch -n 2`, global batch 2 x `--batch` (each worker
          computes `--batch` samples per step, as an async worker does).
  single  strategy "single" in one process, batch `--batch` (sync SGD).

Every worker is pinned to one core (worker i, or rank i, on core
i mod cores; `sched_setaffinity` before TensorFlow starts) and runs
TensorFlow with one intra-op thread (`TF_NUM_INTRAOP_THREADS=1`). The ps
task and the chief are not pinned: on a 2-core machine they share the
workers' cores, which is part of what asynchronous training costs here.

How staleness is measured (no library code involved): the chief's model is
a `DistributedModel` subclass whose `train_step` (the closure a worker runs)
reads the optimizer's step counter `iterations` (a variable on the ps,
incremented once by every applied step) three times:

  r0  before the forward pass (a control dependency makes every weight
      read of the forward pass come after it),
  r1  after the gradients, just before `optimizer.apply`,
  r2  just after `optimizer.apply` (ordered after its increment of the
      same variable by TensorFlow's automatic control dependencies).

Steps applied by other workers between our weight read and our update
number at least r1 - r0 (applied before r1, which precedes our update) and
at most r2 - r0 - 1 (everything up to r2, less our own). Those two bounds
are recorded per step, exactly, into two histogram variables on the ps
(`assign_add` of a one-hot vector: an atomic update, so concurrent workers
lose no count) and read by the chief at the end; the table gives median,
p90 and max of each. The bounds differ only by steps that landed during
the one remote read around our update. (The weights are read one variable
at a time and updated one variable at a time, so "the" read is the
interval after r0; that is what asynchronous SGD means by staleness.)
`optimizer.iterations` cannot serve as the clock: inside a step it reads
as the step's start value and is incremented only after `train_step`
returns (`keras_distrib.strategies.parameter_server.scheduled_training`), so the clock is a plain
`tf.Variable` on the ps that each step increments (TensorFlow's atomic
`assign_add`) right after its weight updates, which a re-read of the
weights orders it after. The measurement costs the ps configurations
three counter reads and one extra read of the weights per step (9,546
floats): a small handicap on their throughput, none on the sync ones.
The chief also checks that the clock counted every applied step.

The driver starts the ps configurations' processes itself (not through
`keras-distrib launch --workers N --ps 1`) to pin each worker to its core.

Interleaved repeats: every repetition runs each configuration once, the
order rotated; the table gives median [min, max] over repetitions, and
ratios are paired per repetition.

Run:
    python benchmarks/parameter_server.py [--repeats 3] [--epochs 6]
        [--configs ps1,ps2,mw2,single] [--target 0.9] [--quick]
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from absl import app, flags  # noqa: E402

import _harness  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_enum(
    "strategy",
    "parameter_server",
    ["parameter_server", "multi_worker", "single"],
    "Worker only: the strategy to train with.",
)
flags.DEFINE_list(
    "configs", ["ps1", "ps2", "mw2", "single"], "Configurations to run (ps1, ps2, mw2, single)."
)
flags.DEFINE_integer("repeats", 3, "Alternating repetitions of every configuration.")
flags.DEFINE_integer("epochs", 6, "Epochs per run; the first is not timed for throughput.")
flags.DEFINE_integer("batch", 32, "Samples per step per worker.")
flags.DEFINE_integer("hidden", 128, "Hidden units of the MLP.")
flags.DEFINE_float("learning_rate", 0.05, "SGD learning rate (momentum 0.9).")
flags.DEFINE_integer("steps_per_execution", 1, "Steps per scheduled closure / compiled call.")
flags.DEFINE_float("target", 0.9, "Validation accuracy for time-to-accuracy.")
flags.DEFINE_integer("buckets", 64, "Staleness histogram buckets (the last one: >=).")
flags.DEFINE_float("timeout", 150.0, "Seconds one run may take.")
flags.DEFINE_bool("quick", False, "About a minute: --repeats 1 --epochs 4 (configs ps1,ps2,mw2).")

_CONFIGS = {  # name -> (workers, strategy)
    "ps1": (1, "parameter_server"),
    "ps2": (2, "parameter_server"),
    "mw2": (2, "multi_worker"),
    "single": (1, "single"),
}
_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1", "TF_NUM_INTRAOP_THREADS": "1"}


# ----------------------------------------------------------------------------
# Worker (the chief for ps configs; every rank for sync ones)


def run_worker() -> None:
    rank = _harness.worker_rank()
    ps = FLAGS.strategy == "parameter_server"
    # The ps chief is not pinned (see the docstring); sync ranks are.
    _harness.worker_setup(pin_core=None if ps else rank)
    if not ps:  # before keras_distrib starts the collective runtime
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(1)
    import keras_distrib as kd  # first: on a ps chief, connects to the cluster

    import keras
    import numpy as np
    import tensorflow as tf

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
    from _digits import digits_arrays

    tf.get_logger().setLevel("ERROR")

    x, y = digits_arrays()
    order = np.random.default_rng(1).permutation(len(x))
    x, y = (x[order] / 16.0).astype("float32"), y[order].astype("int32")
    n_val = int(len(x) * 0.2)
    (x, y), (x_val, y_val) = (x[n_val:], y[n_val:]), (x[:n_val], y[:n_val])

    strategy = kd.strategies.get(FLAGS.strategy)
    workers = (
        1 if FLAGS.strategy == "single" else (strategy.num_workers if ps else strategy.world_size)
    )
    batch = FLAGS.batch * (1 if ps else workers)  # sync: global batch
    buckets = FLAGS.buckets
    hist = {}

    class Staleness(kd.DistributedModel):
        """The usual train_step, plus the staleness bounds of the docstring."""

        def train_step(self, data):
            features, labels, _ = keras.utils.unpack_x_y_sample_weight(data)
            # Not optimizer.iterations: inside a step it reads as the step's
            # start value (keras_distrib.strategies.parameter_server.scheduled_training),
            # and is bumped after the step returns. A plain tf.Variable on the ps is not.
            count = hist["count"]
            r0 = count.read_value()
            with tf.control_dependencies([r0]):
                with tf.GradientTape() as tape:
                    logits = self(features, training=True)
                    loss = self.compute_loss(y=labels, y_pred=logits)
                grads = tape.gradient(loss, self.trainable_variables)
            with tf.control_dependencies(grads):
                r1 = count.read_value()
            with tf.control_dependencies([r1]):
                self.optimizer.apply(grads, self.trainable_variables)
            # Re-reading the weights orders the count's increment after
            # their updates (same resources: automatic control dependencies).
            updated = [tf.identity(v.value) for v in self.trainable_variables]
            with tf.control_dependencies(updated):
                r2 = count.assign_add(1, read_value=True)
            for name, value in (("low", r1 - r0), ("high", r2 - r0 - 1)):
                bucket = tf.cast(tf.clip_by_value(value, 0, buckets - 1), tf.int32)
                hist[name].assign_add(tf.one_hot(bucket, buckets, dtype=tf.float32))
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(loss)
                else:
                    metric.update_state(labels, logits)
            return {m.name: m.result() for m in self.metrics}

    keras.utils.set_random_seed(1)
    inputs = keras.Input((64,))
    h = keras.layers.Dense(FLAGS.hidden, activation="relu")(inputs)
    outputs = keras.layers.Dense(10)(h)
    cls = Staleness if ps else kd.DistributedModel
    model = cls(inputs, outputs, strategy=strategy)
    if ps:
        with strategy.scope():  # on the ps: every worker's closures update them
            hist["count"] = tf.Variable(
                tf.constant(0, tf.int64), trainable=False, name="staleness_count"
            )
            for name in ("low", "high"):
                hist[name] = tf.Variable(
                    tf.zeros([buckets]), trainable=False, name=f"staleness_{name}"
                )
        placement = sorted({v.device.split("/device")[0] for v in hist.values()})
    model.compile(
        optimizer=keras.optimizers.SGD(FLAGS.learning_rate, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[keras.metrics.SparseCategoricalAccuracy(name="acc")],
        steps_per_execution=FLAGS.steps_per_execution,
    )

    class Clock(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.train, self.ends, self.val_acc = [], [], []

        def on_train_begin(self, logs=None):
            self.start = time.perf_counter()

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch_start, self.test_start = time.perf_counter(), None

        def on_test_begin(self, logs=None):
            if self.test_start is None:
                self.test_start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            now = time.perf_counter()
            self.train.append((self.test_start or now) - self.epoch_start)
            self.ends.append(now - self.start)
            self.val_acc.append(float(logs["val_acc"]))

    clock = Clock()
    model.fit(
        x,
        y,
        batch_size=batch,
        epochs=FLAGS.epochs,
        validation_data=(x_val, y_val),
        verbose=0,
        shuffle=True,
        callbacks=[clock],
    )
    steps_per_epoch = math.ceil(len(x) / batch)
    if ps:
        applied = model.strategy.steps_applied
    else:
        applied = int(model.optimizer.iterations.numpy())
    result = {
        "rank": rank,
        "workers": workers,
        "batch": batch,
        "steps_per_epoch": steps_per_epoch,
        "samples": len(x),
        "applied": applied,
        "scheduled": steps_per_epoch * FLAGS.epochs,
        "train_seconds": clock.train,
        "epoch_ends": clock.ends,
        "val_acc": clock.val_acc,
        "cpus": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
    }
    if ps:
        result["hist"] = {name: [int(c) for c in hist[name].numpy()] for name in ("low", "high")}
        result["counted"] = int(hist["count"].numpy())
        result["hist_placement"] = placement
    _harness.write_result(FLAGS.out_dir, rank, result)


# ----------------------------------------------------------------------------
# Driver


def worker_args(strategy: str) -> list[str]:
    return [
        f"--strategy={strategy}",
        f"--epochs={FLAGS.epochs}",
        f"--batch={FLAGS.batch}",
        f"--hidden={FLAGS.hidden}",
        f"--learning_rate={FLAGS.learning_rate}",
        f"--buckets={FLAGS.buckets}",
        f"--steps_per_execution={FLAGS.steps_per_execution}",
    ]


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _pinned(core):
    def setup():
        _harness._die_with_parent()
        if core is not None and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, {core % os.cpu_count()})

    return setup


def run_ps(workers: int) -> dict:
    """One parameter-server run: ps and worker servers, then the chief script."""
    ports = _free_ports(2 + workers)
    addr = [f"127.0.0.1:{p}" for p in ports]
    cluster = {"chief": [addr[0]], "ps": [addr[1]], "worker": addr[2:]}
    out_dir = tempfile.mkdtemp(prefix="kd-bench-ps-")
    env = {**os.environ, **_ENV}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_harness.REPO_ROOT, env.get("PYTHONPATH")) if p)
    env.pop("KERAS_DISTRIB_RANK", None)

    def tf_config(kind, index):
        return json.dumps({"cluster": cluster, "task": {"type": kind, "index": index}})

    servers, logs = [], []
    try:
        for kind, index, core in [("ps", 0, None)] + [("worker", i, i) for i in range(workers)]:
            log = open(os.path.join(out_dir, f"{kind}{index}.log"), "w+")
            logs.append(log)
            servers.append(
                subprocess.Popen(
                    [sys.executable, "-m", "keras_distrib.strategies.parameter_server.task_server"],
                    cwd=_harness.REPO_ROOT,
                    env={**env, "TF_CONFIG": tf_config(kind, index)},
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    preexec_fn=_pinned(core),
                )
            )
        chief = subprocess.Popen(
            [
                sys.executable,
                os.path.abspath(__file__),
                "--role=worker",
                f"--out_dir={out_dir}",
                *worker_args("parameter_server"),
            ],
            cwd=_harness.REPO_ROOT,
            env={**env, "TF_CONFIG": tf_config("chief", 0)},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=_pinned(None),
        )
        try:
            output, _ = chief.communicate(timeout=FLAGS.timeout)
        except subprocess.TimeoutExpired:
            chief.kill()
            output, _ = chief.communicate()
            raise _harness.WorkersFailed(
                f"the chief did not finish within {FLAGS.timeout:g}s", output + _server_output(logs)
            ) from None
        if chief.returncode != 0:
            raise _harness.WorkersFailed(
                f"the chief exited with code {chief.returncode}", output + _server_output(logs)
            )
    finally:
        for proc in servers:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in servers:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()
    for name in os.listdir(out_dir):
        if name.endswith(".log"):
            os.remove(os.path.join(out_dir, name))
    return _harness.read_results(out_dir, 1)[0]


def _server_output(logs) -> str:
    text = ""
    for log in logs:
        log.flush()
        log.seek(0)
        text += f"\n--- {os.path.basename(log.name)}\n" + log.read()[-3000:]
    return text


def run_config(name: str) -> dict:
    workers, strategy = _CONFIGS[name]
    if strategy == "parameter_server":
        r = run_ps(workers)
    else:
        out_dir, _ = _harness.launch_workers(
            os.path.abspath(__file__),
            workers,
            worker_args(strategy),
            timeout=FLAGS.timeout,
            extra_env={"TF_NUM_INTRAOP_THREADS": "1"},
        )
        r = _harness.read_results(out_dir, workers)[0]
    steady = r["train_seconds"][1:]
    epochs_timed = len(steady)
    # Applied steps per epoch: what the strategy reports, spread evenly.
    applied_per_epoch = r["applied"] / len(r["train_seconds"])
    throughput = applied_per_epoch * epochs_timed * r["batch"] / sum(steady)
    reached = [t for t, acc in zip(r["epoch_ends"], r["val_acc"]) if acc >= FLAGS.target]
    return {
        **r,
        "throughput": throughput,
        "tta": reached[0] if reached else None,
        "final_acc": r["val_acc"][-1],
    }


def _quantiles(counts: list[int]) -> tuple[float, float, int, float]:
    """(median, p90, max, mean) of a bucket histogram (last bucket: >=)."""
    total = sum(counts)
    if not total:
        return (float("nan"),) * 2 + (0, float("nan"))

    def q(p):
        need, seen = p * total, 0
        for value, c in enumerate(counts):
            seen += c
            if seen >= need:
                return value
        return len(counts) - 1

    top = max(v for v, c in enumerate(counts) if c)
    mean = sum(v * c for v, c in enumerate(counts)) / total
    return q(0.5), q(0.9), top, mean


def run_driver() -> int:
    watch = _harness.Stopwatch()
    load = _harness.load_note()
    if FLAGS.quick:
        FLAGS.repeats, FLAGS.epochs = 1, 4
        if FLAGS["configs"].using_default_value:
            FLAGS.configs = ["ps1", "ps2", "mw2"]
    if FLAGS.epochs < 2:
        raise app.UsageError("--epochs must be >= 2 (the first epoch is not timed).")
    configs = _harness.chosen_configs(FLAGS.configs, _CONFIGS)
    runs = _harness.interleaved(configs, FLAGS.repeats, run_config)
    if runs is None:
        return 1

    print(
        f"parameter server vs sync: digits MLP 64-{FLAGS.hidden}-10, SGD "
        f"lr {FLAGS.learning_rate} momentum 0.9, {FLAGS.batch} samples/step/worker, "
        f"{FLAGS.epochs} epochs (first untimed for throughput), "
        f"{FLAGS.repeats} alternating repetitions"
    )
    print("workers pinned one per core, 1 intra-op thread; ps task and chief unpinned")
    print(
        f"\n{'config':>7s} {'workers':>7s} {'batch':>5s} {'applied/sched':>13s} | "
        f"{'samples/s median [min, max]':^27s} | "
        f"{f'secs to val acc >= {FLAGS.target:g}':^24s} | {'final val acc':^13s}"
    )
    for name in configs:
        r = runs[name]
        ttas = [x["tta"] for x in r if x["tta"] is not None]
        tta = (
            (
                _harness.fmt_stats(ttas, 1)
                + ("" if len(ttas) == len(r) else f" ({len(r) - len(ttas)} missed)")
            )
            if ttas
            else "- (not reached)"
        )
        print(
            f"{name:>7s} {r[0]['workers']:>7d} {r[0]['batch']:>5d} "
            f"{str(r[0]['applied']) + '/' + str(r[0]['scheduled']):>13s} | "
            f"{_harness.fmt_stats([x['throughput'] for x in r], 0):^27s} | {tta:^24s} | "
            f"{_harness.fmt_stats([x['final_acc'] for x in r], 3):^13s}"
        )

    print(f"\n{'ratio (paired per repetition)':40s} {'median [min, max]':^22s}")
    rows = [
        ("async scaling ps2 / ps1 (throughput)", "ps2", "ps1", "throughput", False),
        ("ps2 / mw2 (throughput)", "ps2", "mw2", "throughput", False),
        ("ps1 / single (throughput)", "ps1", "single", "throughput", False),
        ("time to acc: mw2 / ps2 (>1: async faster)", "mw2", "ps2", "tta", True),
        ("time to acc: single / ps2", "single", "ps2", "tta", True),
    ]
    for label, a, b, key, _ in rows:
        if a not in runs or b not in runs:
            continue
        ratios = [
            x[key] / y[key] for x, y in zip(runs[a], runs[b]) if x[key] is not None and y[key]
        ]
        if ratios:
            print(f"{label:40s} {_harness.fmt_stats(ratios):^22s}")

    print(
        "\nstaleness: other steps applied between a step's weight read and its update "
        "(lower / upper bound, all steps of all repetitions)"
    )
    print(f"{'config':>7s} {'steps':>6s} | {'median':^9s} {'p90':^9s} {'max':^9s} {'mean':^11s}")
    for name in configs:
        if not name.startswith("ps"):
            continue
        parts = {}
        for bound in ("low", "high"):
            counts = [sum(x["hist"][bound][i] for x in runs[name]) for i in range(FLAGS.buckets)]
            parts[bound] = (sum(counts), _quantiles(counts))
        (n, lo), (_, hi) = parts["low"], parts["high"]
        print(
            f"{name:>7s} {n:>6d} | {lo[0]:>3d} / {hi[0]:<3d} {lo[1]:>3d} / {hi[1]:<3d} "
            f"{lo[2]:>3d} / {hi[2]:<3d} {lo[3]:>4.2f} / {hi[3]:<4.2f}"
        )
    bad = [
        n
        for n, rs in runs.items()
        for r in rs
        if r["applied"] < r["scheduled"]
        or not all(map(math.isfinite, r["val_acc"]))
        or r.get("counted", r["applied"]) != r["applied"]
    ]
    print(
        "\nproblems: "
        + (
            f"steps lost, miscounted or non-finite accuracy in {sorted(set(bad))}"
            if bad
            else "none"
        )
    )
    print(f"{load}; total time {watch.elapsed():.0f}s")
    return 0


def main(argv):
    return _harness.driver_or_worker(argv, run_worker, run_driver)


if __name__ == "__main__":
    app.run(main)

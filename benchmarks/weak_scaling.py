"""Weak scaling of `keras_distrib.DistributedModel.fit`: 1 worker vs 2 workers.

What it measures: training throughput (global samples / second) of an MLP
of about 1M parameters (256 -> 1024 -> 768 -> 10, SGD, sparse categorical
cross-entropy, synthetic numpy data from a fixed seed) with a fixed batch
of `--per_worker_batch` (256) samples per worker, so the global batch grows
with the workers. Every worker process is pinned to its own core
(`sched_setaffinity`, before TensorFlow is imported) and runs TensorFlow
with 1 intra-op thread, so "1 worker" is one core and "2 workers" two.

Configurations, each its own `keras-distrib launch`:

  single   strategy "single" (plain Keras step, our input pipeline) in one
           process on core 0: a one-worker baseline.
  mw1      strategy "multi_worker" with -n 1 (collectives over a group of
           one): shows what the multi-worker step costs by itself.
  mw2      strategy "multi_worker" with -n 2, one worker per core: the
           configuration under test (implementation "auto": the gradients
           go through shared memory, both workers being on this host).
  mw2ring  the same on TensorFlow's gRPC collectives (implementation
           "ring"), the path between hosts.
  raw1/2   the peer: a hand-written tf.distribute custom training loop
           (MultiWorkerMirroredStrategy, Keras optimizer doing the gradient
           all-reduce, one tf.function per step) with 1 and 2 workers; its
           efficiency raw2 / (2 x raw1) is what raw TF collectives allow here.
  indep2   the hardware ceiling: two raw1 processes at the same time, one
           per core, each a one-worker cluster of its own with its own data:
           no collective, nothing shared but the machine (caches, memory
           bus, the kernel). Its throughput is the sum of the two; what two
           workers lose here is lost to sharing the machine, not to
           communication: two workers running raw1's step cannot beat it.
  lock2    the lock-step reference: indep2's two processes, but after every
           step each waits for the other (one byte each way through named
           pipes), as every synchronous data-parallel step must, moving no
           data. What it loses against indep2 is the lock-step itself: each
           step lasts as long as the slower of the two workers' steps, which
           costs most on a machine whose cores run unevenly (a VM). A
           reference, not a bound: it is measured like the others, with
           their noise (mw2 has come out faster than lock2 in a run).

Efficiency, the figure the target is on, is honest: throughput(mw2) /
(2 x the FASTEST one-worker throughput measured in the same repetition),
the fastest being the best of single, mw1 and raw1 (those that ran);
the driver names which one it was. Target: >= 0.9 with 2
workers, judged on the median; "target met" or "TARGET NOT MET" is printed
and the exit code is 0 either way, unless --strict. The other ratios
(against single alone, against mw1, the peer's raw2 / (2 x raw1), ...) are
printed too, and with indep2 the ceiling: indep2 / (2 x fastest
one-worker), what two cores of this machine allow at all, and mw2 / indep2,
our efficiency against that ceiling; with lock2 the lock-step reference
lock2 / (2 x fastest one-worker), what raw1's step gets here when it waits
for both workers, and mw2 / lock2, what our all-reduce and step cost beyond
the lock-step (information only: the target stays the one above). All
ratios are paired per repetition; the configurations run alternately
(order rotated every repetition) `--repeats` times. Each run fits
`--epochs` epochs of `--steps` steps with `verbose=0`; the first epoch
(tracing, warm-up) is dropped, and a run's epoch time is the median over
the rest of the slowest rank's epoch (timed by a Keras callback,
on_epoch_begin/on_epoch_end). Strategy "single" is a one-core baseline
that is itself faster than plain `keras.Model.fit` on arrays (see
benchmarks/overhead.py), so it is a demanding baseline.

The measurements are saved as JSON (`--json`, default
benchmarks/results/weak_scaling.json), from which benchmarks/_plots.py draws
benchmarks/results/throughput_vs_workers.png. benchmarks/strong_scaling.py
runs this script's workers with a fixed global batch instead.

Run:
    python benchmarks/weak_scaling.py [--repeats 3] [--steps 40] [--epochs 4]
        [--bytes_per_pack 0] [--inter_op 2]
        [--configs single,mw1,mw2,mw2ring,raw1,raw2,indep2,lock2] [--quick] [--strict]
        [--json benchmarks/results/weak_scaling.json]
"""

from __future__ import annotations

import json
import math
import os
import socket
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from absl import app, flags  # noqa: E402

import _harness  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_enum(
    "strategy",
    "multi_worker",
    ["single", "multi_worker", "raw_tf", "independent", "lockstep"],
    "Worker only: the strategy to train with (independent: raw_tf in a "
    "one-worker cluster of its own, for indep2; lockstep: the same, "
    "waiting for the other processes after every step, for lock2).",
)
flags.DEFINE_string("implementation", "auto", "Worker only: multi_worker implementation=.")
flags.DEFINE_list(
    "configs",
    ["single", "mw1", "mw2", "mw2ring", "raw1", "raw2", "indep2", "lock2"],
    "Configurations to run (single, mw1, mw2, mw2ring, raw1, raw2, indep2, "
    "lock2); mw2 and one of single/mw1/raw1 are needed for our efficiency "
    "(against the fastest of those run), raw1 and raw2 for the peer's, "
    "indep2 and lock2 for the ceilings.",
)
flags.DEFINE_integer("repeats", 3, "Alternating repetitions of every configuration.")
flags.DEFINE_integer("per_worker_batch", 256, "Samples per worker per step.")
flags.DEFINE_integer("steps", 40, "Steps per epoch.")
flags.DEFINE_integer("epochs", 4, "Epochs per run; the first is not timed.")
flags.DEFINE_integer("input_dim", 256, "Input features.")
flags.DEFINE_list("hidden", ["1024", "768"], "Hidden layer widths.")
flags.DEFINE_integer("classes", 10, "Output classes.")
flags.DEFINE_integer(
    "bytes_per_pack", 0, "bytes_per_pack of the multi_worker strategy (0: one pack)."
)
# Inter-op threads: tried 1, 2, 3 and 4 with 1 intra-op thread (2 worker
# processes, one core each, TF 2.21): none deadlocked the collectives, which
# are asynchronous kernels waiting on gRPC's own threads rather than holding
# an inter-op thread. (The hang of docs/design.md section 1.2 is the in-process
# cluster, where all workers share one process's pool.) The step times of 1
# and 2 could not be told apart on the shared 2-core machine; 2 is the
# default because it leaves a second thread should any kernel block its
# thread, which with 1 could stall the step behind it.
flags.DEFINE_integer("inter_op", 2, "TensorFlow inter-op threads per worker.")
flags.DEFINE_integer("intra_op", 1, "TensorFlow intra-op threads per worker.")
flags.DEFINE_float("timeout", 120.0, "Seconds one run (launch) may take.")
flags.DEFINE_bool(
    "quick",
    False,
    "A minute or two, to test the chain: --repeats 1 --steps 10 "
    "--epochs 2 (flags given explicitly win).",
)
flags.DEFINE_bool("strict", False, "Exit with code 1 when a target is not met.")
flags.DEFINE_string(
    "json",
    os.path.join(_harness.RESULTS_DIR, "weak_scaling.json"),
    "Where the driver saves its measurements (empty: nowhere).",
)

# The one-worker configurations the efficiency is judged against (the fastest).
ONE_WORKER = ("single", "mw1", "raw1")
TARGET_EFFICIENCY = 0.9

_CONFIGS = {  # name -> (processes, strategy, multi_worker implementation)
    "single": (1, "single", "auto"),
    "mw1": (1, "multi_worker", "auto"),
    "mw2": (2, "multi_worker", "auto"),
    "mw2ring": (2, "multi_worker", "ring"),
    "raw1": (1, "raw_tf", "auto"),
    "raw2": (2, "raw_tf", "auto"),
    "indep2": (2, "independent", "auto"),
    "lock2": (2, "lockstep", "auto"),
}
# Strategies whose processes train independently: their throughputs add up.
INDEPENDENT = ("independent",)
# Strategies whose processes are one-worker clusters of their own that wait
# for each other every step: their batches add up, their pace is the slower's.
LOCKSTEP = ("lockstep",)


# ----------------------------------------------------------------------------
# Worker


def run_worker() -> None:
    rank = _harness.worker_rank()
    _harness.worker_setup(pin_core=rank)  # before TensorFlow sizes its pools
    import numpy as np
    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")
    tf.config.threading.set_intra_op_parallelism_threads(FLAGS.intra_op)
    tf.config.threading.set_inter_op_parallelism_threads(FLAGS.inter_op)
    import keras

    if FLAGS.strategy in ("raw_tf", "independent", "lockstep"):
        # The peer does not import keras_distrib (whose import would start the
        # collective runtime the peer's own strategy starts).
        _run_raw_tf_worker(
            rank,
            np,
            tf,
            keras,
            independent=FLAGS.strategy != "raw_tf",
            lockstep=FLAGS.strategy == "lockstep",
        )
        return
    import keras_distrib as kd

    if FLAGS.strategy == "single":
        strategy = kd.strategies.get("single")
    else:
        strategy = kd.strategies.get(
            "multi_worker", bytes_per_pack=FLAGS.bytes_per_pack, implementation=FLAGS.implementation
        )
    world = strategy.world_size
    global_batch = FLAGS.per_worker_batch * world
    samples = FLAGS.steps * global_batch

    rng = np.random.default_rng(0)
    x = rng.standard_normal((samples, FLAGS.input_dim), dtype=np.float32)
    y = rng.integers(0, FLAGS.classes, size=(samples,)).astype(np.int32)

    inputs = keras.Input((FLAGS.input_dim,))
    h = inputs
    for width in FLAGS.hidden:
        h = keras.layers.Dense(int(width), activation="relu")(h)
    outputs = keras.layers.Dense(FLAGS.classes)(h)
    model = kd.DistributedModel(inputs, outputs, strategy=strategy)
    model.compile(
        optimizer=keras.optimizers.SGD(learning_rate=0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )

    class EpochTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times, self._start = [], None

        def on_epoch_begin(self, epoch, logs=None):
            self._start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.times.append(time.perf_counter() - self._start)

    timer = EpochTimer()
    history = model.fit(
        x,
        y,
        batch_size=global_batch,
        epochs=FLAGS.epochs,
        verbose=0,
        shuffle=False,
        callbacks=[timer],
    )
    _harness.write_result(
        FLAGS.out_dir,
        rank,
        {
            "rank": rank,
            "world_size": world,
            "strategy": strategy.name,
            "implementation": getattr(strategy, "implementation", None),
            "params": int(model.count_params()),
            "global_batch": global_batch,
            "steps": FLAGS.steps,
            "epoch_times": timer.times,
            "loss": [float(v) for v in history.history["loss"]],
            "cpus": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "threads": [
                tf.config.threading.get_intra_op_parallelism_threads(),
                tf.config.threading.get_inter_op_parallelism_threads(),
            ],
        },
    )


def _run_raw_tf_worker(rank, np, tf, keras, independent=False, lockstep=False) -> None:
    """The peer: the custom loop a tf.distribute user writes by hand.

    `independent` (indep2): this process is raw1 on its own, in a one-worker
    cluster of its own (a port of its own), with its own data; its epochs
    start together with the other processes' (a barrier through files in
    --out_dir, outside the timed epoch), so that they really run at the same
    time. `lockstep` (lock2, with `independent`): besides, after every step
    it waits for the other processes' same step (`_PipeBarrier`).
    """
    processes = 1
    if independent:
        processes = int(os.environ.get("KERAS_DISTRIB_WORLD_SIZE", "1"))
        os.environ["TF_CONFIG"] = json.dumps(
            {
                "cluster": {"worker": [f"localhost:{_free_port()}"]},
                "task": {"type": "worker", "index": 0},
            }
        )
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    world = strategy.num_replicas_in_sync
    rng = np.random.default_rng(rank if independent else 0)
    samples = FLAGS.steps * FLAGS.per_worker_batch * world
    x = rng.standard_normal((samples, FLAGS.input_dim), dtype=np.float32)
    y = rng.integers(0, FLAGS.classes, size=(samples,)).astype(np.int32)
    x, y = x[rank::world], y[rank::world]  # this worker's share
    batches = [
        (
            tf.constant(x[i : i + FLAGS.per_worker_batch]),
            tf.constant(y[i : i + FLAGS.per_worker_batch]),
        )
        for i in range(0, len(x), FLAGS.per_worker_batch)
    ]
    with strategy.scope():
        inputs = keras.Input((FLAGS.input_dim,))
        h = inputs
        for width in FLAGS.hidden:
            h = keras.layers.Dense(int(width), activation="relu")(h)
        model = keras.Model(inputs, keras.layers.Dense(FLAGS.classes)(h))
        optimizer = keras.optimizers.SGD(learning_rate=0.01)
        optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")

    @tf.function
    def step(xb, yb):
        def replica(xb, yb):
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, model(xb, training=True)) / (FLAGS.per_worker_batch * world)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))  # all-reduces
            return loss

        return strategy.reduce("SUM", strategy.run(replica, args=(xb, yb)), axis=None)

    barrier = _PipeBarrier(FLAGS.out_dir, rank, processes) if lockstep else None
    times, losses = [], []
    for epoch in range(FLAGS.epochs):
        if independent:
            _file_barrier(FLAGS.out_dir, f"epoch{epoch}", rank, processes)
        start = time.perf_counter()
        for xb, yb in batches:
            loss = step(xb, yb)  # returns once the step has run (eager)
            if barrier:
                barrier.wait()
        losses.append(float(loss))
        times.append(time.perf_counter() - start)
    _harness.write_result(
        FLAGS.out_dir,
        rank,
        {
            "rank": rank,
            "world_size": world,
            "strategy": FLAGS.strategy,
            "params": int(model.count_params()),
            "global_batch": FLAGS.per_worker_batch * world,
            "steps": FLAGS.steps,
            "epoch_times": times,
            "loss": losses,
            "cpus": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "threads": [
                tf.config.threading.get_intra_op_parallelism_threads(),
                tf.config.threading.get_inter_op_parallelism_threads(),
            ],
        },
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


class _PipeBarrier:
    """lock2's per-step barrier: one byte to every other process through its
    named pipe in `directory`, then one byte from each through our own. The
    launch's --timeout ends a run whose peer died."""

    def __init__(self, directory: str, rank: int, processes: int):
        self._peers = processes - 1
        path = os.path.join(directory, "lockstep.fifo{}")
        os.mkfifo(path.format(rank))
        # O_RDWR: opening a pipe never blocks waiting for the other end.
        self._mine = os.open(path.format(rank), os.O_RDWR)
        _file_barrier(directory, "lockstep", rank, processes)  # every pipe exists
        self._others = [os.open(path.format(r), os.O_RDWR) for r in range(processes) if r != rank]

    def wait(self) -> None:
        for fd in self._others:
            os.write(fd, b"x")
        received = 0
        while received < self._peers:
            received += len(os.read(self._mine, self._peers - received))


def _file_barrier(
    directory: str, name: str, rank: int, processes: int, timeout: float = 60.0
) -> None:
    """Returns once all `processes` ranks have called it with this `name`."""
    open(os.path.join(directory, f"{name}.barrier{rank}"), "w").close()
    deadline = time.monotonic() + timeout
    while not all(
        os.path.exists(os.path.join(directory, f"{name}.barrier{r}")) for r in range(processes)
    ):
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"indep2: barrier {name!r}: not all {processes} ranks arrived within {timeout:g}s"
            )
        time.sleep(0.001)


# ----------------------------------------------------------------------------
# Driver


def worker_args(strategy: str, implementation: str, per_worker_batch: int) -> list[str]:
    return [
        f"--strategy={strategy}",
        f"--implementation={implementation}",
        f"--per_worker_batch={per_worker_batch}",
        f"--steps={FLAGS.steps}",
        f"--epochs={FLAGS.epochs}",
        f"--input_dim={FLAGS.input_dim}",
        f"--hidden={','.join(FLAGS.hidden)}",
        f"--classes={FLAGS.classes}",
        f"--bytes_per_pack={FLAGS.bytes_per_pack}",
        f"--inter_op={FLAGS.inter_op}",
        f"--intra_op={FLAGS.intra_op}",
    ]


def run_config(name: str, per_worker_batch: int | None = None) -> dict:
    """One launch of configuration `name`; its epoch time and throughput.

    `per_worker_batch`: samples per worker per step (default
    `--per_worker_batch`); strong_scaling.py passes global batch / workers.
    """
    nproc, strategy, implementation = _CONFIGS[name]
    batch = FLAGS.per_worker_batch if per_worker_batch is None else per_worker_batch
    out_dir, _ = _harness.launch_workers(
        os.path.abspath(__file__),
        nproc,
        worker_args(strategy, implementation, batch),
        timeout=FLAGS.timeout,
    )
    results = _harness.read_results(out_dir, nproc)
    first = results[0]
    epochs = range(1, len(first["epoch_times"]))
    global_batch = first["global_batch"]
    if strategy in INDEPENDENT:
        # No collectives: each process trains on its own, so the throughputs
        # of the processes add up (epoch by epoch: their epochs start together).
        global_batch = sum(r["global_batch"] for r in results)
        throughput = statistics.median(
            sum(r["global_batch"] * r["steps"] / r["epoch_times"][e] for r in results)
            for e in epochs
        )
        epoch = global_batch * first["steps"] / throughput  # the pair's time per epoch
    else:
        if strategy in LOCKSTEP:
            global_batch = sum(r["global_batch"] for r in results)
        timed = [max(r["epoch_times"][e] for r in results) for e in epochs]
        epoch = _harness.stats(timed)[0]
        throughput = global_batch * first["steps"] / epoch
    return {
        "workers": nproc,
        "epoch": epoch,
        "step_ms": epoch / first["steps"] * 1e3,
        "throughput": throughput,
        "params": first["params"],
        "global_batch": global_batch,
        "loss": first["loss"],
        "cpus": [r["cpus"] for r in results],
        "threads": first["threads"],
    }


def print_config_table(runs: dict, configs) -> None:
    """One row per configuration: step time and throughput, median [min, max]."""
    print(
        f"\n{'config':>8s} {'workers':>7s} {'cores':>8s} {'global batch':>12s} | "
        f"{'step ms median [min, max]':^28s} | {'samples/s median [min, max]':^30s}"
    )
    for name in configs:
        r = runs[name]
        cores = ",".join(str(c) for cpus in r[0]["cpus"] for c in (cpus or ["?"]))
        print(
            f"{name:>8s} {_CONFIGS[name][0]:>7d} {cores:>8s} {r[0]['global_batch']:>12d} | "
            f"{_harness.fmt_stats([x['step_ms'] for x in r], 1):^28s} | "
            f"{_harness.fmt_stats([x['throughput'] for x in r], 0):^30s}"
        )


def configs_json(runs: dict) -> dict:
    """The per-configuration measurements, as saved in the results JSON."""
    return {
        name: {
            "workers": _CONFIGS[name][0],
            "strategy": _CONFIGS[name][1],
            "implementation": _CONFIGS[name][2],
            "global_batch": r[0]["global_batch"],
            "throughput": _harness.run_summary([x["throughput"] for x in r]),
            "step_ms": _harness.run_summary([x["step_ms"] for x in r]),
            "epoch_s": _harness.run_summary([x["epoch"] for x in r]),
            "loss": [x["loss"] for x in r],
        }
        for name, r in runs.items()
    }


def non_finite_losses(runs: dict) -> list[str]:
    return sorted(
        {n for n, rs in runs.items() for r in rs if not all(map(math.isfinite, r["loss"]))}
    )


def model_description(params: int) -> str:
    widths = "-".join([str(FLAGS.input_dim), *FLAGS.hidden, str(FLAGS.classes)])
    return f"MLP {widths} ({params:,} parameters)"


def measure(run_one) -> tuple:
    """Runs the chosen configurations alternately (`run_one(name)` launches
    one); returns `(stopwatch, load note, configs, runs)`, runs None if one
    failed. Shared with strong_scaling.py."""
    watch = _harness.Stopwatch()
    load = _harness.load_note()
    if FLAGS.quick:
        _harness.quick_defaults(repeats=1, steps=10, epochs=2)
    if FLAGS.epochs < 2:
        raise app.UsageError("--epochs must be >= 2 (the first epoch is not timed).")
    configs = _harness.chosen_configs(FLAGS.configs, _CONFIGS)
    return watch, load, configs, _harness.interleaved(configs, FLAGS.repeats, run_one)


def run_driver() -> int:
    watch, load, configs, runs = measure(run_config)
    if runs is None:
        return 1

    some = next(iter(runs.values()))[0]
    print(
        f"weak scaling: {model_description(some['params'])}, SGD, "
        f"{FLAGS.per_worker_batch} samples/worker/step, {FLAGS.steps} steps/epoch, "
        f"{FLAGS.epochs} epochs (first untimed), {FLAGS.repeats} alternating repetitions"
        + (" (--quick: for testing, not for reading)" if FLAGS.quick else "")
    )
    print(
        f"each worker pinned to one core, intra/inter-op threads {some['threads']}, "
        f"multi_worker bytes_per_pack={FLAGS.bytes_per_pack}"
    )
    print_config_table(runs, configs)

    print(f"\n{'ratio (paired per repetition)':44s} {'median [min, max]':^22s}")
    ratios = {}
    rows = [
        ("efficiency mw2 / (2 x single)", "mw2", "single", 2),
        ("efficiency mw2 / (2 x mw1)", "mw2", "mw1", 2),
        ("efficiency mw2ring / (2 x single)", "mw2ring", "single", 2),
        ("throughput mw1 / single", "mw1", "single", 1),
        ("throughput single / raw1", "single", "raw1", 1),
        ("peer: raw TF loop raw2 / (2 x raw1)", "raw2", "raw1", 2),
        ("our mw2 / peer raw2 (throughput)", "mw2", "raw2", 1),
        ("ceiling: indep2 / (2 x raw1)", "indep2", "raw1", 2),
        ("against the ceiling: mw2 / indep2", "mw2", "indep2", 1),
        ("against the ceiling: raw2 / indep2", "raw2", "indep2", 1),
        ("lock-step reference: lock2 / (2 x raw1)", "lock2", "raw1", 2),
        ("against the lock-step reference: mw2 / lock2", "mw2", "lock2", 1),
        ("lock-step cost: lock2 / indep2", "lock2", "indep2", 1),
    ]
    for label, a, b, scale in rows:
        if a in runs and b in runs:
            ratios[label] = _harness.paired_ratios(runs[a], runs[b], scale)
            print(f"{label:44s} {_harness.fmt_stats(ratios[label]):^22s}")
    if "mw2" in runs and "single" in runs:
        extra = [x["step_ms"] - y["step_ms"] for x, y in zip(runs["mw2"], runs["single"])]
        print(
            f"{'mw2 step - single step (ms)':44s} {_harness.fmt_stats(extra, 1):^22s}"
            f"  all-reduce of {some['params'] * 4 / 2**20:.1f} MB of float32 gradients, "
            "and two processes sharing the machine"
        )
    if "mw2" in runs and "indep2" in runs:
        # indep2's step: the time in which the pair trains 2 x per-worker batch.
        extra = [x["step_ms"] - y["step_ms"] for x, y in zip(runs["mw2"], runs["indep2"])]
        print(
            f"{'mw2 step - indep2 step (ms)':44s} {_harness.fmt_stats(extra, 1):^22s}"
            "  all-reduce, sync, and our step's cost over raw1's step"
        )

    # The target: against the fastest one-worker configuration of each repetition.
    misses, efficiency = [], None
    best, best_names = _harness.fastest_per_repetition(runs, ONE_WORKER)
    if "mw2" in runs and best:
        print(
            f"\nfastest one-worker configuration per repetition: "
            f"{_harness.name_counts(best_names)}  "
            f"(of {', '.join(c for c in ONE_WORKER if c in runs)})"
        )
        efficiency = _harness.paired_ratios(runs["mw2"], best, 2)
        line, met = _harness.target_line(
            "efficiency mw2 / (2 x fastest one-worker)", efficiency, TARGET_EFFICIENCY
        )
        print(line)
        # Information, not the target: the peer, and what two cores allow
        # with no communication at all (indep2) or in lock-step, moving no
        # data (lock2).
        references = [
            ("raw2", "peer: raw2 / (2 x fastest one-worker)", "", None),
            (
                "indep2",
                "ceiling: indep2 / (2 x fastest one-worker)",
                "  (no communication: the most two workers can reach here)",
                "the ceiling itself ({median:.3f}) is below the target {target:g}: "
                "two processes sharing this machine cannot reach it",
            ),
            (
                "lock2",
                "lock-step reference: lock2 / (2 x fastest one-worker)",
                "  (raw1's step, both workers waiting for each other every step, no data moved)",
                "the raw loop in lock-step ({median:.3f}) is itself below the target "
                "{target:g} in this run",
            ),
        ]
        for config, label, note, below in references:
            if config not in runs:
                continue
            ratios[label] = _harness.paired_ratios(runs[config], best, 2)
            print(f"{label:44s} {_harness.fmt_stats(ratios[label]):^22s}{note}")
            median = _harness.stats(ratios[label])[0]
            if below and median < TARGET_EFFICIENCY:
                print(f"{'':44s} " + below.format(median=median, target=TARGET_EFFICIENCY))
        if not met:
            misses.append(
                f"efficiency mw2 / (2 x fastest one-worker) = "
                f"{_harness.stats(efficiency)[0]:.2f} < {TARGET_EFFICIENCY}"
            )
    else:
        print(
            "\nefficiency against the fastest one-worker configuration needs mw2 and one of "
            f"{', '.join(ONE_WORKER)} in --configs: not judged"
        )
    bad = non_finite_losses(runs)
    if bad:
        misses.append(f"non-finite training loss in {bad}")
    print("\ntarget misses: " + ("; ".join(misses) if misses else "none"))
    print(f"{load}; total time {watch.elapsed():.0f}s")
    _harness.save_results(
        FLAGS.json,
        "weak_scaling",
        {
            "model": model_description(some["params"]),
            "params": some["params"],
            "per_worker_batch": FLAGS.per_worker_batch,
            "steps": FLAGS.steps,
            "epochs": FLAGS.epochs,
            "repeats": FLAGS.repeats,
            "threads": some["threads"],
            "configs": configs_json(runs),
            "ratios": {k: _harness.run_summary(v) for k, v in ratios.items()},
            "fastest_one_worker": best_names,
            "efficiency": None
            if efficiency is None
            else {
                **_harness.run_summary(efficiency),
                "target": TARGET_EFFICIENCY,
                "met": _harness.verdict(_harness.stats(efficiency)[0], TARGET_EFFICIENCY),
            },
            "misses": misses,
        },
        quick=FLAGS.quick,
        load=load,
    )
    return 1 if FLAGS.strict and misses else 0


def main(argv):
    return _harness.driver_or_worker(argv, run_worker, run_driver)


if __name__ == "__main__":
    app.run(main)

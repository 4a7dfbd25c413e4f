"""Horovod (Gloo) against TF collectives, 2 worker processes on this machine.

What it measures, per engine, through the keras_distrib strategy a user
would pick ("horovod" under `horovodrun --gloo`, "multi_worker" under
`keras-distrib launch`, both with default options):

  all-reduce   one SUM `Strategy.all_reduce(list, "sum")` inside a
               `tf.function` (the path `DistributedModel.reduce_gradients`
               takes), for single float32 tensors of 64 KB, 1 MB, 16 MB and
               64 MB, and for "many-small": the gradient list of 100 x
               Dense(64) (200 tensors of 16 KB and 256 B). Printed as bus
               bandwidth, bytes * 2(n-1)/n / time.
  train step   `DistributedModel.fit` of a 784-1024-256-10 MLP (1.07M
               parameters), SGD, global batch 512 (256 per rank), one epoch
               of --steps steps per repetition after a warm-up epoch; the
               median step, timed from each batch's begin to its end (a
               callback), the first batch of each fit left out.

Every timing starts after a barrier, runs k calls (k agreed by both ranks so
a timing lasts >= --min_timing_ms) and counts as the slower rank's time.
Each engine runs in its own launch (one collective runtime per process);
the engines alternate launches (--rounds of tf, hvd) and repetition i of
one is paired with repetition i of the other for the ratios. Ratios are
speed hvd/tf = t_tf / t_hvd (> 1: Horovod is faster), median [min, max].

Fairness: each worker pins itself to core (rank mod cores) before
TensorFlow starts, with one intra-op thread, under both engines. Absolute
numbers on a shared 2-core machine are noise; read the ratios.

Run:
    python benchmarks/horovod_vs_tf.py [--repeats 5] [--rounds 2]
        [--sizes 64K,1M,16M,64M] [--steps 12]
"""

from __future__ import annotations

import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from absl import app, flags  # noqa: E402

import _harness  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_enum("engine", "tf", ["tf", "hvd"], "Worker only: which engine to measure.")
flags.DEFINE_list(
    "sizes",
    ["64K", "1M", "16M", "64M"],
    "Single-tensor sizes (float32), with K/M suffixes (powers of 2).",
)
flags.DEFINE_integer("small_layers", 100, "Dense layers of the many-small case.")
flags.DEFINE_integer("small_width", 64, "Width of the many-small case's layers.")
flags.DEFINE_integer("repeats", 5, "Timings per case per launch (R).")
flags.DEFINE_integer("rounds", 2, "Launches per engine, alternating tf, hvd.")
flags.DEFINE_float("min_timing_ms", 50.0, "Each all-reduce timing lasts at least this.")
flags.DEFINE_integer(
    "steps", 12, "Training steps per timed epoch (the first is not timed).", lower_bound=2
)
flags.DEFINE_integer("batch", 512, "Global batch of the training step.")
flags.DEFINE_bool(
    "train_only",
    False,
    "Worker only: time the training step alone "
    "(no all-reduce cases), as benchmarks/multi_host.py does for compression.",
)
flags.DEFINE_integer(
    "bytes_per_pack",
    0,
    "Worker only, engine tf: multi_worker's bytes_per_pack (gradient buckets; 0: one all-reduce).",
)
flags.DEFINE_enum(
    "compression",
    "none",
    ["none", "fp16", "bf16"],
    "Worker only: the training step's gradients travel in this dtype (DistributedOptimizer).",
)
flags.DEFINE_enum(
    "implementation",
    "ring",
    ["ring", "tcp", "hierarchical"],
    "Worker only, engine tf: multi_worker's implementation (ring: TensorFlow's collectives).",
)
flags.DEFINE_float("timeout", 150.0, "Seconds one launch of the workers may take.")

NPROC = 2
ENGINES = ("tf", "hvd")
STRATEGY = {"tf": "multi_worker", "hvd": "horovod"}
_MAX_CALLS_PER_TIMING = 2000


def cases() -> list[tuple[str, list[tuple[int, ...]]]]:
    result = [
        (_harness.human(_harness.parse_size(t)), [(max(_harness.parse_size(t) // 4, 1),)])
        for t in FLAGS.sizes
    ]
    w = FLAGS.small_width
    result.append(("many-small", [(w, w), (w,)] * FLAGS.small_layers))
    return result


# ----------------------------------------------------------------------------
# Worker


def _rank_from_env() -> int:
    # keras-distrib launch sets KERAS_DISTRIB_RANK, horovodrun HOROVOD_RANK.
    return int(os.environ.get("KERAS_DISTRIB_RANK") or os.environ.get("HOROVOD_RANK") or 0)


def run_worker() -> None:
    rank = _rank_from_env()
    _harness.worker_setup(pin_core=rank)  # before TensorFlow starts
    import numpy as np
    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")
    tf.config.threading.set_intra_op_parallelism_threads(1)
    import keras

    import keras_distrib as kd

    engine = FLAGS.engine
    # TF's collectives, not our shared-memory path ("auto" on one host).
    options = (
        {"implementation": FLAGS.implementation, "bytes_per_pack": FLAGS.bytes_per_pack}
        if engine == "tf"
        else {}
    )
    strategy = kd.strategies.get(STRATEGY[engine], **options)
    assert strategy.rank == rank, (strategy.rank, rank)
    world = strategy.world_size

    def replicated(fn):
        # multi_worker: a replica function under tf.distribute; horovod: one
        # replica per process, the function runs as is.
        if engine == "tf":
            return tf.function(lambda: strategy.tf_strategy.run(fn))
        return tf.function(fn)

    barrier_fn = replicated(lambda: strategy.all_reduce([tf.constant(1.0)], "sum"))

    def agree_on_calls(seconds_per_call: float) -> int:
        # Both ranks must issue the same number of collectives.
        slowest = float(strategy.sync_sum([np.float64(seconds_per_call)])[0]) / world
        calls = math.ceil(FLAGS.min_timing_ms / 1e3 / max(slowest, 1e-6))
        return int(min(max(1, calls), _MAX_CALLS_PER_TIMING))

    wire: dict = {}  # bytes this host sent per call of the last timing of each function

    def timed(fn, calls: int) -> float:
        barrier_fn()
        sent = _tx_bytes()
        start = time.perf_counter()
        for _ in range(calls):
            out = fn()
        tf.nest.flatten(out)[0].numpy()  # wait for the last one
        seconds = (time.perf_counter() - start) / calls
        wire[fn] = (_tx_bytes() - sent) / calls
        return seconds

    report = {
        "rank": rank,
        "world_size": world,
        "engine": engine,
        "implementation": getattr(strategy, "implementation", None),
        "tf_version": tf.__version__,
        "cases": [],
    }
    rng = np.random.default_rng(0)
    for name, shapes in [] if FLAGS.train_only else cases():
        # Same base on every rank, scaled by rank + 1: the sum is known.
        bases = [rng.standard_normal(shape, dtype=np.float32) for shape in shapes]
        tensors = [tf.constant(b * (rank + 1)) for b in bases]
        fn = replicated(lambda tensors=tensors: strategy.all_reduce(list(tensors), "sum"))
        out = None
        for _ in range(3):  # trace + warm up
            out = fn()
        expected = world * (world + 1) / 2
        out = tf.nest.flatten(out)
        check = bool(
            len(out) == len(bases)
            and all(
                np.allclose(
                    o.numpy().ravel()[:4096], b.ravel()[:4096] * expected, rtol=1e-5, atol=1e-5
                )
                for o, b in zip(out, bases)
            )
        )
        calls = agree_on_calls(timed(fn, 1))
        times = [timed(fn, calls) for _ in range(FLAGS.repeats)]
        report["cases"].append(
            {
                "name": name,
                "bytes": int(sum(b.nbytes for b in bases)),
                "num_tensors": len(bases),
                "calls_per_timing": calls,
                "times": times,
                "wire_bytes": wire[fn],
                "check": check,
            }
        )
        del fn, tensors, bases, out

    # Training step: same data on every rank; fit shards it by rank.
    n = FLAGS.steps * FLAGS.batch
    x = rng.standard_normal((n, 784), dtype=np.float32)
    y = rng.integers(0, 10, size=n).astype("int32")
    keras.utils.set_random_seed(0)

    def mlp():
        inputs = keras.Input((784,))
        h = keras.layers.Dense(1024, activation="relu")(inputs)
        h = keras.layers.Dense(256, activation="relu")(h)
        return inputs, keras.layers.Dense(10)(h)

    class StepTimes(keras.callbacks.Callback):
        # Each batch from its begin to its end, the first of each fit (it
        # traces) left out: the step, without fit's set-up per call.
        def __init__(self):
            super().__init__()
            self.times = []

        def on_train_batch_begin(self, batch, logs=None):
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            if batch:
                self.times.append(time.perf_counter() - self.start)

    def median_step(fit_model, *args, **kwargs):
        timer = StepTimes()
        fit_model.fit(*args, epochs=1, shuffle=False, verbose=0, callbacks=[timer], **kwargs)
        return float(np.median(timer.times))

    model = kd.DistributedModel(*mlp(), strategy=strategy)
    plain = keras.Model(*mlp())  # this rank's computation alone: no all-reduce
    plain.compile(
        optimizer=keras.optimizers.SGD(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.compile(
        optimizer=kd.optimizers.DistributedOptimizer(
            keras.optimizers.SGD(0.01), compression=FLAGS.compression
        ),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(x, y, batch_size=FLAGS.batch, epochs=1, shuffle=False, verbose=0)  # warm-up
    step_times = []
    sent = _tx_bytes()
    for _ in range(FLAGS.repeats):
        barrier_fn()
        step_times.append(median_step(model, x, y, batch_size=FLAGS.batch))
    step_wire = (_tx_bytes() - sent) / (FLAGS.repeats * FLAGS.steps)
    # The step's parts alone: the computation (plain Keras on this rank's
    # share of the batch, timed as the step is) and the all-reduce of the
    # model's gradients.
    share = FLAGS.batch // world
    xs, ys = x[: FLAGS.steps * share], y[: FLAGS.steps * share]
    plain.fit(xs, ys, batch_size=share, epochs=1, shuffle=False, verbose=0)  # warm-up
    compute_times, comm_times = [], []
    wire_dtype = {"none": tf.float32, "fp16": tf.float16, "bf16": tf.bfloat16}
    gradients = [tf.zeros(w.shape, wire_dtype[FLAGS.compression]) for w in model.trainable_weights]
    reduce_fn = replicated(lambda: strategy.all_reduce(list(gradients), "sum"))
    # The first layer's gradients are the last the backward pass makes: no
    # computation is left to overlap their all-reduce, so compute + this is
    # the least a step can take however well the rest overlaps.
    tail_fn = replicated(lambda: strategy.all_reduce(list(gradients[:2]), "sum"))
    # The forward pass alone (plain Keras on this rank's share): no
    # gradient exists before it ends, so neither does anything to send.
    first_share = tf.constant(xs[:share])
    forward_fn = tf.function(lambda: plain(first_share, training=True))
    reduce_fn()  # trace + warm up
    tail_fn()
    forward_fn()
    tail_times, forward_times = [], []
    for _ in range(FLAGS.repeats):
        compute_times.append(median_step(plain, xs, ys, batch_size=share))
        comm_times.append(timed(reduce_fn, FLAGS.steps))
        tail_times.append(timed(tail_fn, FLAGS.steps))
        forward_times.append(timed(forward_fn, FLAGS.steps))
    report["train"] = {
        "params": int(model.count_params()),
        "times": step_times,
        "compute_times": compute_times,
        "comm_times": comm_times,
        "tail_times": tail_times,
        "forward_times": forward_times,
        "wire_bytes": step_wire,
        "comm_wire_bytes": wire[reduce_fn],
        "compression": FLAGS.compression,
        "final_weight_sum": float(sum(np.sum(w) for w in model.get_weights())),
    }
    barrier_fn()
    _harness.write_result(FLAGS.out_dir, rank, report)


def _tx_bytes() -> int:
    """Bytes this host's `eth0` has sent (a test bed host's link: both
    workers of a host count the same), 0 where it has none."""
    try:
        with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
            return int(f.read())
    except OSError:
        return 0


# ----------------------------------------------------------------------------
# Driver


def worker_args(engine: str) -> list[str]:
    return [
        f"--engine={engine}",
        f"--sizes={','.join(FLAGS.sizes)}",
        f"--small_layers={FLAGS.small_layers}",
        f"--small_width={FLAGS.small_width}",
        f"--repeats={FLAGS.repeats}",
        f"--min_timing_ms={FLAGS.min_timing_ms}",
        f"--steps={FLAGS.steps}",
        f"--batch={FLAGS.batch}",
    ]


def launch(engine: str) -> list[dict]:
    """One launch of the workers of `engine`; their results in rank order.

    tf: `keras-distrib launch -n 2`; hvd: `keras-distrib launch --backend
    horovod -n 2`, which runs `horovodrun --gloo -np 2 -H localhost:2`.
    The launcher stops them at `--timeout`.
    """
    backend = ["--backend", "horovod"] if engine == "hvd" else []
    try:
        out_dir, _ = _harness.launch_workers(
            os.path.abspath(__file__),
            NPROC,
            worker_args(engine),
            FLAGS.timeout,
            launch_flags=backend,
        )
    except _harness.WorkersFailed as failed:
        raise _harness.WorkersFailed(f"{engine}: {failed.args[0]}", failed.output) from None
    return _harness.read_results(out_dir, NPROC)


def print_table(runs: dict) -> None:
    first = runs["tf"][0][0]
    factor = 2 * (NPROC - 1) / NPROC
    many = first["cases"][-1]
    print(
        f"\nall-reduce, SUM, float32; {NPROC} processes; bus GB/s = bytes*2(n-1)/n/time; "
        f"many-small = {many['num_tensors']} tensors, {_harness.human(many['bytes'])}"
    )
    print(
        f"{'case':>10s} {'tensors':>7s} {'k tf/hvd':>10s} | {'bus GB/s (median)':^19s} | "
        f"{'speed hvd/tf':^22s} | check"
    )
    print(f"{'':>10s} {'':>7s} {'':>10s} | {'tf':>9s} {'hvd':>9s} | {'median [min, max]':^22s} |")
    for i, case in enumerate(first["cases"]):
        times = {
            e: [
                t
                for results in runs[e]
                for t in _harness.slowest_rank(results, lambda r, i=i: r["cases"][i]["times"])
            ]
            for e in ENGINES
        }
        bus = {e: [case["bytes"] * factor / t / 1e9 for t in times[e]] for e in ENGINES}
        ratio = [t / h for t, h in zip(times["tf"], times["hvd"])]
        ok = all(r["cases"][i]["check"] for e in ENGINES for rs in runs[e] for r in rs)
        ks = "/".join(str(runs[e][0][0]["cases"][i]["calls_per_timing"]) for e in ENGINES)
        print(
            f"{case['name']:>10s} {case['num_tensors']:>7d} {ks:>10s} | "
            + " ".join(f"{_harness.stats(bus[e])[0]:9.3f}" for e in ENGINES)
            + f" | {_harness.fmt_stats(ratio):^22s} | {'ok' if ok else 'WRONG'}"
        )
    times = {
        e: [
            t
            for results in runs[e]
            for t in _harness.slowest_rank(results, lambda r: r["train"]["times"])
        ]
        for e in ENGINES
    }
    ratio = [t / h for t, h in zip(times["tf"], times["hvd"])]
    train = first["train"]
    print(
        f"\ntraining step: MLP 784-1024-256-10 ({train['params'] / 1e6:.2f}M params), "
        f"SGD, global batch {FLAGS.batch}, {FLAGS.steps} steps per timed epoch"
    )
    print(f"{'':>10s} {'ms/step tf':>11s} {'ms/step hvd':>12s} | {'speed hvd/tf':^22s}")
    print(
        f"{'':>10s} {1e3 * _harness.stats(times['tf'])[0]:11.1f} "
        f"{1e3 * _harness.stats(times['hvd'])[0]:12.1f} | {_harness.fmt_stats(ratio):^22s}"
    )
    sums = {e: runs[e][0][0]["train"]["final_weight_sum"] for e in ENGINES}
    same = math.isclose(sums["tf"], sums["hvd"], rel_tol=1e-4, abs_tol=1e-3)
    print(
        f"(both engines end with the same weights: {'yes' if same else 'NO'}; "
        f"weight sums tf {sums['tf']:.5f}, hvd {sums['hvd']:.5f})"
    )


def run_driver() -> int:
    watch = _harness.Stopwatch()
    load = getattr(_harness, "load_note", lambda: "")()
    print(
        f"horovod vs tf: {NPROC} worker processes on {os.cpu_count()} cores, each pinned "
        f"to one core with 1 intra-op thread; {FLAGS.repeats} repetitions x {FLAGS.rounds} "
        "round(s); speed hvd/tf = t_tf / t_hvd (> 1: Horovod faster)"
    )
    runs: dict = {e: [] for e in ENGINES}
    for _ in range(FLAGS.rounds):
        for engine in ENGINES:
            t0 = time.perf_counter()
            try:
                runs[engine].append(launch(engine))
            except _harness.WorkersFailed as e:
                print(f"\n{e}; worker output:\n{e.output[-6000:]}", file=sys.stderr)
                return 1
            print(f"  {engine}: launch done in {time.perf_counter() - t0:.0f}s", flush=True)
    print_table(runs)
    print(
        f"\nTF {runs['tf'][0][0]['tf_version']}; total time {watch.elapsed():.0f}s"
        + (f"; {load}" if load else "")
    )
    return 0


def main(argv):
    return _harness.driver_or_worker(argv, run_worker, run_driver)


if __name__ == "__main__":
    app.run(main)

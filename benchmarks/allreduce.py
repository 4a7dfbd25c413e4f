"""All-reduce bus bandwidth between worker processes: keras_distrib vs raw TF.

What it measures: the time of one SUM all-reduce across `--nproc` (default
2) worker processes on this machine (strategy "multi_worker": TF collectives
over a gRPC ring on 127.0.0.1), for single float32 tensors of 4 KB, 64 KB,
1 MB, 16 MB, 64 MB, and for the gradient list of a deep narrow MLP
("many-small": `--small_layers` Dense(`--small_width`) layers, i.e. 200
tensors of 16 KB kernels and 256 B biases, 1.66 MB in all by default).
Printed as bus bandwidth, bytes * 2(n-1)/n / time (= bytes / time for 2
ranks), and as ratios ours/peer per repetition (median, min, max).

Variants, interleaved (order rotated every repetition) in the same worker
processes, on the same `tf.distribute.MultiWorkerMirroredStrategy`:

  raw      the peer: what a naive custom loop does, one
           `get_replica_context().all_reduce("sum", t, options=
           CommunicationOptions(bytes_per_pack=0, timeout_seconds=0))` call
           per tensor (no timeout, as a plain custom loop has none).
  batched  second peer: raw TF batched all-reduce of the whole list in one
           call with TF's default packing (one pack). TF merges call options
           over the strategy's and ignores bytes_per_pack=0 in a call, so
           "one pack" is asked for as bytes_per_pack=2**62, which packs
           exactly like the default 0.
  ours     the path `DistributedModel.reduce_gradients` takes:
           `Strategy.all_reduce(list, "sum")` on
           `strategies.get("multi_worker", bytes_per_pack=B,
           implementation=I)`. With `--implementation auto` (the default)
           all workers are on this host, so that is the shared-memory
           all-reduce (keras_distrib/collectives/host_allreduce.py, 0 TF collectives);
           `--implementation ring` measures our path on TF's collectives,
           `--implementation tcp` on our TCP ring
           (keras_distrib/collectives/tcp_ring.py; benchmarks/multi_host.py
           runs it across two hosts).

Each variant is a `tf.function` that `strategy.run`s the replica function,
called k times back to back per timing (k agreed by all ranks so each timing
is >= --min_timing_ms); every timing starts after a barrier and counts as
the slowest rank's time. One launch of the workers per `--bytes_per_pack`
value (a strategy's packing is fixed when it is built).

Targets (from the issue): ours >= raw on every size, >= 1.5x raw on
many-small. Misses are flagged in the last column. Absolute numbers on a
shared 2-core machine are noise; read the ratios.

The measurements (every timing, as the slowest rank's, and the bus
bandwidths) are saved as JSON (`--json`, default
benchmarks/results/allreduce.json), from which benchmarks/_plots.py draws
benchmarks/results/allreduce_bandwidth.png.

Run:
    python benchmarks/allreduce.py [--repeats 7] [--bytes_per_pack 4194304,0]
        [--sizes 4K,64K,1M,16M,64M] [--nproc 2] [--pin] [--implementation auto|ring|shm|tcp]
        [--quick] [--json benchmarks/results/allreduce.json]
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
flags.DEFINE_integer("nproc", 2, "Worker processes.")
flags.DEFINE_list(
    "bytes_per_pack", ["4194304", "0"], "bytes_per_pack of our strategy; one launch per value."
)
flags.DEFINE_list(
    "sizes",
    ["4K", "64K", "1M", "16M", "64M"],
    "Single-tensor sizes (float32), with K/M suffixes (powers of 2).",
)
flags.DEFINE_integer("small_layers", 100, "Dense layers of the many-small case (2 tensors each).")
flags.DEFINE_integer("small_width", 64, "Width of the many-small case's layers.")
flags.DEFINE_integer("repeats", 7, "Interleaved timings per variant and case.")
flags.DEFINE_float(
    "min_timing_ms",
    50.0,
    "Each timing runs k calls, k chosen so the fastest variant's timing lasts at least this long.",
)
flags.DEFINE_bool("pin", False, "Pin worker r to core r (mod cores).")
flags.DEFINE_enum(
    "implementation",
    "auto",
    ["auto", "ring", "shm", "tcp"],
    "implementation= of our multi_worker strategy (auto: shared "
    "memory here, all workers being on this host).",
)
VARIANTS = ("raw", "batched", "ours")
flags.DEFINE_list(
    "variants",
    list(VARIANTS),
    "The variants the workers time, interleaved (benchmarks/multi_host.py times ours alone, as "
    "a job using our engine runs no TensorFlow collective beside it).",
)
flags.DEFINE_float("timeout", 150.0, "Seconds one launch of the workers may take.")
flags.DEFINE_bool(
    "quick",
    False,
    "About a minute, to test the chain: --repeats 3 "
    "--min_timing_ms 20 --sizes 4K,64K,1M,16M (flags given explicitly win).",
)
flags.DEFINE_string(
    "json",
    os.path.join(_harness.RESULTS_DIR, "allreduce.json"),
    "Where the driver saves its measurements (empty: nowhere).",
)

flags.register_validator(
    "variants",
    lambda names: bool(names) and set(names) <= set(VARIANTS),
    message=f"--variants takes some of {', '.join(VARIANTS)}",
)
_ONE_PACK = 2**62
_MAX_CALLS_PER_TIMING = 2000


def cases() -> list[tuple[str, list[tuple[int, ...]]]]:
    """(name, shapes) of every case, in the order they run."""
    result = []
    for text in FLAGS.sizes:
        nbytes = _harness.parse_size(text)
        result.append((_harness.human(nbytes), [(max(nbytes // 4, 1),)]))
    w = FLAGS.small_width
    result.append(("many-small", [(w, w), (w,)] * FLAGS.small_layers))
    return result


# ----------------------------------------------------------------------------
# Worker


def run_worker() -> None:
    rank = _harness.worker_rank()
    _harness.worker_setup(pin_core=rank if FLAGS.pin else None)
    import numpy as np
    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")
    import keras_distrib as kd

    bytes_per_pack = int(FLAGS.bytes_per_pack[0])
    strategy = kd.strategies.get(
        "multi_worker", bytes_per_pack=bytes_per_pack, implementation=FLAGS.implementation
    )
    tf_strategy = strategy.tf_strategy
    world = strategy.world_size
    SUM = tf.distribute.ReduceOp.SUM
    CommunicationOptions = tf.distribute.experimental.CommunicationOptions
    # timeout_seconds=0: no TensorFlow timeout, as in a plain custom loop
    # (our strategy's engine has one, whose thread per collective would
    # pile up here: keras_distrib/collectives/watchdog.py).
    per_tensor = CommunicationOptions(bytes_per_pack=0, timeout_seconds=0)
    one_pack = CommunicationOptions(bytes_per_pack=_ONE_PACK, timeout_seconds=0)

    @tf.function
    def all_sum_scalar(x):
        # identity: a function argument has no device, and TF's all-reduce
        # takes its destination from the value's device.
        return tf_strategy.run(
            lambda v: tf.distribute.get_replica_context().all_reduce(SUM, tf.identity(v)),
            args=(x,),
        )

    def barrier():
        all_sum_scalar(tf.constant(0.0))

    def agree_on_calls(seconds_per_call: float) -> int:
        # Every rank must issue the same number of collectives: derive k from
        # the all-reduced (hence identical) per-call time.
        total_us = float(all_sum_scalar(tf.constant(round(seconds_per_call * 1e6), tf.float32)))
        mean_s = max(total_us / world, 1.0) / 1e6
        return int(
            min(max(1, math.ceil(FLAGS.min_timing_ms / 1e3 / mean_s)), _MAX_CALLS_PER_TIMING)
        )

    def make_variant(name, tensors):
        if name == "raw":

            def replica_fn():
                ctx = tf.distribute.get_replica_context()
                return [ctx.all_reduce(SUM, t, options=per_tensor) for t in tensors]
        elif name == "batched":

            def replica_fn():
                ctx = tf.distribute.get_replica_context()
                return ctx.all_reduce(SUM, list(tensors), options=one_pack)
        else:

            def replica_fn():
                return strategy.all_reduce(list(tensors), "sum")

        return tf.function(lambda: tf_strategy.run(replica_fn))

    def count_collectives(fn) -> int:
        graph = fn.get_concrete_function().graph
        ops = [op for op in graph.get_operations()]
        for f in graph._functions.values():  # strategy.run may nest functions
            ops += list(f.graph.get_operations()) if hasattr(f, "graph") else []
        return sum(op.type.startswith("CollectiveReduce") for op in ops)

    def timed(fn, calls: int) -> float:
        barrier()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - start) / calls

    timed_variants = tuple(v for v in VARIANTS if v in FLAGS.variants)
    rng = np.random.default_rng(0)
    report = {
        "rank": rank,
        "world_size": world,
        "bytes_per_pack": bytes_per_pack,
        "implementation": strategy.implementation,
        # Which engine reduces, and why (with "auto": its probe's times).
        "engine_choice": str(strategy.engine_choice),
        "tf_version": tf.__version__,
        "cases": [],
    }
    for name, shapes in cases():
        # Same base values on every rank (same seed), scaled by rank + 1, so
        # the sum is base * world * (world + 1) / 2 on every rank.
        bases = [rng.standard_normal(shape, dtype=np.float32) for shape in shapes]
        tensors = [tf.constant(b * (rank + 1)) for b in bases]
        expected = world * (world + 1) / 2
        fns = {v: make_variant(v, tensors) for v in timed_variants}
        checks = {}
        for v, fn in fns.items():
            out = None
            for _ in range(3):  # trace + warm up
                out = fn()
            out = tf.nest.flatten(out)
            checks[v] = bool(
                len(out) == len(bases)
                and all(
                    np.allclose(o.numpy(), b * expected, rtol=1e-5, atol=1e-5)
                    for o, b in zip(out, bases)
                    if b.size <= 2**20
                )
                and np.allclose(
                    out[0].numpy().ravel()[:1024],
                    bases[0].ravel()[:1024] * expected,
                    rtol=1e-5,
                    atol=1e-5,
                )
            )
        collectives = {v: count_collectives(fn) for v, fn in fns.items()}
        calls = agree_on_calls(min(timed(fn, 1) for fn in fns.values()))
        times = {v: [] for v in timed_variants}
        for rep in range(FLAGS.repeats):
            shift = rep % len(timed_variants)
            for v in timed_variants[shift:] + timed_variants[:shift]:
                times[v].append(timed(fns[v], calls))
        report["cases"].append(
            {
                "name": name,
                "bytes": int(sum(b.nbytes for b in bases)),
                "num_tensors": len(bases),
                "calls_per_timing": calls,
                "collectives": collectives,
                "times": times,
                "checks": checks,
            }
        )
        del fns, tensors, bases
    barrier()
    _harness.write_result(FLAGS.out_dir, rank, report)


# ----------------------------------------------------------------------------
# Driver


def worker_args(bytes_per_pack: str) -> list[str]:
    return [
        f"--bytes_per_pack={bytes_per_pack}",
        f"--sizes={','.join(FLAGS.sizes)}",
        f"--small_layers={FLAGS.small_layers}",
        f"--small_width={FLAGS.small_width}",
        f"--repeats={FLAGS.repeats}",
        f"--min_timing_ms={FLAGS.min_timing_ms}",
        "--pin" if FLAGS.pin else "--nopin",
        f"--implementation={FLAGS.implementation}",
    ]


def print_table(results: list[dict]) -> tuple[list[str], dict]:
    """Prints one launch's table; returns the target misses and the launch's
    measurements (for the JSON)."""
    world = results[0]["world_size"]
    factor = 2 * (world - 1) / world
    bpp = results[0]["bytes_per_pack"]
    misses = []
    launch = {
        "bytes_per_pack": bpp,
        "implementation": results[0]["implementation"],
        "world_size": world,
        "tf_version": results[0]["tf_version"],
        "cases": [],
    }
    print(
        f"\nours: multi_worker implementation={results[0]['implementation']} "
        f"bytes_per_pack={bpp}; {world} workers; "
        f"{FLAGS.repeats} interleaved repetitions; TF {results[0]['tf_version']}"
    )
    print(
        f"{'case':>10s} {'tensors':>7s} {'collectives':>11s} {'k':>4s} | "
        f"{'bus GB/s (median)':^26s} | "
        f"{'ours/raw':^22s} | {'ours/batched':^22s} | check  target"
    )
    print(
        f"{'':>10s} {'':>7s} {'r/b/ours':>11s} {'':>4s} | "
        f"{'raw':>8s} {'batched':>8s} {'ours':>8s} | "
        f"{'median [min, max]':^22s} | {'median [min, max]':^22s} |"
    )
    for i, case in enumerate(results[0]["cases"]):
        per_rank = [r["cases"][i] for r in results]
        # A collective ends when the slowest rank does.
        times = {
            v: [max(c["times"][v][rep] for c in per_rank) for rep in range(FLAGS.repeats)]
            for v in VARIANTS
        }
        bus = {v: [case["bytes"] * factor / t / 1e9 for t in times[v]] for v in VARIANTS}
        vs_raw = [r / o for r, o in zip(times["raw"], times["ours"])]
        vs_batched = [b / o for b, o in zip(times["batched"], times["ours"])]
        ok = all(all(c["checks"].values()) for c in per_rank)
        want = 1.5 if case["name"] == "many-small" else 1.0
        med, _, hi = _harness.stats(vs_raw)
        target = f">={want:g}x " + ("ok" if med >= want else "MISS")
        if med < want:
            # One tensor: all three variants issue the same single collective,
            # so a median just under 1 with a range spanning 1 is noise.
            in_noise = hi >= want
            target += " (in noise)" if in_noise else ""
            misses.append(
                f"bytes_per_pack={bpp} {case['name']}: ours/raw {med:.3f} < {want:g}"
                + (" (in noise)" if in_noise else "")
            )
        if not ok:
            misses.append(f"bytes_per_pack={bpp} {case['name']}: wrong all-reduce result")
        launch["cases"].append(
            {
                "name": case["name"],
                "bytes": case["bytes"],
                "num_tensors": case["num_tensors"],
                "calls_per_timing": case["calls_per_timing"],
                "collectives": case["collectives"],
                "seconds": times,
                "bus_gbps": {v: _harness.run_summary(bus[v]) for v in VARIANTS},
                "ours_over_raw": _harness.run_summary(vs_raw),
                "ours_over_batched": _harness.run_summary(vs_batched),
                "checks_ok": ok,
            }
        )
        colls = "/".join(str(case["collectives"][v]) for v in VARIANTS)
        print(
            f"{case['name']:>10s} {case['num_tensors']:>7d} {colls:>11s} "
            f"{case['calls_per_timing']:>4d} | "
            + " ".join(f"{_harness.stats(bus[v])[0]:8.3f}" for v in VARIANTS)
            + f" | {_harness.fmt_stats(vs_raw):^22s} | {_harness.fmt_stats(vs_batched):^22s} | "
            f"{'ok' if ok else 'WRONG':5s}  {target}"
        )
    return misses, launch


def run_driver() -> int:
    if set(FLAGS.variants) != set(VARIANTS):
        print(
            "--variants is for the workers benchmarks/multi_host.py launches; this table "
            f"compares all of {', '.join(VARIANTS)}: leave it out",
            file=sys.stderr,
        )
        return 2
    watch = _harness.Stopwatch()
    load = _harness.load_note()
    if FLAGS.quick:
        _harness.quick_defaults(repeats=3, min_timing_ms=20.0, sizes=["4K", "64K", "1M", "16M"])
    script = os.path.abspath(__file__)
    print(
        f"all-reduce benchmark: {FLAGS.nproc} worker processes on {os.cpu_count()} cores; "
        "ratios > 1 mean ours is faster; k = calls per timing"
    )
    w, layers = FLAGS.small_width, FLAGS.small_layers
    print(
        f"many-small = {2 * layers} tensors, {_harness.human(layers * (w * w + w) * 4)}: "
        f"the kernels and biases of {layers} x Dense({w}); collectives = CollectiveReduce ops "
        "per call (raw/batched/ours)"
    )
    misses, launches = [], []
    for bpp in FLAGS.bytes_per_pack:
        try:
            out_dir, _ = _harness.launch_workers(
                script, FLAGS.nproc, worker_args(bpp), timeout=FLAGS.timeout
            )
        except _harness.WorkersFailed as e:
            print(f"\nbytes_per_pack={bpp}: {e}; worker output:\n{e.output}", file=sys.stderr)
            return 1
        launch_misses, launch = print_table(_harness.read_results(out_dir, FLAGS.nproc))
        misses += launch_misses
        launches.append(launch)
    print("\ntarget misses: " + ("; ".join(misses) if misses else "none"))
    if any("in noise" in m for m in misses):
        print(
            "(in noise: the median misses but the [min, max] range of the ratio "
            "reaches the target; for one tensor all variants run the same collective)"
        )
    print(f"{load}; total time {watch.elapsed():.0f}s")
    _harness.save_results(
        FLAGS.json,
        "allreduce",
        {
            "nproc": FLAGS.nproc,
            "repeats": FLAGS.repeats,
            "pin": FLAGS.pin,
            "variants": {
                "raw": "raw TF, one all_reduce per tensor",
                "batched": "raw TF, one batched all_reduce (one pack)",
                "ours": "keras_distrib Strategy.all_reduce",
            },
            "launches": launches,
            "misses": misses,
        },
        quick=FLAGS.quick,
        load=load,
    )
    return 0


def main(argv):
    return _harness.driver_or_worker(argv, run_worker, run_driver)


if __name__ == "__main__":
    app.run(main)

"""Our TCP ring alone, against the plain exchange of the same bytes, on two hosts.

`multi_host.py` sets the TCP ring's all-reduce, as the training step
calls it through the strategy, beside the link's ceiling (`sockets`: the
bytes a 2-rank ring all-reduce moves, exchanged over one plain TCP
connection). This benchmark splits the gap between the two, in one pair
of processes per run, one on each host of a rate-limited two-host bed
(network namespaces, tests/netns_hosts.py; needs root), each pinned to its
own core as `multi_host.py`'s workers are:

  sockets   the plain exchange (benchmarks/_sockets.py's): each process
            sends S/2 bytes while it receives S/2, twice, no reduction;
  engine    `TcpRing.all_reduce` of one float32 array of S bytes, called
            from NumPy (no TensorFlow in the call);
  in_step   the same call as the training step makes it: a
            `tf.numpy_function` op in a `tf.function`, its input a tensor
            and its result handed back to TensorFlow, timed from the op
            before it to the op after it (both time stamps; the function
            meets the other process first, in an op of its own).

engine / sockets is what the reduction itself costs on the bed (its
additions, its segments, its sending thread), in_step / engine what the
hand-over between TensorFlow and the engine costs. On the bed the two hosts
share the machine's cores, so every byte the kernel copies and every
addition runs on the core the same process computes on.

Per size, `--repeats` alternating repetitions of the three, each the
median of `--calls` calls after a barrier; the slower process's time.
Bus bandwidth of a 2-rank all-reduce: S / time.

Run (as root):
    python benchmarks/tcp_engine.py [--rate 10gbit] [--sizes 16M,64M]
        [--repeats 5] [--calls 5] [--json PATH]
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import time

import numpy as np
from absl import app, flags

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
import _harness  # noqa: E402
import _sockets  # noqa: E402  (its --sizes, --repeats and --timeout are ours too)
import netns_hosts  # noqa: E402

FLAGS = flags.FLAGS
FLAGS.set_default("sizes", ["16M", "64M"])
FLAGS.set_default("repeats", 5)
flags.DEFINE_string("rate", "10gbit", "The link's rate (tc syntax).")
flags.DEFINE_integer("calls", 5, "Calls per measurement (their median is kept).")
flags.DEFINE_bool("quick", False, "Sizes 1M, 2 repetitions of 2 calls: to test the chain.")
flags.DEFINE_string(
    "json",
    os.path.join(_harness.RESULTS_DIR, "tcp_engine.json"),
    "Where the measurements are saved ('' to skip).",
)
flags.DEFINE_integer("rank", -1, "Worker only: this process's rank.")
flags.DEFINE_list("addresses", [], "Worker only: both hosts' addresses.")

KINDS = ("sockets", "engine", "in_step")
_RING_PORT, _SOCKET_PORT = 29411, 29412  # each host is a fresh namespace: free
_SECRET = b"tcp-engine-bench"


def _median_ms(run, calls: int, meet) -> float:
    """The median of `calls` timings of `run()`, each after `meet()` (a
    barrier); a `run` that returns its own time (seconds) is taken at its word."""
    times = []
    for _ in range(calls):
        meet()
        start = time.perf_counter()
        own = run()
        times.append(time.perf_counter() - start if own is None else float(own))
    return 1e3 * statistics.median(times)


def _in_step(tf, ring, one):
    """A `tf.function` that meets the other process, then all-reduces its
    input through `ring` as a training step does (a `tf.numpy_function` op),
    and returns the seconds from the op before it to the op after it: the
    engine's call, its scheduling and the hand-over of its input and result."""

    def stamp():
        return np.float64(time.perf_counter())

    @tf.function
    def run(value):
        tf.numpy_function(lambda: ring.all_reduce(one)[0], [], tf.float32, stateful=True)
        start = tf.numpy_function(stamp, [], tf.float64, stateful=True)
        tf.numpy_function(ring.all_reduce, [value], [tf.float32], stateful=True)
        return tf.numpy_function(stamp, [], tf.float64, stateful=True) - start

    return run


def _plain_connection(rank: int, addresses: list) -> socket.socket:
    if rank == 0:
        with socket.create_server(("0.0.0.0", _SOCKET_PORT)) as listener:
            listener.settimeout(FLAGS.timeout)
            sock, _ = listener.accept()
    else:
        deadline = time.monotonic() + FLAGS.timeout
        while True:
            try:
                sock = socket.create_connection((addresses[0], _SOCKET_PORT), timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    sock.settimeout(FLAGS.timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _worker(rank: int, addresses: list, sizes: list, repeats: int, calls: int) -> dict:
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    import tensorflow as tf

    from keras_distrib.collectives.tcp_ring import TcpRing

    ring = TcpRing(rank, 2, [(a, _RING_PORT) for a in addresses], _SECRET, timeout=60.0)
    sock = _plain_connection(rank, addresses)
    try:
        in_step = _in_step(tf, ring, np.ones(1, np.float32))
        cases = [_measure(tf, ring, sock, in_step, size, repeats, calls) for size in sizes]
    finally:
        sock.close()
        ring.close()
    return {"rank": rank, "cases": cases}


def _measure(tf, ring, sock, in_step, size: int, repeats: int, calls: int) -> dict:
    """The three measurements of `size` bytes, alternating, `repeats` times."""
    array = np.random.default_rng().standard_normal(size // 4, dtype=np.float32)
    tensor = tf.constant(array)
    out, into = bytearray(size // 2), bytearray(size // 2)
    one = np.ones(1, np.float32)

    def exchange() -> None:  # a reduce-scatter's bytes, then an all-gather's
        _sockets._exchange(sock, out, into)
        _sockets._exchange(sock, out, into)

    runs = {
        "sockets": exchange,
        "engine": lambda: ring.all_reduce(array) and None,
        "in_step": lambda: in_step(tensor).numpy(),  # it meets the other itself
    }
    meets = {kind: (lambda: ring.all_reduce(one)) for kind in KINDS}
    meets["in_step"] = lambda: None
    for kind, run in runs.items():  # warm: buffers grown, the function traced
        _median_ms(run, 2, meets[kind])
    measured: dict = {kind: [] for kind in KINDS}
    for _ in range(repeats):
        for kind in KINDS:
            measured[kind].append(_median_ms(runs[kind], calls, meets[kind]))
    return {"bytes": size, **measured}


def _run_workers(bed, sizes: list, repeats: int, calls: int) -> list:
    """Each process's measurements, one process on each of `bed`'s hosts."""
    argv = [
        sys.executable,
        os.path.abspath(__file__),
        f"--addresses={','.join(bed.addresses)}",
        f"--sizes={','.join(str(s) for s in sizes)}",
        f"--repeats={repeats}",
        f"--calls={calls}",
    ]
    return _harness.run_json_workers(
        [bed.on(rank, [*argv, f"--rank={rank}"]) for rank in range(2)], timeout=900
    )


def _ratio(gbps: dict, a: str, b: str) -> dict:
    """`a`'s rate over `b`'s, paired by repetition."""
    return _harness.run_summary([x / y for x, y in zip(gbps[a], gbps[b])])


def _summary(ranks: list, link: float) -> list:
    """Per size: per repetition, the slower rank's time of each kind, its
    bus bandwidth and fraction of the link, and the ratios of the same
    repetition."""
    found = []
    for i, case in enumerate(ranks[0]["cases"]):
        size = case["bytes"]
        slow = {
            k: _harness.slowest_rank(ranks, lambda r, i=i, k=k: r["cases"][i][k]) for k in KINDS
        }
        gbps = {k: [size / (ms * 1e6) for ms in v] for k, v in slow.items()}
        summary = _harness.run_summary
        found.append(
            {
                "bytes": size,
                "ms": {k: summary(v) for k, v in slow.items()},
                "gb_per_s": {k: summary(v) for k, v in gbps.items()},
                "of_link": {k: summary([g * 1e9 / link for g in v]) for k, v in gbps.items()},
                "ratios": {
                    "engine_over_sockets": _ratio(gbps, "engine", "sockets"),
                    "in_step_over_sockets": _ratio(gbps, "in_step", "sockets"),
                    "in_step_over_engine": _ratio(gbps, "in_step", "engine"),
                },
            }
        )
    return found


def _print(rate: str, cases: list) -> None:
    def fmt(s):
        return f"{s['median']:.2f} [{s['min']:.2f}, {s['max']:.2f}]"

    print(f"{rate} link, 2 hosts, one process each pinned to a core; bus bandwidth GB/s:")
    for case in cases:
        print(
            f"{case['bytes'] >> 20} MB: "
            + ", ".join(f"{k} {fmt(case['gb_per_s'][k])}" for k in KINDS)
        )
        print("  " + ", ".join(f"{k} {fmt(v)}" for k, v in case["ratios"].items()))


def main(argv) -> int:
    del argv
    sizes = [_harness.parse_size(s) for s in (["1M"] if FLAGS.quick else FLAGS.sizes)]
    repeats, calls = (2, 2) if FLAGS.quick else (FLAGS.repeats, FLAGS.calls)
    if FLAGS.rank >= 0:
        print(json.dumps(_worker(FLAGS.rank, FLAGS.addresses, sizes, repeats, calls)))
        return 0
    reason = netns_hosts.unavailable()
    if reason:
        raise app.UsageError(f"tcp_engine.py needs the two-host bed: {reason}")
    load = _harness.load_note()
    try:
        with netns_hosts.TestBed(2, rate=FLAGS.rate) as bed:
            ranks = _run_workers(bed, sizes, repeats, calls)
    except _harness.WorkersFailed as e:
        print(f"tcp_engine: {e}; worker output:\n{e.output[-6000:]}", file=sys.stderr)
        return 1
    cases = _summary(ranks, netns_hosts.bytes_per_second(FLAGS.rate))
    _print(FLAGS.rate, cases)
    _harness.save_results(
        FLAGS.json,
        "tcp_engine",
        {"rate": FLAGS.rate, "repeats": repeats, "calls": calls, "cases": cases},
        FLAGS.quick,
        load,
    )
    return 0


if __name__ == "__main__":
    app.run(main)

"""One worker of the TCP ring all-reduce tests (NumPy only, no TensorFlow).

Usage: tcp_reduce.py RANK PORTS SECRET OUT MODE [TIMEOUT [CONNECT_TIMEOUT [HOSTS UNREACHABLE]]]

PORTS: every worker's port on 127.0.0.1 (or on HOSTS, comma-separated,
by rank), comma-separated, by rank; UNREACHABLE: the ring's
`unreachable_after`;
SECRET: 32 hex digits. Segments are 4 KB here, so that small arrays
already cross several segments and the pipeline runs.

MODE:
  sums    all-reduces of mixed dtypes and sizes (host_reduce.inputs), a
          mean_by_count (host_reduce.mean_inputs), an all-gather and a
          reduce-scatter; writes every result to OUT (npz).
  exit    the last rank exits after the first all-reduce; the others
          try a second.
  stall   the last rank sleeps 2.5 s before the second all-reduce.
  pause   every rank writes OUT + ".ready" after the first all-reduce and
          waits for OUT's directory to hold "go" before the second (a
          test cuts a link meanwhile).
Errors are written to OUT + ".err" (type, message, and seconds the
failing call took).
"""

import os
import sys
import time
import types

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if "keras_distrib" not in sys.modules:
    # Register the package without running its __init__ (see host_reduce.py).
    _package = types.ModuleType("keras_distrib")
    _package.__path__ = [os.path.join(_ROOT, "keras_distrib")]
    sys.modules["keras_distrib"] = _package
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from keras_distrib.collectives import tcp_ring  # noqa: E402
from host_reduce import inputs, mean_inputs  # noqa: E402

tcp_ring.SEGMENT_BYTES = 4096


def tables(rank, world):
    rng = np.random.default_rng(70 + rank)
    return [
        rng.integers(-9, 9, size=(world, 1001)).astype(np.int32),
        rng.integers(-9, 9, size=(world, 3)).astype(np.int32),
    ]


def sums(ring, rank, world):
    out = {}
    for call in range(3):
        for i, r in enumerate(ring.all_reduce(*inputs(rank, call))):
            out[f"c{call}_{i}"] = r.copy()
    for i, r in enumerate(ring.mean_by_count(*mean_inputs(rank, 0))):
        out[f"m_{i}"] = r.copy()
    (out["strided"],) = ring.all_reduce(np.arange(40, dtype=np.float32)[::3] * (rank + 1))
    out["gather"] = ring.all_gather(np.arange(2 * 1500 + rank, dtype=np.int64)[-1500:])
    out["gather_empty"] = ring.all_gather(np.zeros((0, 3), np.float32))
    for i, r in enumerate(ring.reduce_scatter(*tables(rank, world))):
        out[f"rs_{i}"] = r
    return out


def main():
    rank, ports, secret, out_path, mode = sys.argv[1:6]
    rank = int(rank)
    timeout = None if len(sys.argv) <= 6 or sys.argv[6] == "none" else float(sys.argv[6])
    connect_timeout = float(sys.argv[7]) if len(sys.argv) > 7 else 20.0
    hosts = sys.argv[8].split(",") if len(sys.argv) > 8 else ["127.0.0.1"] * len(ports.split(","))
    unreachable = float(sys.argv[9]) if len(sys.argv) > 9 else None
    addresses = [(h, int(p)) for h, p in zip(hosts, ports.split(","))]
    world, last = len(addresses), len(addresses) - 1
    start = time.monotonic()
    try:
        ring = tcp_ring.TcpRing(
            rank,
            world,
            addresses,
            bytes.fromhex(secret),
            timeout,
            connect_timeout,
            unreachable_after=unreachable,
        )
        if mode == "sums":
            np.savez(out_path, **sums(ring, rank, world))
        else:
            x = np.arange(100_000, dtype=np.float32)
            ring.all_reduce(x)
            if rank == last and mode == "exit":
                os._exit(3)
            if rank == last and mode == "stall":
                time.sleep(2.5)
            if mode == "pause":
                open(out_path + ".ready", "w").close()
                go = os.path.join(os.path.dirname(out_path), "go")
                while not os.path.exists(go):
                    time.sleep(0.02)
            start = time.monotonic()
            ring.all_reduce(x)
        ring.close()
        ring.close()  # idempotent
    except Exception as e:
        with open(out_path + ".err", "w") as f:
            f.write(f"{type(e).__name__}: {e}\n{time.monotonic() - start:.2f}")
        sys.exit(1)


if __name__ == "__main__":
    main()

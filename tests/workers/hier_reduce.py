"""One worker of the hierarchical all-reduce tests (NumPy only, no TensorFlow).

Usage: hier_reduce.py RANK HOSTS JOB_ID PORTS SECRET DIRECTORY OUT MODE [TIMEOUT]

HOSTS: every worker's host name by rank, comma-separated (workers with one
name share memory; all run here); PORTS: every leader's port on
127.0.0.1, by host; SECRET: 32 hex digits. TCP segments are 4 KB, so that
small arrays cross several segments.

MODE:
  sums    all-reduces of mixed dtypes and sizes (host_reduce.inputs), a
          mean_by_count (host_reduce.mean_inputs), an all-gather and a
          reduce-scatter; writes every result to OUT (npz).
  exitR   rank R exits after the first all-reduce; the others try a second.
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
from keras_distrib.collectives import hierarchical, tcp_ring  # noqa: E402
from host_reduce import inputs, mean_inputs  # noqa: E402
from tcp_reduce import tables  # noqa: E402

tcp_ring.SEGMENT_BYTES = 4096


def sums(engine, rank, world):
    out = {}
    for call in range(3):
        for i, r in enumerate(engine.all_reduce(*inputs(rank, call))):
            out[f"c{call}_{i}"] = r.copy()
    for call in range(3):
        for i, r in enumerate(engine.mean_by_count(*mean_inputs(rank, call))):
            out[f"m{call}_{i}"] = r.copy()
    out["gather"] = engine.all_gather(np.arange(2 * 1500 + rank, dtype=np.int64)[-1500:])
    out["gather_bits"] = engine.all_gather(np.array([-0.0, np.nan, rank], np.float32))
    for i, r in enumerate(engine.reduce_scatter(*tables(rank, world))):
        out[f"rs_{i}"] = r
    return out


def main():
    rank, hosts, job, ports, secret, directory, out_path, mode = sys.argv[1:9]
    rank, hosts = int(rank), hosts.split(",")
    timeout = None if len(sys.argv) <= 9 or sys.argv[9] == "none" else float(sys.argv[9])
    addresses = [("127.0.0.1", int(p)) for p in ports.split(",")]
    start = time.monotonic()
    try:
        engine = hierarchical.HierarchicalAllReduce(
            rank, hosts, job, addresses, bytes.fromhex(secret), timeout, 20.0, directory=directory
        )
        if mode == "sums":
            np.savez(out_path, **sums(engine, rank, len(hosts)))
        else:
            x = np.arange(100_000, dtype=np.float32)
            engine.all_reduce(x)
            if mode == f"exit{rank}":
                os._exit(3)
            start = time.monotonic()
            engine.all_reduce(x)
        engine.close()
        engine.close()  # idempotent
    except Exception as e:
        with open(out_path + ".err", "w") as f:
            f.write(f"{type(e).__name__}: {e}\n{time.monotonic() - start:.2f}")
        sys.exit(1)


if __name__ == "__main__":
    main()

"""One worker of the shared-memory all-reduce tests (NumPy only, no TensorFlow).

Usage: host_reduce.py RANK WORLD JOB_ID DIRECTORY OUT MODE [TIMEOUT [CONNECT_TIMEOUT]]

MODE:
  sums     several all-reduces of mixed dtypes and growing sizes; writes
           every result to OUT (npz), and its address modulo 64 ("a...").
  means    mean_by_count of float32 gradients and a count (0 on some
           ranks, and 0 in total on the last call), then all_reduce of the
           same arrays (keys "s<call>_<i>"); writes the results.
  reuse    four all-reduces of the same arrays, each result dropped before
           the next call; writes the last results and every call's
           result addresses ("addresses").
  exit1    rank 1 exits after the first all-reduce; the others try a second.
  stall1   rank 1 sleeps 6 s before the second all-reduce.
  skewed   many all-reduces of large arrays, each followed by an
           all-gather of the first and a reduce-scatter of both (as
           [world, k] tables), while the last rank sleeps at random
           after each barrier (a reader slower than its peers); every
           worker checks every result against the sum (the stacked arrays)
           it computes itself and writes the calls that differ ("bad").
Errors are written to OUT + ".err" (type and message).
"""

import os
import sys
import time
import types

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if "keras_distrib" not in sys.modules:
    # Register the package without running its __init__, which imports
    # TensorFlow: these workers need only host_allreduce (and saving).
    _package = types.ModuleType("keras_distrib")
    _package.__path__ = [os.path.join(_ROOT, "keras_distrib")]
    sys.modules["keras_distrib"] = _package
from keras_distrib.collectives import host_allreduce  # noqa: E402


def inputs(rank, call):
    """Distinct values per rank and call; shapes depend only on the call."""
    rng = np.random.default_rng(1000 * call + rank)
    n = 1000 * (call + 1) + 7  # grows: the segment must be re-made
    return [
        rng.standard_normal((n, 3)).astype(np.float32),
        rng.integers(-50, 50, size=(5,)).astype(np.int64),
        rng.standard_normal(n // 2 + 1).astype(np.float16),
        rng.standard_normal((2, 2)).astype(np.float32),
        np.float32(rank + 1),  # a scalar, like the sample count
        np.zeros((0, 4), np.float32),
    ]


def sum_bound(terms, extra_roundings: int = 0):
    """How far a sum of `terms` (arrays of one float dtype, one per rank)
    added in any order in that dtype may be from the exact sum, elementwise:
    each of its additions rounds within eps/2 of its result, which is at
    most sum |terms|, so within (n - 1) * eps/2 * sum |terms| for n terms
    (as tests/float_bounds.reordered_sum, which needs TensorFlow);
    n * eps * sum |terms| bounds that and `extra_roundings` more
    operations on the sum (a scale, a division), each within eps of it."""
    dtype = np.asarray(terms[0]).dtype
    magnitude = sum(np.abs(np.asarray(t, np.float64)) for t in terms)
    return (len(terms) + extra_roundings) * float(np.finfo(dtype).eps) * magnitude


def mean_inputs(rank, call):
    """float32 "gradients" and a sample count last (all counts 0 on call 2)."""
    rng = np.random.default_rng(5000 * call + rank)
    count = [rank * 7 + 3, 0 if rank else 5, 0][call]
    return [
        rng.standard_normal((301, 3)).astype(np.float32),
        rng.standard_normal(11).astype(np.float32),
        np.float32(count),
    ]


def skewed_inputs(rank, call):
    rng = np.random.default_rng(9000 * call + rank)
    return [
        rng.standard_normal(300_001).astype(np.float32),
        rng.standard_normal(17).astype(np.float32),
    ]


def _table(flat, world):
    """The first `world * k` elements of `flat` as a `[world, k]` table."""
    k = flat.size // world
    return flat[: world * k].reshape(world, k)


def _skewed(reducer, rank, world):
    """Mode "skewed": returns the calls whose result was not the sum."""
    if rank == world - 1:
        barrier, rng = reducer._barrier, np.random.default_rng()

        def slow_barrier(*args, **kwargs):
            barrier(*args, **kwargs)
            time.sleep(rng.uniform(0, 0.002))  # the others run ahead

        reducer._barrier = slow_barrier
    calls = 40
    mine = [skewed_inputs(rank, call) for call in range(calls)]
    got = []
    for call in range(calls):
        got.append([np.copy(v) for v in reducer.all_reduce(*mine[call])])
        got[-1].append(reducer.all_gather(mine[call][0]))
        got[-1].append(reducer.reduce_scatter(*(_table(m, world) for m in mine[call])))
    bad = []
    for call in range(calls):  # checked afterwards: the calls follow each other closely
        per_rank = [skewed_inputs(r, call) for r in range(world)]
        *sums, gathered, blocks = got[call]
        for i, value in enumerate(sums):
            terms = [p[i] for p in per_rank]
            want = sum(np.asarray(t, np.float64) for t in terms)
            if not np.all(np.abs(value - want) <= sum_bound(terms)):
                bad.append(call)
        if not np.array_equal(gathered, np.stack([p[0] for p in per_rank])):
            bad.append(call)
        for i, block in enumerate(blocks):  # this rank's rows of the summed tables
            terms = [_table(p[i], world)[rank] for p in per_rank]
            want = sum(np.asarray(t, np.float64) for t in terms)
            if block.shape != want.shape or not np.all(np.abs(block - want) <= sum_bound(terms)):
                bad.append(call)
    return np.array(bad, np.int64)


def main():
    rank, world, job, directory, out, mode = sys.argv[1:7]
    timeout = float(sys.argv[7]) if len(sys.argv) > 7 and sys.argv[7] != "none" else None
    connect_timeout = float(sys.argv[8]) if len(sys.argv) > 8 else 20.0
    rank, world = int(rank), int(world)
    try:
        reducer = host_allreduce.HostAllReduce(
            rank, world, job, timeout=timeout, connect_timeout=connect_timeout, directory=directory
        )
        results = {}
        if mode == "reuse":
            addresses = []
            for call in range(4):
                reduced = reducer.all_reduce(*inputs(rank, 0))
                addresses.append([value.ctypes.data for value in reduced])
                if call < 3:
                    del reduced
            results = {f"c0_{i}": value for i, value in enumerate(reduced)}
            results["addresses"] = np.array(addresses, np.int64)
            reducer.close()
            np.savez(out, **results)
            return
        if mode == "skewed":
            results = {"bad": _skewed(reducer, rank, world)}
            reducer.close()
            np.savez(out, **results)
            return
        calls = {"sums": 4, "means": 3}.get(mode, 2)
        for call in range(calls):
            if call == 1 and rank == 1 and mode == "exit1":
                os._exit(3)
            if call == 1 and rank == 1 and mode == "stall1":
                time.sleep(6)
            if mode == "means":
                reduced = reducer.mean_by_count(*mean_inputs(rank, call))
                for i, value in enumerate(reducer.all_reduce(*mean_inputs(rank, call))):
                    results[f"s{call}_{i}"] = value
            else:
                reduced = reducer.all_reduce(*inputs(rank, call))
            for i, value in enumerate(reduced):
                results[f"c{call}_{i}"] = value
                results[f"a{call}_{i}"] = np.int64(value.ctypes.data % 64 if value.size else 0)
        reducer.close()
        np.savez(out, **results)
    except Exception as e:  # noqa: BLE001 - reported to the test
        with open(out + ".err", "w") as f:
            f.write(f"{type(e).__name__}: {e}")
        sys.exit(1)


if __name__ == "__main__":
    main()

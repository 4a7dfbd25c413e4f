"""The shared-memory all-reduce alone, against what memory allows, on one host.

`weak_scaling.py` times whole training steps: `mw2` (two workers reducing
their gradients over shared memory) against `indep2` (two independent
workers, no communication) and `lock2` (the same two waiting for each other
after every step, no data). What `mw2` adds over `lock2` is the reduction
and our step's own cost. This benchmark isolates the reduction: two NumPy
processes (no TensorFlow), each pinned to its own core, in the same run:

  engine     `HostAllReduce.mean_by_count` of the weak-scaling MLP's
             gradients (256-1024-768-10: 1,058,058 float32, 4.2 MB, six
             arrays) plus the sample count, what the training step calls;
  numpy      the same bytes through a plain NumPy add-and-copy in each
             process at once (`np.add(a, b, out=c)` then `d[:] = c`): the
             least memory work summing two copies of the gradients and
             handing out the result takes, without any exchange;
  lock-step  `HostAllReduce.all_reduce` of one float32: the two barriers
             of a call and nothing else.

Printed per repetition and as medians [min, max]: ms per call, the engine's
rate (gradient bytes reduced per second, GB/s) beside NumPy's for the same
bytes, engine / numpy, and the engine's time less its lock-step.

Each measurement is the median of `--calls` back-to-back calls (both
processes start each batch of calls together); repetitions alternate the
three. Absolute times on a shared machine are noise; read the ratios.

Run:
    python benchmarks/host_engine.py [--repeats 5] [--calls 50] [--json PATH]
"""

from __future__ import annotations

import json
import os
import secrets
import statistics
import sys
import time

import numpy as np
from absl import app, flags

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _harness  # noqa: E402  (after the path)

FLAGS = flags.FLAGS
flags.DEFINE_integer("repeats", 5, "Alternating repetitions of the three measurements.")
flags.DEFINE_integer("calls", 50, "Back-to-back calls per measurement (their median is kept).")
flags.DEFINE_bool("quick", False, "2 repetitions of 10 calls: to test the chain.")
flags.DEFINE_string(
    "json",
    os.path.join(_harness.RESULTS_DIR, "host_engine.json"),
    "Where the measurements are saved ('' to skip).",
)
flags.DEFINE_integer("rank", -1, "Worker only: this process's rank.")
flags.DEFINE_string("job", "", "Worker only: the shared job id.")

# The weak-scaling MLP 256-1024-768-10: kernels and biases.
SHAPES = ((256, 1024), (1024,), (1024, 768), (768,), (768, 10), (10,))
KINDS = ("engine", "numpy", "lockstep")


def _gradients() -> list:
    rng = np.random.default_rng()
    return [rng.standard_normal(shape, dtype=np.float32) for shape in SHAPES]


def _median_ms(run, calls: int, meet) -> float:
    """The median of `calls` timings of `run()`, after `meet()` (a barrier)."""
    meet()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _worker(rank: int, job: str, repeats: int, calls: int) -> dict:
    from keras_distrib.collectives.host_allreduce import HostAllReduce

    os.sched_setaffinity(0, {rank % os.cpu_count()})
    grads = _gradients()
    count = np.array([256.0], np.float32)
    flat = np.concatenate([g.reshape(-1) for g in grads])
    other, summed, out = np.empty_like(flat), np.empty_like(flat), np.empty_like(flat)
    other[:] = flat
    one = np.ones(1, np.float32)
    host = HostAllReduce(rank, 2, job_id=job, timeout=60.0)
    try:

        def meet() -> None:
            host.all_reduce(one)

        runs = {
            "engine": lambda: host.mean_by_count(*grads, count),
            "numpy": lambda: (np.add(flat, other, out=summed), np.copyto(out, summed)),
            "lockstep": lambda: host.all_reduce(one),
        }
        for run in runs.values():  # warm: the segment made, the pages touched
            _median_ms(run, 3, meet)
        measured: dict = {kind: [] for kind in KINDS}
        for _ in range(repeats):
            for kind in KINDS:
                measured[kind].append(_median_ms(runs[kind], calls, meet))
        return {"nbytes": int(flat.nbytes), **measured}
    finally:
        host.close()


def _run_workers(repeats: int, calls: int) -> list:
    job = secrets.token_hex(16)
    argv = [
        sys.executable,
        os.path.abspath(__file__),
        f"--job={job}",
        f"--repeats={repeats}",
        f"--calls={calls}",
    ]
    return _harness.run_json_workers([[*argv, f"--rank={rank}"] for rank in range(2)], 600)


def _summary(ranks: list) -> dict:
    """Per repetition, the slower rank's time of each measurement, and the
    ratios of the same repetition."""
    nbytes = ranks[0]["nbytes"]
    slow = {k: _harness.slowest_rank(ranks, lambda r, k=k: r[k]) for k in KINDS}
    gbps = {k: [nbytes / (ms * 1e6) for ms in slow[k]] for k in ("engine", "numpy")}
    ratio = [e / n for e, n in zip(slow["engine"], slow["numpy"])]
    beyond = [e - s for e, s in zip(slow["engine"], slow["lockstep"])]
    return {
        "nbytes": nbytes,
        "ms": {k: _harness.run_summary(v) for k, v in slow.items()},
        "gb_per_s": {k: _harness.run_summary(v) for k, v in gbps.items()},
        "ratios": {
            "engine_over_numpy": _harness.run_summary(ratio),
            "engine_less_lockstep_ms": _harness.run_summary(beyond),
        },
    }


def _print(summary: dict) -> None:
    def fmt(s, digits=2):
        return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}, {s['max']:.{digits}f}]"

    print(f"gradients: {summary['nbytes'] / 1e6:.2f} MB float32, 2 processes, one core each")
    print(f"{'measurement':<12} {'ms per call':<24} GB/s")
    for kind in KINDS:
        rate = summary["gb_per_s"].get(kind)
        print(f"{kind:<12} {fmt(summary['ms'][kind]):<24} {fmt(rate) if rate else '-'}")
    print(f"engine / numpy: {fmt(summary['ratios']['engine_over_numpy'])}")
    print(f"engine less lock-step: {fmt(summary['ratios']['engine_less_lockstep_ms'])} ms")


def main(argv) -> None:
    del argv
    repeats, calls = (2, 10) if FLAGS.quick else (FLAGS.repeats, FLAGS.calls)
    if FLAGS.rank >= 0:
        print(json.dumps(_worker(FLAGS.rank, FLAGS.job, repeats, calls)))
        return
    load = _harness.load_note()
    summary = _summary(_run_workers(repeats, calls))
    _print(summary)
    _harness.save_results(
        FLAGS.json,
        "host_engine",
        {"repeats": repeats, "calls": calls, **summary},
        FLAGS.quick,
        load,
    )


if __name__ == "__main__":
    app.run(main)

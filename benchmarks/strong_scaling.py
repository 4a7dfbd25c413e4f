"""Strong scaling of `keras_distrib.DistributedModel.fit`: a fixed global batch on 1 and 2 workers.

What it measures: the time to train a fixed number of samples (`--steps`
steps of a fixed GLOBAL batch of `--global_batch` (512) samples, i.e. 40 x
512 = 20,480 samples per epoch by default) with the model of
benchmarks/weak_scaling.py (MLP 256-1024-768-10, SGD, synthetic data), the
batch split over the workers: 512 samples per step on one worker, 256 on
each of two. The same model, data and optimizer steps whatever the workers,
so the speedup is what a user with a fixed batch size gets from a second
worker. It reuses weak_scaling.py's workers and launch (`run_config` with
a per-worker batch of global batch / workers; its --per_worker_batch is
ignored here): every worker is its own process pinned to one core with 1
intra-op thread.

Configurations (weak_scaling.py's names), each its own
`keras-distrib launch`:

  single   strategy "single", one process on core 0, batch 512.
  mw1      strategy "multi_worker" with -n 1, batch 512.
  mw2      strategy "multi_worker" with -n 2, 256 per worker (shared-memory
           all-reduce, both workers on this host): the one under test.
  raw1/2   the peer: the hand-written tf.distribute custom loop
           (MultiWorkerMirroredStrategy) on 1 and 2 workers.
  mw2ring  (not run by default) mw2 on TensorFlow's gRPC collectives.
  indep2   (not run by default) the ceiling: two independent raw1 processes
           with 256 samples each at the same time, no communication (see
           weak_scaling.py); its speedup is what two cores allow at all.
  lock2    (not run by default) the lock-step reference: indep2's two
           processes waiting for each other after every step, no data moved
           (see weak_scaling.py).

Speedup = throughput(mw2) / throughput(fastest one-worker configuration of
the same repetition: best of single, mw1, raw1), paired per repetition over
`--repeats` alternating repetitions (order rotated); the ideal is 2.0. The
same for the peer (raw2). Epoch timing as in weak_scaling.py: the first
epoch is dropped, a run's epoch time is the median over the rest of the
slowest rank's epochs. No target is set for strong scaling (the issue has
none): --strict only fails on a non-finite loss.

Saved as JSON (`--json`, default benchmarks/results/strong_scaling.json);
benchmarks/_plots.py draws it as the second panel of
benchmarks/results/throughput_vs_workers.png.

Run:
    python benchmarks/strong_scaling.py [--global_batch 512] [--repeats 3]
        [--steps 40] [--epochs 4] [--configs single,mw1,mw2,raw1,raw2[,mw2ring,indep2,lock2]]
        [--quick] [--json benchmarks/results/strong_scaling.json]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from absl import app, flags  # noqa: E402

import _harness  # noqa: E402
import weak_scaling  # noqa: E402  (its flags: --repeats, --steps, --epochs, --configs, ...)

FLAGS = flags.FLAGS
flags.DEFINE_integer("global_batch", 512, "Samples per step, split evenly over the workers.")
FLAGS.set_default("configs", ["single", "mw1", "mw2", "raw1", "raw2"])
FLAGS.set_default("json", os.path.join(_harness.RESULTS_DIR, "strong_scaling.json"))

IDEAL_SPEEDUP = 2.0


def run_config(name: str) -> dict:
    workers = weak_scaling._CONFIGS[name][0]
    if FLAGS.global_batch % workers:
        raise app.UsageError(
            f"--global_batch {FLAGS.global_batch} does not split over {workers} workers."
        )
    return weak_scaling.run_config(name, per_worker_batch=FLAGS.global_batch // workers)


def run_driver() -> int:
    watch, load, configs, runs = weak_scaling.measure(run_config)
    if runs is None:
        return 1

    some = next(iter(runs.values()))[0]
    samples = FLAGS.steps * FLAGS.global_batch
    print(
        f"strong scaling: {weak_scaling.model_description(some['params'])}, SGD, global batch "
        f"{FLAGS.global_batch} split over the workers, {FLAGS.steps} steps = {samples:,} "
        f"samples/epoch, {FLAGS.epochs} epochs (first untimed), {FLAGS.repeats} alternating "
        "repetitions" + (" (--quick: for testing, not for reading)" if FLAGS.quick else "")
    )
    print(f"each worker pinned to one core, intra/inter-op threads {some['threads']}")
    weak_scaling.print_config_table(runs, configs)
    print(f"\n{'config':>8s} | seconds to train {samples:,} samples, median [min, max]")
    for name in configs:
        print(f"{name:>8s} | {_harness.fmt_stats([x['epoch'] for x in runs[name]], 3)}")

    ratios = {}
    best, best_names = _harness.fastest_per_repetition(runs, weak_scaling.ONE_WORKER)
    print(
        f"\n{'speedup (paired per repetition, ideal 2.0)':46s} {'median [min, max]':^22s}"
        "  efficiency"
    )
    rows = [
        ("mw2 / fastest one-worker", "mw2", best),
        ("peer: raw2 / fastest one-worker", "raw2", best),
        ("mw2 / mw1", "mw2", runs.get("mw1")),
        ("mw2 / single", "mw2", runs.get("single")),
        ("peer: raw2 / raw1", "raw2", runs.get("raw1")),
        ("mw2ring / fastest one-worker", "mw2ring", best),
        ("ceiling: indep2 / fastest one-worker", "indep2", best),
        ("lock-step reference: lock2 / fastest one-worker", "lock2", best),
    ]
    for label, a, base in rows:
        if a in runs and base:
            ratios[label] = _harness.paired_ratios(runs[a], base)
            eff = [r / IDEAL_SPEEDUP for r in ratios[label]]
            print(
                f"{label:46s} {_harness.fmt_stats(ratios[label]):^22s}  {_harness.fmt_stats(eff)}"
            )
    if "mw2" in runs and "indep2" in runs:
        label = "against the ceiling: mw2 / indep2"
        ratios[label] = _harness.paired_ratios(runs["mw2"], runs["indep2"])
        print(f"{label + ' (ideal 1.0)':46s} {_harness.fmt_stats(ratios[label]):^22s}")
    if "mw2" in runs and "lock2" in runs:
        label = "against the lock-step reference: mw2 / lock2"
        ratios[label] = _harness.paired_ratios(runs["mw2"], runs["lock2"])
        print(f"{label:46s} {_harness.fmt_stats(ratios[label]):^22s}")
    if best:
        print(
            f"fastest one-worker configuration per repetition: {_harness.name_counts(best_names)}"
        )
    speedup = ratios.get("mw2 / fastest one-worker")
    if speedup:
        print(
            f"speedup of 2 workers (mw2) over the fastest one worker: "
            f"{_harness.stats(speedup)[0]:.2f} (ideal {IDEAL_SPEEDUP:.1f}; no target set)"
        )
    misses = []
    bad = weak_scaling.non_finite_losses(runs)
    if bad:
        misses.append(f"non-finite training loss in {bad}")
    print("\nproblems: " + ("; ".join(misses) if misses else "none"))
    print(f"{load}; total time {watch.elapsed():.0f}s")
    _harness.save_results(
        FLAGS.json,
        "strong_scaling",
        {
            "model": weak_scaling.model_description(some["params"]),
            "params": some["params"],
            "global_batch": FLAGS.global_batch,
            "samples_per_epoch": samples,
            "steps": FLAGS.steps,
            "epochs": FLAGS.epochs,
            "repeats": FLAGS.repeats,
            "threads": some["threads"],
            "configs": weak_scaling.configs_json(runs),
            "ratios": {k: _harness.run_summary(v) for k, v in ratios.items()},
            "fastest_one_worker": best_names,
            "speedup": (
                None if not speedup else {**_harness.run_summary(speedup), "ideal": IDEAL_SPEEDUP}
            ),
            "misses": misses,
        },
        quick=FLAGS.quick,
        load=load,
    )
    return 1 if FLAGS.strict and misses else 0


def main(argv):
    # The workers are weak_scaling.py's (run_config launches that script).
    return _harness.driver_or_worker(argv, weak_scaling.run_worker, run_driver)


if __name__ == "__main__":
    app.run(main)

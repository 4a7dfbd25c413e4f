"""benchmarks/multi_host.py --layout 2x2: two hosts of two workers each, the
hierarchical all-reduce against flat rings (see multi_host.py's docstring).

Each implementation of `multi_worker` runs in its own launch of
benchmarks/horovod_vs_tf.py's workers on the same test bed: TensorFlow's
ring (`ring`), our TCP ring through all four workers (`tcp`) and the
hierarchical all-reduce (`hierarchical`). A timing counts as its slowest
worker's; the bytes a host sent are read from its link's counter by its
workers (both see the same), the larger of the two taken.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import _harness  # noqa: E402
import netns_hosts  # noqa: E402

HVT = os.path.join(HERE, "horovod_vs_tf.py")
IMPLEMENTATIONS = ("ring", "tcp", "hierarchical")
SLOTS = 2  # workers per host
DEFAULT_SIZES = ["4M", "64M"]


def _args(flags, implementation: str, sizes: list) -> list[str]:
    return [
        "--engine=tf",
        f"--implementation={implementation}",
        f"--sizes={','.join(sizes)}",
        "--small_layers=2",
        f"--repeats={flags.repeats}",
        f"--steps={flags.steps}",
        f"--batch={flags.batch}",
        f"--bytes_per_pack={flags.bytes_per_pack}",
    ]


def _host_bytes(reports, read) -> float:
    """The bytes a host sent, the most of any host (each host's workers read
    one counter: the larger reading)."""
    per_host: dict = {}
    for report in reports:
        host = report["rank"] // SLOTS
        per_host[host] = max(per_host.get(host, 0.0), read(report))
    return max(per_host.values())


def _check(runs: dict) -> None:
    for implementation, reports in runs.items():
        for report in reports:
            ok = report["implementation"] == implementation and all(
                c["check"] for c in report["cases"]
            )
            if not ok:
                raise _harness.WorkersFailed(
                    f"rank {report['rank']}: asked {implementation}, ran "
                    f"{report['implementation']!r}; checks {[c['check'] for c in report['cases']]}",
                    "",
                )


def measure(flags, launch, rate: str, sizes: list) -> dict:
    with netns_hosts.TestBed(2, rate=rate) as bed:
        runs = {i: launch(HVT, _args(flags, i, sizes), bed, slots=SLOTS) for i in IMPLEMENTATIONS}
    _check(runs)
    median = lambda values: _harness.stats(values)[0]  # noqa: E731
    cases = []
    for k, case in enumerate(runs["ring"][0]["cases"]):
        cases.append(
            {
                "name": case["name"],
                "bytes": case["bytes"],
                "seconds": {
                    i: median(_harness.slowest_rank(r, lambda x, k=k: x["cases"][k]["times"]))
                    for i, r in runs.items()
                },
                "host_bytes": {
                    i: _host_bytes(r, lambda x, k=k: x["cases"][k]["wire_bytes"])
                    for i, r in runs.items()
                },
            }
        )
    train = {
        i: {
            "step": median(_harness.slowest_rank(r, lambda x: x["train"]["times"])),
            "comm": median(_harness.slowest_rank(r, lambda x: x["train"]["comm_times"])),
            "host_bytes_per_step": _host_bytes(r, lambda x: x["train"]["wire_bytes"]),
            "comm_host_bytes": _host_bytes(r, lambda x: x["train"]["comm_wire_bytes"]),
        }
        for i, r in runs.items()
    }
    return {"rate": rate, "allreduce": cases, "train": train}


def report(results: list[dict]) -> None:
    names = " ".join(f"{i:>12s}" for i in IMPLEMENTATIONS)
    print("\n2 hosts x 2 workers: all-reduce ms | MB each host sent per all-reduce")
    print(f"{'link':>7s} {'size':>10s} | {names} | {names}")
    for result in results:
        for case in result["allreduce"]:
            ms = " ".join(f"{1e3 * case['seconds'][i]:12.1f}" for i in IMPLEMENTATIONS)
            mb = " ".join(f"{case['host_bytes'][i] / 1e6:12.2f}" for i in IMPLEMENTATIONS)
            print(f"{result['rate']:>7s} {case['name']:>10s} | {ms} | {mb}")
    print("\ntraining step (4.3 MB of gradients): step ms | MB each host sent per step")
    for result in results:
        ms = " ".join(f"{1e3 * result['train'][i]['step']:12.1f}" for i in IMPLEMENTATIONS)
        mb = " ".join(
            f"{result['train'][i]['host_bytes_per_step'] / 1e6:12.2f}" for i in IMPLEMENTATIONS
        )
        print(f"{result['rate']:>7s} {'step':>10s} | {ms} | {mb}")


def run(flags, launch) -> int:
    sizes = flags.sizes if flags["sizes"].present else DEFAULT_SIZES
    if flags.quick:
        _harness.quick_defaults(rates=["1gbit"], repeats=2, steps=4)
        sizes = flags.sizes if flags["sizes"].present else ["4M"]
    watch = _harness.Stopwatch()
    load = _harness.load_note()
    try:
        results = []
        for rate in flags.rates:
            results.append(measure(flags, launch, rate, sizes))
            print(f"  {rate}: done at {watch.elapsed():.0f}s", flush=True)
    except _harness.WorkersFailed as e:
        print(f"multi_host: {e}; worker output:\n{e.output[-6000:]}", file=sys.stderr)
        return 1
    report(results)
    print(f"\n{load}; total time {watch.elapsed():.0f}s")
    path = os.path.join(os.path.dirname(os.path.abspath(flags.json)), "multi_host_2x2.json")
    _harness.save_results(
        path if flags.json else "",
        "multi_host_2x2",
        {"repeats": flags.repeats, "batch": flags.batch, "slots": SLOTS, "results": results},
        quick=flags.quick,
        load=load,
    )
    return 0

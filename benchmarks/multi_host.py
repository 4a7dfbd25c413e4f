"""Two hosts joined by a rate-limited link: all-reduce against the wire, and
the training step against its parts.

The hosts are the test suite's (tests/netns_hosts.py): two Linux network
namespaces on a bridge, each link limited by a `tc` token bucket to
`--rates` (1 Gbit/s and 10 Gbit/s by default; the bucket holds 1 ms of the
rate, so a link idle during a step's computation sends no faster after it),
one worker per host, the launcher starting them through the bed's ssh
stand-in. Needs root.

What it measures, per link rate (the workers are benchmarks/
horovod_vs_tf.py's and benchmarks/allreduce.py's, so the cases are theirs):

  all-reduce   bus bandwidth (bytes * 2(n-1)/n / time) of one SUM all-reduce
               of a float32 tensor of each `--sizes`, as a fraction of the
               link rate, for: ours over TF's ring (`multi_worker`), ours
               over Horovod's Gloo (`horovod`, horovodrun run on host 0),
               ours over our TCP ring (`multi_worker`,
               `implementation="tcp"`), raw TensorFlow
               (`MultiWorkerMirroredStrategy`'s `all_reduce` per tensor, no
               keras_distrib; in a launch of its own, as the TCP ring's is:
               a job on our engine runs no TensorFlow collective beside
               it), and the link's ceiling: the same bytes over one plain
               TCP connection (benchmarks/_sockets.py), each side pinned
               to the core of its host's worker, as the ring's are (on the
               bed the hosts share the machine's cores, and an unpinned
               exchange varies widely from run to run); and ours on what
               `implementation="auto"` picks by its probe at start (among
               TF's collectives, our TCP ring and Horovod's Gloo), in a
               launch of its own, with the engine it picked. Goals: >= 0.8
               of the link from 4 MB; the TCP ring and auto's pick >= 0.9
               of the ceiling from 16 MB.
  train step   the 784-1024-256-10 MLP (1.07M parameters, 4.3 MB of
               gradients), global batch `--batch`, over TF's ring in buckets
               of `--bytes_per_pack`, then over our TCP ring in packs of
               that size (`tcp`) and in one pack after the backward pass
               (`tcp 1 pack`), against its parts measured alone in the
               same workers: compute (plain Keras `fit` on one worker's share
               of the batch), its forward pass, and communication (the
               all-reduce of the model's gradients). Steps are timed from
               each batch's begin to its end, the median over the epoch
               (fit's set-up left out). `step / max(compute, comm)` is 1
               when the all-reduce fully overlaps the computation and up to
               2 when they run one after the other. Two things overlap
               nothing: the first layer's gradient (3.2 MB of the 4.3) is
               made last, so its all-reduce follows the computation, and no
               gradient exists before the forward pass ends, so the whole
               all-reduce follows that. The table prints max(compute + that
               first all-reduce timed alone, forward + comm) / max(compute,
               comm) as `bound`: perfect overlap cannot go under it (goal:
               step <= 1.05 x bound x max(compute, comm)).
               With `--compressions`, the step again with gradients sent as
               fp16/bf16 (`DistributedOptimizer`; comm then times the
               all-reduce in that dtype).
  one host     the same step with both workers on one host (no link; TF's
               ring over loopback): the cost of the link.

With `--workers_per_host N` (N > 1), N workers on each host (one ring of 2N
ranks over TF's collectives, crossing the link once each way): only the
all-reduce over TF's ring (ours and raw TensorFlow) and the training step
are measured, for benchmarks/scaling_model.py's check beyond two ranks;
the results go to benchmarks/results/scaling/multi_host_2x{N}.json unless
`--json` says otherwise. Bus bandwidth is bytes * 2(n-1)/n / time for n
ranks, which is also what each direction of the link carries.
With `--layout 2x2`, two workers on each host instead (four in all), as on
nodes of several GPUs: ours over TensorFlow's ring, over our TCP ring
through all four workers, and over the hierarchical all-reduce (shared
memory within each host, a TCP ring between the hosts' first workers;
`implementation="hierarchical"`), each in its own launch of
benchmarks/horovod_vs_tf.py's workers: the all-reduce time of each
`--sizes` and the bytes each host sent per all-reduce (its link's
`tx_bytes` counter, read in its namespace), and the training step above
with the bytes each host sent per step. A flat ring over 4 workers, 2 per
host, sends 2(n-1)/n = 1.5 times each tensor's bytes out of each host;
the hierarchical one, whose ring has 2 members, 1 time. Results:
benchmarks/results/multi_host_2x2.json.

Each worker is pinned to a core with one intra-op thread (2 workers on the
2-core machine). Absolute times on a shared machine are noise; read the
fractions and ratios. Results: `--json` (default
benchmarks/results/multi_host.json).

Run (as root):
    python benchmarks/multi_host.py [--rates 1gbit,10gbit] [--repeats 3]
        [--sizes 64K,1M,4M,16M,64M] [--compressions fp16,bf16] [--quick]
        [--workers_per_host 1]
    python benchmarks/multi_host.py --layout 2x2 [--rates 1gbit,10gbit] [--quick]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from absl import app, flags  # noqa: E402

import _harness  # noqa: E402
import _two_by_two  # noqa: E402
import netns_hosts  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("rates", ["1gbit", "10gbit"], "Link rates (tc syntax: 1gbit, 500mbit).")
flags.DEFINE_list(
    "sizes", ["64K", "1M", "4M", "16M", "64M"], "All-reduce sizes (float32), with K/M suffixes."
)
flags.DEFINE_list("compressions", ["fp16", "bf16"], "Training-step compressions to time.")
flags.DEFINE_integer("repeats", 3, "Timings per case per launch.")
flags.DEFINE_integer(
    "steps", 8, "Training steps per timed epoch (the first is not timed).", lower_bound=2
)
flags.DEFINE_integer("batch", 512, "Global batch of the training step.")
flags.DEFINE_integer(
    "bytes_per_pack",
    1 << 20,
    "multi_worker's bytes_per_pack for the "
    "training step over the link: gradient buckets, the last layer's first "
    "(TensorFlow reverses the list before packing), so an all-reduce can "
    "start before the backward pass ends; 0: one all-reduce.",
)
flags.DEFINE_integer(
    "workers_per_host",
    1,
    "Workers on each of the two hosts; above 1, only the all-reduce over TF's ring "
    "and the training step are measured (see the module doc).",
    lower_bound=1,
)
flags.DEFINE_float("timeout", 400.0, "Seconds one launch of the workers may take.")
flags.DEFINE_enum(
    "layout",
    "1x2",
    ["1x2", "2x2"],
    "Workers per host x hosts: 1x2 (the comparisons above) or 2x2 (the hierarchical "
    "all-reduce against flat rings; --sizes default 4M,64M there).",
)
flags.DEFINE_bool(
    "quick",
    False,
    "A short run to test the chain: --rates 1gbit --repeats 2 "
    "--sizes 64K,4M --steps 4 --compressions fp16 (explicit flags win).",
)
flags.DEFINE_string(
    "json",
    os.path.join(_harness.RESULTS_DIR, "multi_host.json"),
    "Where to save the measurements (empty: nowhere).",
)

HVT = os.path.join(HERE, "horovod_vs_tf.py")
ALLREDUCE = os.path.join(HERE, "allreduce.py")
SOCKETS = os.path.join(HERE, "_sockets.py")


def link_bytes_per_second(rate: str) -> float:
    try:
        return netns_hosts.bytes_per_second(rate)
    except ValueError:
        raise app.UsageError(f"--rates entry {rate!r}: use kbit, mbit or gbit") from None


def _hvt_args(engine: str, **extra) -> list[str]:
    args = [
        f"--engine={engine}",
        f"--sizes={','.join(FLAGS.sizes)}",
        "--small_layers=2",
        f"--repeats={FLAGS.repeats}",
        f"--steps={FLAGS.steps}",
        f"--batch={FLAGS.batch}",
    ]
    if engine == "tf":
        args.append(f"--bytes_per_pack={FLAGS.bytes_per_pack}")
    return args + [f"--{k}={v}" for k, v in extra.items()]


def _run(script, args, bed=None, horovod=False, slots=None):
    """One launch of the workers: `slots` on each host of `bed` (default
    `--workers_per_host`), or 2 on this host; their reports."""
    per_host = (FLAGS.workers_per_host if slots is None else slots) if bed is not None else 1
    nproc = 2 * per_host
    flags_, prefix, env = [], [], None
    with tempfile.TemporaryDirectory(prefix="kd-ssh-") as ssh_dir:
        if bed is not None and horovod:  # horovodrun on host 0 reaches host 1 by ssh
            flags_ = ["--backend", "horovod", "--hosts", bed.hosts_flag(per_host)]
            prefix = bed.on(0, [])
            env = {"PATH": bed.ssh_program(ssh_dir) + os.pathsep + os.environ["PATH"]}
        elif bed is not None:
            flags_ = [
                "--hosts",
                bed.hosts_flag(per_host),
                "--ssh",
                "--ssh_command",
                bed.ssh_command,
            ]
        elif horovod:
            flags_ = ["--backend", "horovod"]
        out_dir, _ = _harness.launch_workers(
            script, nproc, args, FLAGS.timeout, extra_env=env, launch_flags=flags_, prefix=prefix
        )
    return _harness.read_results(out_dir, nproc)


def _sockets(bed) -> list[dict]:
    """The link's ceiling (benchmarks/_sockets.py): host 0 serves, host 1
    connects; the timings of each size, as the serving side measured them."""
    args = [f"--sizes={','.join(FLAGS.sizes)}", f"--repeats={FLAGS.repeats}"]
    # Each side pinned to the core its host's worker has (`--pin` below).
    server = subprocess.Popen(
        bed.on(0, [sys.executable, SOCKETS, "serve", *args, "--core=0"]),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        port = server.stdout.readline().strip()
        client = subprocess.run(
            bed.on(
                1,
                [
                    sys.executable,
                    SOCKETS,
                    "connect",
                    f"{bed.addresses[0]}:{port}",
                    *args,
                    "--core=1",
                ],
            ),
            capture_output=True,
            text=True,
            timeout=FLAGS.timeout,
        )
        out, err = server.communicate(timeout=FLAGS.timeout)
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate()
    if server.returncode or client.returncode:
        raise _harness.WorkersFailed(
            "the plain-socket exchange failed", err + client.stdout + client.stderr
        )
    return json.loads(out)["cases"]


def _allreduce_args(variant: str, implementation: str = "tcp") -> list[str]:
    """benchmarks/allreduce.py's flags timing `variant` alone (ours over
    `implementation`, the TCP ring by default, or raw TensorFlow's, whose
    launch then starts no engine of ours), each worker pinned to its core."""
    return [
        f"--sizes={','.join(FLAGS.sizes)}",
        "--small_layers=2",
        f"--repeats={FLAGS.repeats}",
        f"--variants={variant}",
        f"--implementation={implementation if variant == 'ours' else 'ring'}",
        "--bytes_per_pack=0",
        "--pin",
    ]


def _median(values) -> float:
    return _harness.stats(values)[0]


def measure(rate: str) -> dict:
    many = FLAGS.workers_per_host > 1
    with netns_hosts.TestBed(2, rate=rate) as bed:
        ring = _run(HVT, _hvt_args("tf"), bed)
        gloo = None if many else _run(HVT, _hvt_args("hvd"), bed, horovod=True)
        # Raw TF's all-reduce, then ours over the TCP ring in a launch of its
        # own: a job on our engine runs no TensorFlow collective beside it.
        raw, tcp = (_run(ALLREDUCE, _allreduce_args(variant), bed) for variant in ("raw", "ours"))
        # Right after the TCP ring, on the same load.
        sockets = None if many else _sockets(bed)
        # What "auto" picks, from the probe at its start, timed as a job runs it.
        auto = _run(ALLREDUCE, _allreduce_args("ours", "auto"), bed)
        compressed = {
            c: _run(HVT, _hvt_args("tf", train_only="true", compression=c), bed)
            for c in ([] if many else FLAGS.compressions)
        }
        # The step again on our TCP ring, its packs in the same sizes, and
        # in one pack (reduced after the backward pass).
        packings = [] if many else [("tcp", {}), ("tcp 1 pack", {"bytes_per_pack": 0})]
        tcp_train = {
            name: _run(HVT, _hvt_args("tf", train_only="true", implementation="tcp", **pack), bed)
            for name, pack in packings
        }
    _check_tcp(tcp)
    _check_sums(auto)
    wire = link_bytes_per_second(rate)
    ranks = len(ring)
    sizes = []
    for i, case in enumerate(ring[0]["cases"][: len(FLAGS.sizes)]):
        times = {
            "ours_ring": _harness.slowest_rank(ring, lambda r, i=i: r["cases"][i]["times"]),
            "raw_tf": _harness.slowest_rank(raw, lambda r, i=i: r["cases"][i]["times"]["raw"]),
            "ours_tcp": _harness.slowest_rank(tcp, lambda r, i=i: r["cases"][i]["times"]["ours"]),
            "ours_auto": _harness.slowest_rank(auto, lambda r, i=i: r["cases"][i]["times"]["ours"]),
        }
        if gloo is not None:
            times["ours_gloo"] = _harness.slowest_rank(gloo, lambda r, i=i: r["cases"][i]["times"])
        if sockets is not None:
            times["sockets"] = sockets[i]["times"]
        bus_bytes = case["bytes"] * 2 * (ranks - 1) / ranks
        fraction = {k: bus_bytes / _median(t) / wire for k, t in times.items()}
        sizes.append(
            {
                "name": case["name"],
                "bytes": case["bytes"],
                "seconds": {k: _median(t) for k, t in times.items()},
                "bus_fraction": fraction,
                "tcp_over_sockets": (
                    fraction["ours_tcp"] / fraction["sockets"] if "sockets" in fraction else None
                ),
                "auto_over_sockets": (
                    fraction["ours_auto"] / fraction["sockets"] if "sockets" in fraction else None
                ),
            }
        )
    return {
        "rate": rate,
        # "auto" is TensorFlow's collectives when it keeps them.
        "auto_engine": {"auto": "tensorflow"}.get(
            auto[0]["implementation"], auto[0]["implementation"]
        ),
        "auto_choice": auto[0].get("engine_choice"),
        "link_bytes_per_second": wire,
        "ranks": ranks,
        "allreduce": sizes,
        "train": _train(ring),
        "compressed": {c: _train(r) for c, r in compressed.items()},
        "train_tcp": {name: _train(r) for name, r in tcp_train.items()},
    }


def _check_tcp(reports) -> None:
    """The TCP ring's launch ran on it, and summed right."""
    _check_sums(reports, "tcp")


def _check_sums(reports, implementation: Optional[str] = None) -> None:
    """Every worker of a launch of ours summed right (on `implementation`,
    when given)."""
    for report in reports:
        cases = report["cases"]
        ran = report["implementation"]
        if implementation not in (None, ran) or not all(c["checks"]["ours"] for c in cases):
            raise _harness.WorkersFailed(
                f"rank {report['rank']}: implementation {ran!r}, checks "
                f"{[c['checks']['ours'] for c in cases]}",
                "",
            )


def _train(reports) -> dict:
    step, compute, comm, tail, forward = (
        _median(_harness.slowest_rank(reports, lambda r, k=k: r["train"][k]))
        for k in ("times", "compute_times", "comm_times", "tail_times", "forward_times")
    )
    return {
        "step": step,
        "compute": compute,
        "comm": comm,
        "tail": tail,
        "forward": forward,
        "step_over_max_parts": step / max(compute, comm),
        # Perfect overlap still leaves the first layer's all-reduce after
        # the computation, and the whole all-reduce after the forward pass.
        "bound": max(compute + tail, forward + comm) / max(compute, comm),
        "weight_sum": reports[0]["train"]["final_weight_sum"],
    }


_COLUMNS = (
    ("ours_ring", "ours/TF ring"),
    ("ours_gloo", "ours/Gloo"),
    ("ours_tcp", "ours/TCP ring"),
    ("ours_auto", "ours/auto"),
    ("raw_tf", "raw TF"),
    ("sockets", "sockets"),
)


def report(results: list[dict], one_host: Optional[dict]) -> None:
    print(
        "\nall-reduce bus bandwidth as a fraction of the link (goal >= 0.8 from 4 MB; "
        "the TCP ring >= 0.9 of sockets from 16 MB)"
    )
    measured = results[0]["allreduce"][0]["bus_fraction"]
    shown = [(k, name) for k, name in _COLUMNS if k in measured]
    ratios = [(k, n) for k, n in (("tcp", "TCP/sockets"), ("auto", "auto/sockets"))]
    ratios = [(k, n) for k, n in ratios if f"ours_{k}" in measured and "sockets" in measured]
    print(
        f"{'link':>7s} {'ranks':>5s} {'size':>7s} | "
        + " ".join(f"{n:>13s}" for _, n in shown)
        + "".join(f" | {n:>12s}" for _, n in ratios)
    )
    for result in results:
        for size in result["allreduce"]:
            f = size["bus_fraction"]
            print(
                f"{result['rate']:>7s} {result.get('ranks', 2):5d} {size['name']:>7s} | "
                + " ".join(f"{f[k]:13.2f}" for k, _ in shown)
                + "".join(f" | {size[f'{k}_over_sockets']:12.2f}" for k, _ in ratios)
            )
    for result in results:
        if "auto_engine" in result:
            picked = result.get("auto_choice") or result["auto_engine"]
            print(f"{result['rate']}: auto picked {picked}")
    print(
        "\ntraining step over TF's ring and (tcp) our TCP ring, ms "
        "(goal: step <= 1.05 x bound x max(compute, comm))"
    )
    print(
        f"{'where':>14s} | {'step':>7s} {'compute':>8s} {'comm':>7s} | "
        f"{'step/max':>8s} {'bound':>6s} {'step/bound':>10s} {'vs one host':>11s}"
    )
    rows = (
        ([("one host", one_host)] if one_host else [])
        + [(r["rate"], r["train"]) for r in results]
        + [(f"{r['rate']} {c}", t) for r in results for c, t in r["compressed"].items()]
        + [(f"{r['rate']} {n}", t) for r in results for n, t in r.get("train_tcp", {}).items()]
    )
    for where, t in rows:
        versus = f"{t['step'] / one_host['step']:11.2f}" if one_host else f"{'-':>11s}"
        print(
            f"{where:>14s} | {1e3 * t['step']:7.1f} {1e3 * t['compute']:8.1f} "
            f"{1e3 * t['comm']:7.1f} | {t['step_over_max_parts']:8.2f} {t['bound']:6.2f} "
            f"{t['step_over_max_parts'] / t['bound']:10.2f} {versus}"
        )


def run() -> int:
    reason = netns_hosts.unavailable()
    if reason:
        print(f"multi_host: {reason}", file=sys.stderr)
        return 1
    if FLAGS.layout == "2x2":
        return _two_by_two.run(FLAGS, _run)
    if FLAGS.quick:
        _harness.quick_defaults(
            rates=["1gbit"], repeats=2, sizes=["64K", "4M"], steps=4, compressions=["fp16"]
        )
    per_host = FLAGS.workers_per_host
    if per_host > 1 and not FLAGS["json"].present:
        FLAGS.json = os.path.join(_harness.RESULTS_DIR, "scaling", f"multi_host_2x{per_host}.json")
    watch = _harness.Stopwatch()
    load = _harness.load_note()
    try:
        results = []
        for rate in FLAGS.rates:
            results.append(measure(rate))
            print(f"  {rate}: done at {watch.elapsed():.0f}s", flush=True)
        one_host = _train(_run(HVT, _hvt_args("tf", train_only="true"))) if per_host == 1 else None
    except _harness.WorkersFailed as e:
        print(f"multi_host: {e}; worker output:\n{e.output[-6000:]}", file=sys.stderr)
        return 1
    report(results, one_host)
    print(f"\n{load}; total time {watch.elapsed():.0f}s")
    payload = {"repeats": FLAGS.repeats, "batch": FLAGS.batch, "workers_per_host": per_host}
    payload["results"] = results
    if one_host is not None:
        payload["one_host"] = one_host
    _harness.save_results(FLAGS.json, "multi_host", payload, quick=FLAGS.quick, load=load)
    return 0


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    return run()


if __name__ == "__main__":
    app.run(main)

"""Writes benchmarks/RESULTS.md, the current benchmark figures, from the saved JSON results.

Reads every `*.json` the drivers saved under `--results_dir`
(benchmarks/results/) and writes one markdown file (`--out`, by default
RESULTS.md beside that directory: benchmarks/RESULTS.md) with a section per
benchmark: what it compares, the machine note of its run (`meta`: when,
cores, load, whether it was a `--quick` run), a compact table of its
headline figures and ratios (median [min, max] over the repetitions, as
the drivers print them), and the figure `benchmarks/_plots.py` drew from
it, where one exists. A benchmark whose JSON is missing gets one line
saying so; a JSON of a benchmark this script does not know gets a generic
section (its scalar settings and its `ratios`).

Nothing here imports TensorFlow (only json, os and absl). Rewrite the file
without re-running anything:

    python benchmarks/results_md.py [--results_dir benchmarks/results] [--out benchmarks/RESULTS.md]
"""

from __future__ import annotations

import json
import os

from absl import app, flags

FLAGS = flags.FLAGS
_HERE = os.path.dirname(os.path.abspath(__file__))
flags.DEFINE_string(
    "results_dir",
    os.path.join(_HERE, "results"),
    "Where the JSON results (and the PNG figures) are read.",
)
flags.DEFINE_string(
    "out",
    None,
    "The markdown file to write (default: RESULTS.md beside "
    "--results_dir, i.e. benchmarks/RESULTS.md).",
)

# The benchmarks that save JSON, in the order of the file; the two others
# print their tables only.
KNOWN = (
    "overhead",
    "allreduce",
    "weak_scaling",
    "host_engine",
    "strong_scaling",
    "model_parallel",
    "sparse_embeddings",
    "remat",
    "optimizer_sharding",
    "bigger_models",
    "multi_host",
    "multi_host_2x2",
    "tcp_engine",
    "elastic",
    "chaos",
    "scaling_model",
)
PRINT_ONLY = ("horovod_vs_tf", "parameter_server")


# ----------------------------------------------------------------------------
# Formatting


def _median(values) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _num(value, digits: int = 2) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.{digits}f}"


def _stats(summary, digits: int = 2) -> str:
    """`median [min, max]` of a run_summary dict (or of a plain list)."""
    if summary is None:
        return "–"
    if isinstance(summary, list):
        summary = {"median": _median(summary), "min": min(summary), "max": max(summary)}
    return (
        f"{_num(summary['median'], digits)} "
        f"[{_num(summary['min'], digits)}, {_num(summary['max'], digits)}]"
    )


def _mb(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.1f} MB"


def _table(header, rows) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return lines + [""]


def _target(median: float, target, at_least: bool = True) -> str:
    if target is None:
        return "–"
    met = median >= target if at_least else median <= target
    return f"{'>=' if at_least else '<='} {target:g}: " + ("met" if met else "**not met**")


def _meta_note(data: dict) -> str:
    meta = data.get("meta") or {}
    note = (
        f"Measured {meta.get('time', '?')} on {meta.get('cpus', '?')} cores; "
        f"{meta.get('load', 'load not recorded')}."
    )
    note = f"*{note}*"
    if meta.get("quick"):
        note += " **A `--quick` run: numbers for testing the chain, not for reading.**"
    return note


class _Doc:
    """The markdown being written, and where its figures are linked from."""

    def __init__(self, results_dir: str, out_path: str):
        self.results_dir = results_dir
        self.out_dir = os.path.dirname(os.path.abspath(out_path))
        self.lines: list[str] = []

    def add(self, *lines: str) -> None:
        self.lines.extend(lines)

    def figure(self, name: str, alt: str) -> None:
        path = os.path.join(self.results_dir, name)
        if os.path.exists(path):
            link = os.path.relpath(os.path.abspath(path), self.out_dir).replace(os.sep, "/")
            self.add(f"![{alt}]({link})", "")

    def misses(self, data: dict) -> None:
        if "misses" in data:
            self.add(
                "Target misses: " + ("; ".join(data["misses"]) if data["misses"] else "none") + ".",
                "",
            )


# ----------------------------------------------------------------------------
# One section per benchmark


def overhead(doc: _Doc, data: dict) -> None:
    doc.add(
        f"`DistributedModel` against plain Keras, a raw loop and raw tf.distribute: the "
        f"whole `model.fit` of the {data['model']} (batch {data['batch']}, "
        f"{data['steps']} steps x {data['epochs']} epochs per fit), every variant "
        f"interleaved in one process for {data['rounds']} rounds. Step time = fit time / "
        "steps; ratios are paired per round.",
        "",
    )
    names = {
        "plain": "plain `keras.Model.fit`",
        "kd_single": 'ours, `"single"`',
        "raw_loop": "raw `tf.function` loop (the floor)",
        "raw_mirrored_1": "raw Keras + `MirroredStrategy`, 1 CPU",
        "kd_mirrored_1": 'ours, `"mirrored"`, 1 CPU',
        "raw_mirrored_2": "raw Keras + `MirroredStrategy`, 2 CPUs",
        "kd_mirrored_2": 'ours, `"mirrored"`, 2 CPUs',
    }
    doc.add(
        *_table(
            ["variant", "step ms, median [min, max]"],
            [(names.get(k, k), _stats(v)) for k, v in data["step_ms"].items()],
        )
    )
    doc.add(
        *_table(
            ["ratio", "median [min, max]", "target"],
            [
                (
                    k,
                    _stats(v),
                    _target(v["median"], v.get("target"), v.get("at_least") is not False),
                )
                for k, v in data["ratios"].items()
            ],
        )
    )
    doc.misses(data)


def allreduce(doc: _Doc, data: dict) -> None:
    doc.add(
        f"One SUM all-reduce between {data['nproc']} worker processes on this host: "
        "ours (`Strategy.all_reduce`, the path of the training step) against raw "
        "TensorFlow with one collective per tensor (raw) and TensorFlow's batched "
        "all-reduce (batched), for single float32 tensors and for a list of many small "
        f"gradients; {data['repeats']} interleaved timings each. Bus bandwidth = bytes x "
        "2(n-1)/n / time; ratios > 1: ours is faster.",
        "",
    )
    for launch in data["launches"]:
        bpp = launch["bytes_per_pack"]
        doc.add(
            f'Ours with `implementation="{launch["implementation"]}"`, `bytes_per_pack='
            f"{bpp}` ({_mb(bpp) if bpp else 'one pack'}); TensorFlow "
            f"{launch.get('tf_version', '?')}:",
            "",
        )
        rows = []
        for case in launch["cases"]:
            bus = case["bus_gbps"]
            rows.append(
                (
                    case["name"],
                    case["num_tensors"],
                    *(_num(bus[v]["median"], 3) for v in ("raw", "batched", "ours")),
                    _stats(case["ours_over_raw"]),
                    _stats(case["ours_over_batched"]),
                    "ok" if case["checks_ok"] else "**wrong**",
                )
            )
        doc.add(
            *_table(
                [
                    "case",
                    "tensors",
                    "raw GB/s",
                    "batched GB/s",
                    "ours GB/s",
                    "ours / raw",
                    "ours / batched",
                    "result",
                ],
                rows,
            )
        )
    doc.misses(data)
    doc.figure("allreduce_bandwidth.png", "All-reduce bus bandwidth against message size")


def _config_table(doc: _Doc, configs: dict) -> None:
    rows = [
        (
            f"`{name}`",
            c["workers"],
            c["strategy"] + ("" if c["implementation"] == "auto" else f" ({c['implementation']})"),
            c["global_batch"],
            _stats(c["step_ms"], 1),
            _stats(c["throughput"], 0),
        )
        for name, c in configs.items()
    ]
    doc.add(
        *_table(["config", "workers", "strategy", "global batch", "step ms", "samples/s"], rows)
    )


_CONFIG_NOTE = (
    "`single` and `mw1`/`mw2` are ours (`multi_worker` on 1 and 2 workers; "
    "`mw2ring` on TensorFlow's ring), `raw1`/`raw2` the peer (a hand-written "
    "tf.distribute custom loop), `indep2` two independent `raw1` processes at "
    "once (no communication: what two cores allow), `lock2` the same two "
    "waiting for each other after every step (the lock-step reference)."
)


def weak_scaling(doc: _Doc, data: dict) -> None:
    doc.add(
        f"Training throughput of the {data['model']} with {data['per_worker_batch']} "
        f"samples per worker per step, on 1 and 2 workers pinned to one core each; "
        f"{data['repeats']} alternating repetitions, ratios paired per repetition. " + _CONFIG_NOTE,
        "",
    )
    _config_table(doc, data["configs"])
    rows = []
    eff = data.get("efficiency")
    if eff:
        rows.append(
            (
                "**efficiency mw2 / (2 x fastest one-worker)**",
                _stats(eff),
                _target(eff["median"], eff.get("target")),
            )
        )
    ratios = data.get("ratios") or {}
    shown = (
        "ceiling: indep2 / (2 x fastest one-worker)",
        "lock-step reference: lock2 / (2 x fastest one-worker)",
        "peer: raw2 / (2 x fastest one-worker)",
        "against the ceiling: mw2 / indep2",
        "against the lock-step reference: mw2 / lock2",
        "our mw2 / peer raw2 (throughput)",
        "efficiency mw2ring / (2 x single)",
        "throughput single / raw1",
    )
    picked = [k for k in shown if k in ratios] or list(ratios)
    rows += [(k, _stats(ratios[k]), "–") for k in picked]
    doc.add(*_table(["ratio", "median [min, max]", "target"], rows))
    doc.misses(data)
    doc.figure(
        "throughput_vs_workers.png", "Training throughput against workers: weak and strong scaling"
    )


def host_engine(doc: _Doc, data: dict) -> None:
    doc.add(
        "The shared-memory all-reduce alone (`HostAllReduce.mean_by_count`, what the "
        f"training step calls) on the weak-scaling MLP's gradients ({_mb(data['nbytes'])} "
        "float32 in six arrays) between 2 NumPy processes pinned to one core each, beside "
        "a plain NumPy add-and-copy of the same bytes in each process at once (the least "
        "memory work summing two copies and handing out the result takes) and the "
        "engine's lock-step alone (one float32: its two barriers). "
        f"{data['repeats']} alternating repetitions, each the median of {data['calls']} "
        "calls, the slower process's.",
        "",
    )
    rates = data["gb_per_s"]
    doc.add(
        *_table(
            ["measurement", "ms per call", "GB/s"],
            [
                (kind, _stats(data["ms"][kind]), _stats(rates[kind]) if kind in rates else "–")
                for kind in ("engine", "numpy", "lockstep")
            ],
        )
    )
    ratios = data["ratios"]
    doc.add(
        *_table(
            ["ratio", "median [min, max]"],
            [
                ("engine / numpy (time)", _stats(ratios["engine_over_numpy"])),
                ("engine less lock-step (ms)", _stats(ratios["engine_less_lockstep_ms"])),
            ],
        )
    )


def strong_scaling(doc: _Doc, data: dict) -> None:
    doc.add(
        f"Training throughput of the {data['model']} with a fixed global batch of "
        f"{data['global_batch']} samples, split over 1 or 2 workers pinned to one core each; "
        f"{data['repeats']} alternating repetitions. The speedup is what a second "
        "worker gives a user with a fixed batch size (ideal 2.0). " + _CONFIG_NOTE,
        "",
    )
    _config_table(doc, data["configs"])
    rows = []
    speedup = data.get("speedup")
    if speedup:
        rows.append(
            (
                "**speedup mw2 / fastest one-worker**",
                _stats(speedup),
                _num(speedup.get("ideal", 2.0), 1),
            )
        )
    rows += [
        (k, _stats(v), "–")
        for k, v in (data.get("ratios") or {}).items()
        if k != "mw2 / fastest one-worker"
    ]
    doc.add(*_table(["ratio", "median [min, max]", "ideal"], rows))
    doc.misses(data)
    if os.path.exists(os.path.join(doc.results_dir, "throughput_vs_workers.png")):
        doc.add("The right panel of the weak-scaling figure above shows these runs.", "")


def model_parallel(doc: _Doc, data: dict) -> None:
    doc.add(
        f"Training throughput of the {data['model']} ({data['params']:,} parameters, "
        f"batch {data['batch']}) split over 2 logical CPUs, against one core "
        f"(`one`, strategy `single`): `mN` is `pipeline` with 2 stages, schedule 1F1B "
        f"and N micro-batches, `gpipe8` the GPipe schedule at 8, `tp2` "
        f"`tensor_parallel` over 2 devices. {data['repeats']} alternating repetitions; "
        "ratios paired per repetition. The ideal of a 2-stage pipeline is 2 x (1 - "
        "bubble).",
        "",
    )
    ratios, ideal = data.get("ratios_vs_one") or {}, data.get("ideal") or {}
    target = data.get("target_m8")
    rows = []
    for name, runs in data["runs"].items():
        ratio = ratios.get(name)
        mark = ""
        if name == "m8" and ratio and target:
            mark = _target(ratio["median"], target)
        rows.append(
            (
                f"`{name}`",
                _num(_median([r["step_ms"] for r in runs]), 1),
                "1" if name == "one" else _stats(ratio),
                "1.00" if name == "one" else _num(ideal.get(name)),
                mark or "–",
            )
        )
    doc.add(*_table(["config", "step ms (median)", "throughput / one", "ideal", "target"], rows))
    per_device = (data["runs"].get("tp2") or [{}])[0].get("bytes_per_device")
    if per_device:
        total = sum(per_device.values()) or 1
        doc.add(
            "Weight bytes per device under `tp2`: "
            + ", ".join(
                f"{d.rsplit('device:', 1)[-1]} {_mb(b)} ({100 * b / total:.1f}%)"
                for d, b in sorted(per_device.items())
            )
            + " (ideal 50% each).",
            "",
        )
    doc.misses(data)


def sparse_embeddings(doc: _Doc, data: dict) -> None:
    doc.add(
        f"An `Embedding({data['vocab']:,} x {data['dim']})` table (batch "
        f"{data['batch']}, {data['optimizer']}) on 2 workers: its gradient as the batch's "
        "rows (`sparse`, ours) against the whole table made dense before the reduction "
        "(`dense`), and plain Keras in one process (`plain`). Bytes: what each worker "
        "hands the step's reductions.",
        "",
    )
    doc.add(
        *_table(
            ["config", "step ms, median [min, max]", "to the reductions per step"],
            [
                (
                    f"`{k}`",
                    _stats(c["step_ms"], 1),
                    _mb(c["bytes_per_step"]) if c["bytes_per_step"] else "none",
                )
                for k, c in data["configs"].items()
            ],
        )
    )
    rows = [(k, _stats(v)) for k, v in (data.get("ratios") or {}).items()]
    if "bytes_ratio_dense_over_sparse" in data:
        rows.append(("dense/sparse bytes", _num(data["bytes_ratio_dense_over_sparse"], 0)))
    doc.add(*_table(["ratio", "median [min, max]"], rows))


def remat(doc: _Doc, data: dict) -> None:
    doc.add(
        f"Activation checkpointing on an MLP of {data['depth']} x Dense({data['width']}), "
        f'batch {data["batch"]}: none, every layer in `keras.RematScope(mode="full")` '
        f"(`layers`), and `keras.remat` around blocks of {data['block']} layers "
        "(`blocks`), under each strategy. Peak: the memory the training step itself "
        "needs (TensorFlow's allocator count); the weights are compared with `none` of "
        f"the same strategy. {data['repeats']} repetitions.",
        "",
    )
    rows = []
    for r in data["results"]:
        times = r.get("time_over_none")
        rows.append(
            (
                f"`{r['config']}`",
                _mb(r["step_peak_bytes"]),
                _num(r.get("peak_over_none")),
                _num(_median(times)) if times else "–",
                f"{r['weight_gap']:.1e}" if "weight_gap" in r else "–",
            )
        )
    doc.add(
        *_table(
            [
                "strategy/mode",
                "step peak",
                "peak / none",
                "step time / none",
                "max abs weight difference",
            ],
            rows,
        )
    )


def optimizer_sharding(doc: _Doc, data: dict) -> None:
    doc.add(
        f"Optimizer-state sharding on an MLP of {data['depth']} x Dense({data['width']}) "
        f"({data['parameters']:,} parameters), Adam, batch {data['batch']}, `multi_worker` "
        "on 2 workers: `none` (every worker keeps Adam's moments for every weight) "
        "against `optimizer` (each keeps them for its half) and `gradients` (and "
        "receives only its half's reduced gradients). Bytes per worker from "
        "`strategy.describe(model)`.",
        "",
    )
    doc.add(
        *_table(
            ["sharding", "step ms, median [min, max]", "weights", "gradients", "optimizer"],
            [
                (
                    f"`{k}`",
                    _stats(c["step_ms"], 1),
                    _mb(c["weights"]),
                    _mb(c["gradients"]),
                    _mb(c["optimizer"]),
                )
                for k, c in data["configs"].items()
            ],
        )
    )
    rows = [
        (k, _stats(v) if isinstance(v, dict) else _num(v, 3)) for k, v in data["ratios"].items()
    ]
    rows.append(("final weights equal", _num(data["final_weights_equal"])))
    doc.add(*_table(["", "value"], rows))
    doc.misses(data)


def bigger_models(doc: _Doc, data: dict) -> None:
    doc.add(
        f"The ways to fit a bigger model on one model, an MLP of {data['layers']} x "
        f"Dense({data['units']}) ({data['parameters']:,} parameters) with Adam: the bytes "
        "of weights and optimizer state on the most loaded device, read from the "
        "variables (`strategy.describe(model)`). Activation checkpointing leaves them "
        "as they are (it trades activations for recompute: see its section).",
        "",
    )
    doc.add(
        *_table(
            ["way", "devices", "largest device", "/ data parallel"],
            [
                (
                    f"`{way}`",
                    str(r["devices"]),
                    _mb(r["largest_bytes"]),
                    _num(r["over_data_parallel"], 3),
                )
                for way, r in data["ways"].items()
            ],
        )
    )


def multi_host(doc: _Doc, data: dict) -> None:
    doc.add(
        "Two hosts (network namespaces) joined by a rate-limited link, one worker each: "
        "all-reduce bus bandwidth as a fraction of the link rate for ours over "
        "TensorFlow's ring, ours over Horovod's Gloo, ours over our TCP ring "
        '(`implementation="tcp"`) and raw `MultiWorkerMirroredStrategy` (goal: '
        ">= 0.8 from 4 MB), beside the link's ceiling (sockets: the same bytes "
        "exchanged over one plain TCP connection in one step each way, no reduction, "
        "each side pinned to its worker's core), "
        "and the TCP ring's fraction of that ceiling (goal: >= 0.9 from 16 MB); "
        "then the training step "
        f"(global batch {data['batch']}; each step timed from its batch's begin to its "
        "end, the median over an epoch) against its parts measured alone, compute and "
        "the gradient all-reduce (`step / max(compute, comm)`: 1 when they fully "
        "overlap, up to 2 when they run one after the other; `bound`: max(compute + the "
        "all-reduce of the first layer's gradients, made last; the forward pass + the "
        "whole all-reduce) / max(compute, comm), the least perfect overlap can reach), "
        "over TensorFlow's ring and over our TCP ring (`tcp`: in the same packs; "
        "`tcp 1 pack`: one all-reduce after the backward pass). Medians of "
        f"{data['repeats']} timings.",
        "",
    )
    rows = [
        (
            r["rate"],
            s["name"],
            *(
                _num(s["bus_fraction"].get(k))
                for k in ("ours_ring", "ours_gloo", "ours_tcp", "ours_auto", "raw_tf", "sockets")
            ),
            _num(s.get("tcp_over_sockets")),
            _num(s.get("auto_over_sockets")),
        )
        for r in data["results"]
        for s in r["allreduce"]
    ]
    doc.add(
        *_table(
            [
                "link",
                "size",
                "ours / TF ring",
                "ours / Gloo",
                "ours / TCP ring",
                "ours / auto",
                "raw TF",
                "sockets",
                "TCP ring / sockets",
                "auto / sockets",
            ],
            rows,
        )
    )
    picks = [f"{r['rate']}: {r['auto_engine']}" for r in data["results"] if "auto_engine" in r]
    if picks:
        doc.add(f'`implementation="auto"` picked, by its probe at start: {"; ".join(picks)}.', "")
    one = data.get("one_host")
    steps = ([("one host", one)] if one else []) + [
        (r["rate"], r["train"]) for r in data["results"]
    ]
    steps += [
        (f"{r['rate']}, {c}", t)
        for r in data["results"]
        for c, t in (r.get("compressed") or {}).items()
    ]
    steps += [
        (f"{r['rate']}, {name}", t)
        for r in data["results"]
        for name, t in (r.get("train_tcp") or {}).items()
    ]
    doc.add(
        *_table(
            ["where", "step ms", "compute ms", "comm ms", "step / max", "bound", "step / one host"],
            [
                (
                    where,
                    _num(1e3 * t["step"], 1),
                    _num(1e3 * t["compute"], 1),
                    _num(1e3 * t["comm"], 1),
                    _num(t["step_over_max_parts"]),
                    _num(t.get("bound")),
                    _num(t["step"] / one["step"]) if one else "–",
                )
                for where, t in steps
            ],
        )
    )
    doc.figure("multi_host.png", "All-reduce between two hosts against the link rate")


def multi_host_2x2(doc: _Doc, data: dict) -> None:
    names = ("ring", "tcp", "hierarchical")
    doc.add(
        f"Two hosts of {data['slots']} workers each on a rate-limited link: `multi_worker` "
        'over TensorFlow\'s ring (`implementation="ring"`), over our TCP ring through '
        'every worker (`"tcp"`) and over the hierarchical all-reduce (`"hierarchical"`: '
        "shared memory within each host, a TCP ring between the hosts' first workers). "
        "The all-reduce time of one float32 tensor (and of a list of small ones), the "
        "slowest worker's, and the bytes each host sent for it, read from its link's "
        "counter; then the training step of the 784-1024-256-10 MLP "
        f"(global batch {data['batch']}) and the bytes each host sent per step. A flat "
        "ring of 4 workers sends 1.5 times a tensor's bytes out of each host, the "
        f"hierarchical one 1 time. Medians of {data['repeats']} timings.",
        "",
    )
    rows = [
        (
            r["rate"],
            c["name"],
            *(_num(1e3 * c["seconds"][n], 1) for n in names),
            *(_mb(c["host_bytes"][n]) for n in names),
        )
        for r in data["results"]
        for c in r["allreduce"]
    ]
    rows += [
        (
            r["rate"],
            "training step",
            *(_num(1e3 * r["train"][n]["step"], 1) for n in names),
            *(_mb(r["train"][n]["host_bytes_per_step"]) for n in names),
        )
        for r in data["results"]
    ]
    doc.add(
        *_table(
            ["link", "case", *(f"{n} ms" for n in names), *(f"{n}: sent per host" for n in names)],
            rows,
        )
    )


def elastic(doc: _Doc, data: dict) -> None:
    doc.add(
        "An elastic job (`--min_workers 1`) on two hosts (network namespaces), one worker "
        "each, losing host 1's link for good after step "
        f"{data['lose_after']} and getting it back later; heartbeat timeout "
        f"{data['heartbeat_s']:g} s, a backup every {data['save_freq']} steps. From the "
        "workers' own step log:",
        "",
    )
    labels = {
        "loss_to_training_s": "seconds from the loss to training on the host left",
        "steps_redone": "steps trained again after the loss",
        "return_to_training_s": "seconds from the return to training on both",
        "steps_redone_on_return": "steps trained again after the return",
    }
    doc.add(
        *_table(
            ["", "median [min, max]"], [(labels[k], _stats(v)) for k, v in data["measures"].items()]
        )
    )
    doc.misses(data)


def chaos(doc: _Doc, data: dict) -> None:
    counts, trials = data["counts"], data["trials"]
    doc.add(
        f"{len(trials)} trials (seed {data['seed']}) of a `multi_worker` job on two hosts "
        "(network namespaces), one worker each, `--min_workers 1 --max_restarts 4`, "
        f"heartbeat timeout {data['heartbeat_s']:g} s, with one or two random faults "
        "at a random step. Exact: the weights of an uninterrupted one-process run "
        "(max |dw| <= 1e-5); clear: a non-zero exit with one line of the launcher's; "
        "anything else (a hang, other weights, a process or /dev/shm file left) must "
        "not happen.",
        "",
    )
    injected = f"{data['faults_injected']} of {data.get('faults_drawn', '?')}"
    doc.add(
        *_table(
            ["trials", "faults injected (of drawn)", "exact ends", "clear ends", "anything else"],
            [
                (
                    str(len(trials)),
                    injected,
                    str(counts["exact"]),
                    str(counts["clear"]),
                    str(counts["other"]),
                )
            ],
        )
    )
    doc.add(
        *_table(
            ["trial", "faults, after step", "end", "seconds"],
            [
                (
                    str(t["index"] + 1),
                    f"{' + '.join(t['faults'])}, {t['step']}",
                    f"{t['end']}: {t['why']}".replace("|", "/"),
                    _num(t["seconds"], 0),
                )
                for t in trials
            ],
        )
    )
    doc.misses(data)


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**10:,.0f} KB" if nbytes < 2**20 else _mb(nbytes)


def _checks_rows(rows: list) -> list:
    return [
        (
            r["check"],
            _size(r["bytes"]) if "bytes" in r else "–",
            r.get("ranks", "–"),
            _num(1e3 * r["measured"], 1),
            _num(1e3 * r["predicted"], 1),
            f"{100 * r['relative_error']:+.0f}%",
        )
        for r in rows
    ]


def _stop(stop: dict, far: int) -> tuple[str, str]:
    below, peak = stop["efficiency_below_half"], stop["throughput_peak"]
    return (
        f"{below:,}" if below else f"> {far:,}",
        f"{peak:,}" if peak else f"> {far:,}",
    )


def scaling_model(doc: _Doc, data: dict) -> None:
    doc.add(
        "Predicted step time and weak-scaling efficiency of data-parallel training past two "
        "hosts, from the alpha-beta cost of the gradient all-reduce "
        "(`benchmarks/_scaling.py`) with alpha and bandwidth fitted per engine and link to "
        "the 2-rank results above (least squares on log time), checked on points no fit "
        "saw. Formulas and sources: docs/performance.md, *A scaling model past this machine*.",
        "",
    )
    fits = data["fits"]
    doc.add(
        *_table(
            ["engine, link", "alpha ms", "bandwidth MB/s", "rms log error", "points"],
            [
                (
                    name,
                    _num(1e3 * f["alpha"], 3),
                    _num(f["bandwidth"] / 1e6, 1),
                    _num(f["rms_log_error"], 3),
                    f["points"],
                )
                for name, f in fits.items()
            ],
        )
    )
    doc.add(
        f"Overlap fraction (step = compute + comm - overlap x min(compute, comm)), fitted on "
        f"{data['overlap']['rows']} two-host step rows: {data['overlap']['fraction']:.2f}. "
        f"Fraction of the link rate our faster ring reaches where the link is the bottleneck, "
        f"carried to the GPU fabrics: {data['link_efficiency']:.2f}.",
        "",
    )
    _scaling_checks(doc, data)
    _scaling_stops(doc, data)
    doc.figure("scaling_model.png", "Predicted efficiency against workers, per engine and fabric")


_CHECK_TITLES = {
    "sizes": "fitted on sizes up to 4 MB, predicting 16 and 64 MB",
    "ranks": "2-rank fits predicting 4 ranks",
    "comm": "the training step's all-reduce, from the single-tensor fits",
    "steps": "the fitted overlap on step rows it was not fitted on",
}


def _scaling_checks(doc: _Doc, data: dict) -> None:
    summary = []
    for key, rows in data["checks"].items():
        errors = sorted(abs(r["relative_error"]) for r in rows)
        if errors:
            summary.append(
                (
                    _CHECK_TITLES.get(key, key),
                    len(errors),
                    f"{100 * _median(errors):.0f}%",
                    f"{100 * errors[-1]:.0f}%",
                )
            )
    doc.add(*_table(["held-out check", "points", "median abs error", "max abs error"], summary))
    every = [r for rows in data["checks"].values() for r in rows]
    doc.add(
        *_table(
            ["check", "size", "ranks", "measured ms", "predicted ms", "error"], _checks_rows(every)
        )
    )


def _scaling_stops(doc: _Doc, data: dict) -> None:
    far = data.get("stops_paying_searched_up_to", data["workers"][-1])
    stops = []
    for p in data["predictions"]:
        for engine, v in p["engines"].items():
            stops.append(
                (
                    p["fabric"],
                    p["workload"],
                    engine,
                    _num(v["efficiency"][-1]),
                    *_stop(v["stops_paying"], far),
                )
            )
    doc.add(
        f"Where each engine stops paying (efficiency below 0.5; the worker count after which "
        f"throughput no longer rises), searched up to {far:,} workers; efficiency at "
        f"{data['workers'][-1]:,}:",
        "",
    )
    doc.add(
        *_table(
            [
                "fabric",
                "model",
                "engine",
                f"efficiency at {data['workers'][-1]:,}",
                "efficiency < 0.5 from",
                "throughput peaks at",
            ],
            stops,
        )
    )


def generic(doc: _Doc, data: dict) -> None:
    settings = [
        (k, v) for k, v in data.items() if k != "meta" and isinstance(v, (int, float, str, bool))
    ]
    if settings:
        doc.add(
            *_table(
                ["setting", "value"],
                [(k, _num(v) if not isinstance(v, str) else v) for k, v in settings],
            )
        )
    ratios = data.get("ratios")
    if isinstance(ratios, dict) and ratios:
        doc.add(
            *_table(
                ["ratio", "median [min, max]"],
                [
                    (k, _stats(v) if isinstance(v, dict) and "median" in v else v)
                    for k, v in ratios.items()
                ],
            )
        )
    doc.misses(data)


def tcp_engine(doc: _Doc, data: dict) -> None:
    doc.add(
        f"Two hosts (network namespaces) on a {data['rate']} link, one process each "
        "pinned to a core: the bytes of a 2-rank all-reduce exchanged over one plain "
        "TCP connection with no reduction (`sockets`), our TCP ring's all-reduce called "
        "from NumPy (`engine`), and the same call as a `tf.numpy_function` op in a "
        "`tf.function`, timed from the op before it to the op after it (`in_step`). "
        f"{data['repeats']} alternating repetitions, each the median of {data['calls']} "
        "calls, the slower process's. Bus bandwidth: bytes / time.",
        "",
    )
    rows = []
    for case in data["cases"]:
        rates, ratios = case["gb_per_s"], case["ratios"]
        rows.append(
            (
                _mb(case["bytes"]),
                *(_stats(rates[k]) for k in ("sockets", "engine", "in_step")),
                *(
                    _stats(ratios[k])
                    for k in ("engine_over_sockets", "in_step_over_sockets", "in_step_over_engine")
                ),
            )
        )
    doc.add(
        *_table(
            [
                "size",
                "sockets GB/s",
                "engine GB/s",
                "in_step GB/s",
                "engine / sockets",
                "in_step / sockets",
                "in_step / engine",
            ],
            rows,
        )
    )


SECTIONS = {
    "overhead": ("Overhead against plain Keras", overhead),
    "allreduce": ("All-reduce bandwidth between local processes", allreduce),
    "weak_scaling": ("Weak scaling: 1 and 2 workers", weak_scaling),
    "host_engine": ("The shared-memory all-reduce against memory speed", host_engine),
    "strong_scaling": ("Strong scaling: a fixed global batch", strong_scaling),
    "model_parallel": ("Model parallelism: pipeline and tensor parallel", model_parallel),
    "sparse_embeddings": ("Sparse embedding gradients", sparse_embeddings),
    "remat": ("Activation checkpointing", remat),
    "optimizer_sharding": ("Optimizer-state sharding", optimizer_sharding),
    "bigger_models": ("Fitting a bigger model: bytes per device", bigger_models),
    "multi_host": ("Two hosts on a rate-limited link", multi_host),
    "multi_host_2x2": ("Two hosts of two workers: hierarchical against flat", multi_host_2x2),
    "tcp_engine": ("Our TCP ring alone against the plain exchange", tcp_engine),
    "elastic": ("Elastic: a host lost and taken back", elastic),
    "chaos": ("Chaos: random faults in a row, and what was lost", chaos),
    "scaling_model": ("A scaling model past this machine", scaling_model),
}


# The script (and flags) of a JSON file not named after its script.
SCRIPTS = {"multi_host_2x2": "multi_host.py --layout 2x2"}


# ----------------------------------------------------------------------------
# The file


def render(results_dir: str, out_path: str) -> str:
    """The markdown for the JSON files in `results_dir`, linking figures from `out_path`."""
    doc = _Doc(results_dir, out_path)
    doc.add(
        "# Benchmark results",
        "",
        "Generated by `benchmarks/results_md.py` from the JSON files `make bench` saves "
        "under `benchmarks/results/`; do not edit by hand (rewrite it with "
        "`python benchmarks/results_md.py`). Each section holds the latest run of its "
        "benchmark, measured on a shared machine: absolute times are noisy, read the ratios, "
        "given as median [min, max] over the repetitions. Each benchmark's docstring "
        "says exactly what it measures.",
        "",
    )
    present = (
        sorted(f[: -len(".json")] for f in os.listdir(results_dir) if f.endswith(".json"))
        if os.path.isdir(results_dir)
        else []
    )
    others = [name for name in present if name not in KNOWN]
    for name in list(KNOWN) + others:
        title, section = SECTIONS.get(name, (name.replace("_", " ").capitalize(), generic))
        script = SCRIPTS.get(name, f"{name}.py")
        doc.add(f"## {title} (`{script}`)", "")
        if name not in present:
            doc.add(f"No results: `{name}.json` is missing (run `python benchmarks/{script}`).", "")
            continue
        with open(os.path.join(results_dir, f"{name}.json")) as f:
            data = json.load(f)
        doc.add(_meta_note(data), "")
        section(doc, data)
    doc.add(
        "## Printed only",
        "",
        " and ".join(f"`{name}.py`" for name in PRINT_ONLY)
        + " (Horovod against TensorFlow's collectives; asynchronous parameter servers "
        "against synchronous training) print their tables and save no JSON: run them, "
        "or `make bench`, to see their figures.",
        "",
    )
    while doc.lines and doc.lines[-1] == "":
        doc.lines.pop()
    return "\n".join(doc.lines) + "\n"


def main(argv, results_dir: str | None = None, out: str | None = None) -> int:
    """Writes the markdown; `results_dir` and `out` default to the flags."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if results_dir is None:
        results_dir, out = FLAGS.results_dir, out or FLAGS.out
    out = out or os.path.join(os.path.dirname(os.path.abspath(results_dir)), "RESULTS.md")
    text = render(results_dir, out)
    with open(out + ".tmp", "w") as f:
        f.write(text)
    os.replace(out + ".tmp", out)
    shown = os.path.relpath(out)
    print(f"wrote {out if shown.startswith('..') else shown}")
    return 0


if __name__ == "__main__":
    app.run(main)

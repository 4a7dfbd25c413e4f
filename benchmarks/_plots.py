"""Draws the benchmark figures (PNG, matplotlib Agg) from the saved JSON results.

Reads what the drivers saved under `--results_dir` (benchmarks/results/)
and writes there:

  throughput_vs_workers.png   training throughput (samples/s) against
      workers (1, 2): left panel weak scaling (weak_scaling.json, a fixed
      batch per worker), right panel strong scaling (strong_scaling.json, a
      fixed global batch), when that file exists. Lines: ours
      (multi_worker: mw1 -> mw2), the peer (the raw tf.distribute custom
      loop: raw1 -> raw2), and the ideal: 1 and 2 x the fastest one-worker
      configuration of the run; single (and mw2ring when run) as points,
      and, when run, the ceiling indep2 (two independent raw1 processes at
      once, no communication) and the lock-step reference lock2 (the same
      two waiting for each other after every step), with their ratios under
      the efficiency.
      Markers at the median over the repetitions, bars from min to max.
  allreduce_bandwidth.png     all-reduce bus bandwidth (GB/s) against the
      message size (allreduce.json), one line per implementation measured
      (raw TF per tensor, raw TF batched, ours for each bytes_per_pack),
      median with [min, max] bars; the many-small gradient list in its own
      panel.
  multi_host.png              all-reduce bus bandwidth as a fraction of the
      link rate against the message size, between two hosts (network
      namespaces) joined by a rate-limited link (multi_host.json): one
      panel per link rate, a line per engine (ours over TF's ring, ours
      over Horovod's Gloo, raw TF), the link's ceiling (plain TCP, dotted)
      and the 0.8 goal (dashed).

A figure whose JSON is missing is skipped (with a note); a figure from a
`--quick` run says so in its title. Redraw without re-running:

    python benchmarks/_plots.py [--results_dir benchmarks/results]
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from absl import app, flags  # noqa: E402

import _harness  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string(
    "results_dir",
    _harness.RESULTS_DIR,
    "Where the JSON results are read and the PNG figures written.",
)

_OURS, _PEER, _IDEAL, _OTHER = "tab:blue", "tab:orange", "0.45", "tab:green"


def _load(name: str):
    path = os.path.join(FLAGS.results_dir, f"{name}.json")
    if not os.path.exists(path):
        print(f"{path}: missing, its figure or panel is skipped")
        return None
    with open(path) as f:
        return json.load(f)


def _quick(data: dict) -> str:
    return (
        "\n[--quick run: numbers for testing, not for reading]" if data["meta"].get("quick") else ""
    )


def _errorbar(ax, xs, summaries, **kwargs):
    """Median markers with [min, max] bars for a list of run_summary dicts."""
    med = [s["median"] for s in summaries]
    lo = [s["median"] - s["min"] for s in summaries]
    hi = [s["max"] - s["median"] for s in summaries]
    return ax.errorbar(xs, med, yerr=[lo, hi], capsize=4, **kwargs)


def _ceiling_note(data: dict) -> str:
    """The ceiling lines under the efficiency, for those the run measured."""
    ratios = data.get("ratios") or {}
    note = ""
    for ceiling_key, ours_key, words in (
        (
            "ceiling: indep2 / (2 x fastest one-worker)",
            "against the ceiling: mw2 / indep2",
            "indep2, no communication",
        ),
        (
            "lock-step reference: lock2 / (2 x fastest one-worker)",
            "against the lock-step reference: mw2 / lock2",
            "lock2, lock-step, no data",
        ),
    ):
        ceiling, ours = ratios.get(ceiling_key), ratios.get(ours_key)
        if ceiling:
            name = "ceiling" if "indep2" in words else "reference"
            note += f"\n{name} ({words}): {ceiling['median']:.2f}"
            note += f"; mw2 / {words.split(',')[0]}: {ours['median']:.2f}" if ours else ""
    return note


def _scaling_panel(ax, data: dict, title: str, ideal_note: str) -> None:
    configs = data["configs"]

    def thr(name):
        return configs[name]["throughput"] if name in configs else None

    fastest = max((thr(c)["median"], c) for c in ("single", "mw1", "raw1") if c in configs)
    ax.plot(
        [1, 2],
        [fastest[0], 2 * fastest[0]],
        "--",
        color=_IDEAL,
        label=f"ideal: 2 x fastest one worker ({fastest[1]})",
    )
    if "mw1" in configs and "mw2" in configs:
        _errorbar(
            ax,
            [1, 2],
            [thr("mw1"), thr("mw2")],
            marker="o",
            color=_OURS,
            label="keras_distrib multi_worker (mw1, mw2)",
        )
    elif "mw2" in configs:
        _errorbar(
            ax,
            [2],
            [thr("mw2")],
            marker="o",
            color=_OURS,
            linestyle="none",
            label="keras_distrib multi_worker (mw2)",
        )
    if "single" in configs:
        _errorbar(
            ax,
            [1],
            [thr("single")],
            marker="s",
            color=_OURS,
            linestyle="none",
            markerfacecolor="white",
            label='keras_distrib "single"',
        )
    if "mw2ring" in configs:
        _errorbar(
            ax,
            [2],
            [thr("mw2ring")],
            marker="D",
            color=_OTHER,
            linestyle="none",
            label="keras_distrib multi_worker, ring (mw2ring)",
        )
    if "raw1" in configs and "raw2" in configs:
        _errorbar(
            ax,
            [1, 2],
            [thr("raw1"), thr("raw2")],
            marker="^",
            color=_PEER,
            label="peer: raw tf.distribute loop (raw1, raw2)",
        )
    if "indep2" in configs:
        _errorbar(
            ax,
            [2],
            [thr("indep2")],
            marker="_",
            markersize=14,
            color=_IDEAL,
            linestyle="none",
            label="ceiling: 2 independent raw1 at once (indep2)",
        )
    if "lock2" in configs:
        _errorbar(
            ax,
            [2],
            [thr("lock2")],
            marker="x",
            markersize=9,
            color=_IDEAL,
            linestyle="none",
            label="reference: indep2 in lock-step (lock2)",
        )
    eff = data.get("efficiency") or data.get("speedup")
    if eff:
        word = "efficiency" if "efficiency" in data and data["efficiency"] else "speedup"
        extra = (
            f" (target {eff['target']:g}: {'met' if eff['met'] else 'NOT MET'})"
            if "target" in eff
            else f" (ideal {eff.get('ideal', 2.0):g})"
        )
        ax.text(
            0.03,
            0.97,
            f"mw2 {word} vs fastest one worker: {eff['median']:.2f} "
            f"[{eff['min']:.2f}, {eff['max']:.2f}]{extra}" + _ceiling_note(data),
            transform=ax.transAxes,
            va="top",
            fontsize=8,
            bbox={"facecolor": "white", "edgecolor": "0.8", "alpha": 0.9},
        )
    ax.set_title(title + _quick(data), fontsize=10)
    ax.set_xlabel(f"workers (one core each)\n{ideal_note}", fontsize=8)
    ax.set_ylabel("training throughput (samples/s)")
    ax.set_xticks([1, 2])
    ax.set_xlim(0.7, 2.3)
    top = max([2 * fastest[0]] + [configs[c]["throughput"]["max"] for c in configs])
    ax.set_ylim(0, top * 1.15)  # room for the text above the lines
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")


def plot_throughput() -> str | None:
    import matplotlib.pyplot as plt

    weak, strong = _load("weak_scaling"), _load("strong_scaling")
    panels = [p for p in (weak, strong) if p is not None]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 4.8), squeeze=False)
    axes = list(axes[0])
    if weak is not None:
        _scaling_panel(
            axes.pop(0),
            weak,
            f"weak scaling: {weak['per_worker_batch']} samples/worker/step",
            f"{weak['model']}; median of {weak['repeats']} repetitions, bars [min, max]",
        )
    if strong is not None:
        _scaling_panel(
            axes.pop(0),
            strong,
            f"strong scaling: global batch {strong['global_batch']} split over the workers",
            f"{strong['model']}; median of {strong['repeats']} repetitions, bars [min, max]",
        )
    meta = (weak or strong)["meta"]
    fig.suptitle(
        f"keras_distrib.DistributedModel.fit, CPU workers ({meta['time'][:10]}, "
        f"{meta['cpus']} cores, shared machine)",
        fontsize=10,
    )
    return _save(fig, "throughput_vs_workers.png")


def _save(fig, name: str) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = os.path.join(FLAGS.results_dir, name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_allreduce() -> str | None:
    import matplotlib.pyplot as plt

    data = _load("allreduce")
    if data is None:
        return None
    lines = {}  # label -> {bytes: [bus GB/s values]}, many-small apart
    small = {}  # label -> [bus GB/s values]
    short = {}  # label -> its tick label in the many-small panel
    for launch in data["launches"]:
        bpp = int(launch["bytes_per_pack"])
        ours = (
            f"ours ({launch['implementation']}, bytes_per_pack="
            f"{_harness.human(bpp) if bpp else '0: one pack'})"
        )
        # raw and batched run in every launch: their timings are pooled.
        labels = {
            "raw": "raw TF: one all_reduce per tensor",
            "batched": "raw TF: batched, one pack",
            "ours": ours,
        }
        short.update(
            {
                labels["raw"]: "raw TF\nper tensor",
                labels["batched"]: "raw TF\nbatched",
                ours: f"ours\n{_harness.human(bpp) if bpp else 'one pack'}",
            }
        )
        for case in launch["cases"]:
            for variant, label in labels.items():
                values = case["bus_gbps"][variant]["values"]
                if case["name"] == "many-small":
                    small.setdefault(label, []).extend(values)
                else:
                    lines.setdefault(label, {}).setdefault(case["bytes"], []).extend(values)

    fig, (ax, ax_small) = plt.subplots(
        1, 2, figsize=(11, 4.8), gridspec_kw={"width_ratios": [2.3, 1]}
    )
    colors = {}
    palette = [_PEER, "tab:red", _OURS, "tab:purple", _OTHER, "tab:brown"]
    markers = ["^", "v", "o", "s", "D", "x"]
    for i, (label, per_size) in enumerate(lines.items()):
        colors[label] = palette[i % len(palette)]
        sizes = sorted(per_size)
        _errorbar(
            ax,
            sizes,
            [_harness.run_summary(per_size[b]) for b in sizes],
            marker=markers[i % len(markers)],
            color=colors[label],
            label=label,
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    sizes = sorted({b for per_size in lines.values() for b in per_size})
    ax.set_xticks(sizes, [_harness.human(b) for b in sizes])
    ax.minorticks_off()
    ax.set_xlabel("message size (one float32 tensor)")
    ax.set_ylabel("bus bandwidth (GB/s) = bytes x 2(n-1)/n / time")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    ax.set_title(
        f"SUM all-reduce, {data['nproc']} worker processes on one host" + _quick(data), fontsize=10
    )

    labels = list(small)
    stats = [_harness.run_summary(small[k]) for k in labels]
    ax_small.bar(
        range(len(labels)),
        [s["median"] for s in stats],
        yerr=[[s["median"] - s["min"] for s in stats], [s["max"] - s["median"] for s in stats]],
        color=[colors.get(k, "0.5") for k in labels],
        capsize=4,
    )
    ax_small.set_xticks(range(len(labels)), [short[k] for k in labels], fontsize=8)
    ax_small.set_yscale("log")
    ax_small.set_ylabel("bus bandwidth (GB/s)")
    many = next(
        (c for launch in data["launches"] for c in launch["cases"] if c["name"] == "many-small"),
        None,
    )
    if many:
        ax_small.set_title(
            f"many-small: {many['num_tensors']} tensors, {_harness.human(many['bytes'])}",
            fontsize=10,
        )
    ax_small.grid(alpha=0.3, axis="y")
    meta = data["meta"]
    fig.suptitle(
        f"all-reduce bus bandwidth, median of {data['repeats']} timings per launch "
        f"(raw/batched pooled over launches), bars [min, max] ({meta['time'][:10]}, "
        f"{meta['cpus']} cores, shared machine)",
        fontsize=9,
    )
    return _save(fig, "allreduce_bandwidth.png")


def plot_multi_host() -> str | None:
    import matplotlib.pyplot as plt

    data = _load("multi_host")
    if data is None:
        return None
    results = data["results"]
    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4.4), squeeze=False)
    engines = {
        "ours_ring": ("ours over TF's ring", _OURS, "o"),
        "ours_gloo": ("ours over Horovod's Gloo", _OTHER, "s"),
        "ours_tcp": ("ours over our TCP ring", "tab:purple", "D"),
        "ours_auto": ("ours, auto's pick", "tab:olive", "v"),
        "raw_tf": ("raw TF (MultiWorkerMirroredStrategy)", _PEER, "^"),
        "sockets": ("the link's ceiling: plain TCP, no reduction", _IDEAL, "x"),
    }
    for ax, result in zip(axes[0], results):
        sizes = [size["bytes"] for size in result["allreduce"]]
        for key, (label, color, marker) in engines.items():
            if key in result["allreduce"][0]["bus_fraction"]:
                ax.plot(
                    sizes,
                    [size["bus_fraction"][key] for size in result["allreduce"]],
                    marker=marker,
                    color=color,
                    label=label,
                    linestyle=":" if key == "sockets" else "-",
                )
        ax.axhline(0.8, color=_IDEAL, linestyle="--", linewidth=1, label="goal: 0.8 of the link")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [size["name"] for size in result["allreduce"]])
        ax.minorticks_off()
        ax.set_ylim(0, 1.1)
        ax.set_xlabel("message size (one float32 tensor)")
        ax.set_ylabel("bus bandwidth / link rate")
        ax.grid(alpha=0.3)
        ax.set_title(f"2 hosts, link {result['rate']}" + _quick(data), fontsize=10)
    axes[0][0].legend(fontsize=7)
    meta = data["meta"]
    fig.suptitle(
        f"SUM all-reduce between two network-namespace hosts, median of "
        f"{data['repeats']} timings ({meta['time'][:10]}, {meta['cpus']} cores, "
        "shared machine)",
        fontsize=9,
    )
    return _save(fig, "multi_host.png")


_ENGINE_COLORS = {"flat ring": _PEER, "tree": _OTHER, "hierarchical": _OURS}
_FABRIC_STYLES = ["-", "--", ":", "-."]


def _scaling_legend(ax, engines, fabrics) -> None:
    """One legend: a colour per engine, a line style per fabric."""
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=_ENGINE_COLORS.get(e, "0.3"), label=e) for e in engines]
    handles += [
        Line2D([], [], color="0.3", linestyle=_FABRIC_STYLES[i % len(_FABRIC_STYLES)], label=f)
        for i, f in enumerate(fabrics)
    ]
    ax.legend(handles=handles, fontsize=6.5, loc="best")


def plot_scaling_model() -> str | None:
    import matplotlib.pyplot as plt

    data = _load("scaling_model")
    if data is None:
        return None
    panels: dict = {}  # model -> [prediction], in order
    for p in data["predictions"]:
        panels.setdefault(p["workload"].split(" on ")[0], []).append(p)
    fig, axes = plt.subplots(1, len(panels), figsize=(5.6 * len(panels), 4.8), squeeze=False)
    for ax, (model, predictions) in zip(axes[0], panels.items()):
        for i, p in enumerate(predictions):
            for engine, v in p["engines"].items():
                ax.plot(
                    data["workers"],
                    v["efficiency"],
                    color=_ENGINE_COLORS.get(engine, "0.3"),
                    linestyle=_FABRIC_STYLES[i % len(_FABRIC_STYLES)],
                    marker=".",
                )
        ax.axhline(0.5, color=_IDEAL, linestyle="--", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_xticks(data["workers"], [str(n) for n in data["workers"]], fontsize=7)
        ax.minorticks_off()
        ax.set_ylim(0, 1.05)
        ax.set_xlabel("workers (weak scaling: the same batch per worker)")
        ax.set_ylabel("efficiency = compute / step")
        ax.grid(alpha=0.3)
        mb = predictions[0]["bytes"] / 1e6
        ax.set_title(f"{model}: {mb:,.{0 if mb >= 100 else 2}f} MB of fp32 gradients", fontsize=10)
        _scaling_legend(ax, predictions[0]["engines"], [p["fabric"] for p in predictions])
    fig.suptitle(
        "predicted weak-scaling efficiency: alpha-beta all-reduce costs fitted to this "
        f"project's measurements, overlap {data['overlap']['fraction']:.2f} "
        "(benchmarks/scaling_model.py)",
        fontsize=9,
    )
    return _save(fig, "scaling_model.png")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    import matplotlib

    matplotlib.use("Agg")
    os.makedirs(FLAGS.results_dir, exist_ok=True)
    for draw in (plot_throughput, plot_allreduce, plot_multi_host, plot_scaling_model):
        path = draw()
        if path:
            print(f"wrote {os.path.relpath(path)}")
    return 0


if __name__ == "__main__":
    app.run(main)

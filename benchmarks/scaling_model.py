"""A scaling model past this machine: step time and efficiency of
data-parallel training on 2 to 1024 workers, from the alpha-beta cost of
the gradient all-reduce (benchmarks/_scaling.py has the formulas), with
parameters fitted to this project's measurements.

Measures nothing itself: it reads the JSON the benchmarks saved under
`--results_dir` (benchmarks/results/):

  multi_host.json      two hosts at 1 and 10 Gbit/s, one worker each: the
                       all-reduce times of every engine by size, and the
                       training step against its compute and communication;
  allreduce.json       one host, 2 processes: the shared-memory engine
                       (ours) and TensorFlow's ring (raw);
  weak_scaling.json    the step on 1 and 2 workers of one host;
  scaling/             the runs beyond two ranks (held out from every fit):
                       allreduce_nproc4_{shm,ring}.json (`allreduce.py
                       --nproc 4`) and multi_host_2x2.json (`multi_host.py
                       --workers_per_host 2`), where present.

What it does:

  1. fits alpha and bandwidth of the ring formula for each engine and link
     on its 2-rank points (least squares on log time);
  2. checks the fits on points they did not see: each engine refitted on the
     sizes up to 4 MB predicts 16 and 64 MB; the 2-rank fits predict the
     4-rank runs; the overlap fraction, fitted on the two-host step rows,
     predicts the one-host and 4-rank steps and, with predicted all-reduce
     times, the 2-worker steps of weak_scaling.json;
  3. predicts step time and efficiency for 2..1024 workers, per engine (flat
     ring, tree, hierarchical), on this project's engines over 1 and
     10 Gbit/s Ethernet (hosts of 2 workers) and on published GPU fabrics
     (8 GPUs per node, NVLink inside, InfiniBand between) for ResNet-50-
     and BERT-large-sized gradients, and where each engine stops paying.

Prints the tables, saves `--json` (benchmarks/results/scaling_model.json)
and draws benchmarks/results/scaling_model.png (benchmarks/_plots.py).

Run:
    python benchmarks/scaling_model.py [--results_dir benchmarks/results]
        [--json benchmarks/results/scaling_model.json]
"""

from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from absl import app, flags  # noqa: E402

import _harness  # noqa: E402
import _plots  # noqa: E402  (defines --results_dir)
import _scaling as sm  # noqa: E402
import _scaling_inputs as inputs  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string(
    "json",
    os.path.join(_harness.RESULTS_DIR, "scaling_model.json"),
    "Where to save the model's parameters, checks and predictions (empty: nowhere).",
)

WORKERS = [2**k for k in range(1, 11)]  # 2 .. 1024: the tables and the figure
FAR = [2**k for k in range(1, 18)]  # 2 .. 131072: where each engine stops paying
HELD_OUT_FROM = 4 * 2**20  # the size hold-out fits on sizes up to 4 MB


# ----------------------------------------------------------------------------
# Fits and checks


def fit_all(points: dict) -> dict:
    """{engine: Fit} on each engine's 2-rank points, all sizes (engines
    measured on more ranks only are predicted from another's fit)."""
    two = {name: [p for p in pts if p[0] == 2] for name, pts in points.items()}
    return {name: sm.fit_ring(pts) for name, pts in two.items() if len(pts) >= 2}


def size_holdout(points: dict) -> list[dict]:
    """Each engine refitted on its 2-rank sizes up to 4 MB predicts the larger ones."""
    rows = []
    for name, pts in points.items():
        two = [p for p in pts if p[0] == 2]
        small = [p for p in two if p[1] <= HELD_OUT_FROM]
        if len(small) < 2 or len(small) == len(two):
            continue
        fit = sm.fit_ring(small)
        for n, size, seconds in two:
            if size > HELD_OUT_FROM:
                rows.append(
                    _check(f"{name}: fit <= 4 MB", n, size, seconds, sm.ring(n, size, fit.link))
                )
    return rows


def _check(what: str, n: int, size: float, measured: float, predicted: float) -> dict:
    return {
        "check": what,
        "ranks": n,
        "bytes": size,
        "measured": measured,
        "predicted": predicted,
        "relative_error": sm.relative_error(predicted, measured),
    }


def ranks_holdout(points: dict, fits: dict, bed_fabrics: dict) -> list[dict]:
    """The 2-rank fits predict the runs on 4 ranks (one host; 2 hosts x 2)."""
    rows = []
    for name, pts in points.items():
        for n, size, seconds in pts:
            if n == 2:
                continue
            fabric = bed_fabrics.get(name)
            if fabric is not None:  # 2 hosts x 2 workers: a ring over both
                predicted = sm.flat_ring(n, size, fabric)
                source = "2 hosts x 2: link fit + one-host TF ring fit"
            else:
                source_fit = fits.get(inputs.TWO_RANK_SOURCE.get(name, name))
                if source_fit is None:
                    continue
                predicted = sm.ring(n, size, source_fit.link)
                source = (
                    f"fit of {inputs.TWO_RANK_SOURCE[name]}"
                    if name in inputs.TWO_RANK_SOURCE
                    else "its fit"
                )
            rows.append(_check(f"{name} ({source})", n, size, seconds, predicted))
    return rows


def comm_checks(data: dict, fits: dict, bed_fabrics: dict) -> list[dict]:
    """The single-tensor fits predict the all-reduce of the training step's
    gradients (a list, in 1 MB packs; fp16/bf16 halve the bytes)."""
    rows, size = [], inputs.MLP_BYTES
    mh = data["multi_host"]
    for result in mh["results"]:
        link = fits[inputs.link_name("ours_ring", result["rate"])].link
        parts = [("", result["train"], size)]
        parts += [(f", {c}", t, size / 2) for c, t in result.get("compressed", {}).items()]
        for label, t, nbytes in parts:
            what = f"step's all-reduce, 2 hosts on {result['rate']}{label}"
            rows.append(_check(what, 2, nbytes, t["comm"], sm.ring(2, nbytes, link)))
    if "one_host" in mh and inputs.LOOPBACK in fits:
        predicted = sm.ring(2, size, fits[inputs.LOOPBACK].link)
        what = f"step's all-reduce, one host (fit: {inputs.LOOPBACK})"
        rows.append(_check(what, 2, size, mh["one_host"]["comm"], predicted))
    for result in data.get("scaling/multi_host_2x2", {}).get("results", []):
        fabric = bed_fabrics.get(inputs.link_name("ours_ring", result["rate"]))
        if fabric is not None:
            predicted = sm.flat_ring(result["ranks"], size, fabric)
            what = f"step's all-reduce, 2 hosts x 2 on {result['rate']}"
            rows.append(_check(what, result["ranks"], size, result["train"]["comm"], predicted))
    return rows


def step_checks(data: dict, fits: dict, overlap: float) -> list[dict]:
    """The fitted overlap on step rows it was not fitted on."""
    rows = []
    for where, (step, compute, comm) in inputs.held_out_step_rows(data).items():
        predicted = sm.step_time(compute, comm, overlap)
        rows.append(
            {
                "check": f"step, {where}",
                "measured": step,
                "predicted": predicted,
                "relative_error": sm.relative_error(predicted, step),
            }
        )
    weak = data.get("weak_scaling")
    if weak:
        size = 4 * weak["params"]
        compute = weak["configs"]["mw1"]["step_ms"]["median"] / 1e3
        for config, engine in (("mw2", inputs.SHM), ("mw2ring", inputs.LOOPBACK)):
            if config in weak["configs"] and engine in fits:
                comm = sm.ring(2, size, fits[engine].link)
                predicted = sm.step_time(compute, comm, overlap)
                step = weak["configs"][config]["step_ms"]["median"] / 1e3
                rows.append(
                    {
                        "check": f"step, weak_scaling {config} (mw1's step + {engine})",
                        "measured": step,
                        "predicted": predicted,
                        "relative_error": sm.relative_error(predicted, step),
                    }
                )
    return rows


# ----------------------------------------------------------------------------
# Predictions


def predict(fabric: sm.Fabric, workload: dict, overlap: float) -> dict:
    """{engine: {"comm", "step", "efficiency" (over WORKERS), "stops_paying",
    "stops_paying_perfect_overlap" (searched over FAR)}}."""
    out = {}
    compute = workload["compute"]
    for engine, cost in sm.ENGINES.items():
        comms = [cost(n, workload["bytes"], fabric) for n in FAR]
        steps = [sm.step_time(compute, c, overlap) for c in comms]
        perfect = [sm.step_time(compute, c, 1.0) for c in comms]
        shown = len(WORKERS)
        out[engine] = {
            "comm": comms[:shown],
            "step": steps[:shown],
            "efficiency": [sm.efficiency(compute, s) for s in steps[:shown]],
            "stops_paying": sm.stops_paying(FAR, steps, compute),
            "stops_paying_perfect_overlap": sm.stops_paying(FAR, perfect, compute),
        }
    return out


def all_predictions(fabrics: list[tuple[sm.Fabric, list[dict]]], overlap: float) -> list[dict]:
    return [
        {
            "fabric": fabric.name,
            "per_node": fabric.per_node,
            "workload": workload["name"],
            "bytes": workload["bytes"],
            "compute": workload["compute"],
            "engines": predict(fabric, workload, overlap),
        }
        for fabric, workloads in fabrics
        for workload in workloads
    ]


# ----------------------------------------------------------------------------
# Printing


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g}"


def print_fits(fits: dict, overlap: float, overlap_rows: int) -> None:
    print("\nfitted ring parameters, 2 ranks, all sizes (least squares on log time)")
    print(f"{'engine':58s} {'alpha ms':>9s} {'B MB/s':>9s} {'rms log err':>11s} {'points':>6s}")
    for name, fit in fits.items():
        print(
            f"{name:58s} {fit.link.alpha * 1e3:9.3f} {fit.link.bandwidth / 1e6:9.1f} "
            f"{fit.rms_log_error:11.3f} {fit.points:6d}"
        )
    print(
        f"overlap fraction (step = compute + comm - overlap * min): {overlap:.2f} "
        f"(fitted on {overlap_rows} two-host step rows)"
    )


def print_checks(title: str, rows: list[dict]) -> None:
    if not rows:
        print(f"\n{title}: no points to check (their results are missing)")
        return
    print(f"\n{title}")
    for r in rows:
        size = f" {_harness.human(r['bytes']):>7s} x{r['ranks']}" if "bytes" in r else ""
        print(
            f"  {r['check']:78s}{size} measured {_ms(r['measured']):>7s} ms  "
            f"predicted {_ms(r['predicted']):>7s} ms  error {100 * r['relative_error']:+6.0f}%"
        )
    errors = [abs(r["relative_error"]) for r in rows]
    print(f"  median |error| {100 * statistics.median(errors):.0f}%, max {100 * max(errors):.0f}%")


def print_predictions(predictions: list[dict], overlap: float) -> None:
    for p in predictions:
        print(
            f"\n{p['fabric']}; {p['workload']} ({p['bytes'] / 1e6:,.3g} MB of gradients, "
            f"compute {_ms(p['compute'])} ms/step, overlap {overlap:.2f})"
        )
        engines = p["engines"]
        print(f"{'workers':>7s} | " + " | ".join(f"{e + ' ms, eff':>22s}" for e in engines))
        for i, n in enumerate(WORKERS):
            cells = [
                f"{_ms(v['step'][i]):>14s} {v['efficiency'][i]:6.2f} " for v in engines.values()
            ]
            print(f"{n:7d} | " + " | ".join(cells))
        for engine, v in engines.items():
            print(
                f"  {engine:13s} stops paying: {_stop_words(v['stops_paying'])}; "
                f"with perfect overlap: {_stop_words(v['stops_paying_perfect_overlap'])}"
            )


def _stop_words(stop: dict) -> str:
    below, peak = stop["efficiency_below_half"], stop["throughput_peak"]
    eff = f"efficiency < 0.5 from {below:,}" if below else f"efficiency >= 0.5 up to {FAR[-1]:,}"
    thr = f"throughput peaks at {peak:,}" if peak else f"throughput rising up to {FAR[-1]:,}"
    return f"{eff}, {thr}"


# ----------------------------------------------------------------------------
# Driver


def _link_json(fit: sm.Fit) -> dict:
    return {
        "alpha": fit.link.alpha,
        "bandwidth": fit.link.bandwidth,
        "rms_log_error": fit.rms_log_error,
        "points": fit.points,
    }


def _fabric_json(fabric: sm.Fabric) -> dict:
    def link(x: sm.Link) -> dict:
        return {"alpha": x.alpha, "bandwidth": x.bandwidth}

    return {
        "name": fabric.name,
        "per_node": fabric.per_node,
        "intra": link(fabric.intra),
        "inter": link(fabric.inter),
        "local": link(fabric.local),
        "tree_alpha_intra": fabric.tree_alpha_intra,
        "tree_alpha_inter": fabric.tree_alpha_inter,
    }


def run() -> int:
    data = inputs.load(FLAGS.results_dir)
    missing = [name for name in inputs.REQUIRED if name not in data]
    if missing:
        print(f"scaling_model: missing {missing} under {FLAGS.results_dir}", file=sys.stderr)
        return 1
    points = inputs.allreduce_points(data)
    fits = fit_all(points)
    overlap_rows = inputs.fitted_step_rows(data)
    overlap = sm.fit_overlap(overlap_rows)
    bed = inputs.bed_fabrics(fits)
    checks = {
        "sizes": size_holdout(points),
        "ranks": ranks_holdout(points, fits, bed),
        "comm": comm_checks(data, fits, bed),
        "steps": step_checks(data, fits, overlap),
    }
    efficiency = inputs.link_efficiency(fits, data)
    fabrics = inputs.fabrics(fits, data, efficiency)
    predictions = all_predictions(fabrics, overlap)

    print_fits(fits, overlap, len(overlap_rows))
    print_checks("held out by size: fitted on <= 4 MB, predicting 16 and 64 MB", checks["sizes"])
    print_checks("held out by ranks: 2-rank fits predicting 4 ranks", checks["ranks"])
    print_checks("the training step's all-reduce, from the single-tensor fits", checks["comm"])
    print_checks("held out steps: the fitted overlap on other rows", checks["steps"])
    print(f"\nlink efficiency carried to the published fabrics: {efficiency:.2f}")
    print_predictions(predictions, overlap)

    _harness.save_results(
        FLAGS.json,
        "scaling_model",
        {
            "workers": WORKERS,
            "stops_paying_searched_up_to": FAR[-1],
            "formulas": inputs.FORMULAS,
            "fits": {name: _link_json(fit) for name, fit in fits.items()},
            "overlap": {"fraction": overlap, "rows": len(overlap_rows)},
            "link_efficiency": efficiency,
            "checks": checks,
            "fabrics": [_fabric_json(f) for f, _ in fabrics],
            "workloads": inputs.WORKLOAD_SOURCES,
            "predictions": predictions,
            "inputs": {
                name: {k: doc["meta"].get(k) for k in ("time", "quick", "load")}
                for name, doc in sorted(data.items())
            },
        },
        load="computed from saved results; no timing",
    )
    path = _plots.plot_scaling_model()
    if path:
        print(f"wrote {os.path.relpath(path)}")
    return 0


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    return run()


if __name__ == "__main__":
    app.run(main)

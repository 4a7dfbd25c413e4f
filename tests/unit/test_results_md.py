"""benchmarks/results_md.py: RESULTS.md from the benchmarks' JSON results, pure Python.

Two hand-made result files of the real shapes (trimmed copies of what
benchmarks/sparse_embeddings.py and benchmarks/multi_host.py save), one
figure, and the other benchmarks missing.
"""

import importlib.util
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load_script():
    if "results_md" in sys.modules:  # absl flags are defined once per process
        return sys.modules["results_md"]
    spec = importlib.util.spec_from_file_location(
        "results_md", os.path.join(REPO, "benchmarks", "results_md.py")
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["results_md"] = module
    spec.loader.exec_module(module)
    return module


results_md = _load_script()


def _summary(values):
    ordered = sorted(values)
    return {
        "median": ordered[len(ordered) // 2],
        "min": ordered[0],
        "max": ordered[-1],
        "values": values,
    }


def _meta(name, quick=False):
    return {
        "benchmark": name,
        "time": "2026-11-26 13:10:39 +0000",
        "argv": [f"benchmarks/{name}.py"],
        "cpus": 2,
        "load": "1-min load average at start 0.02 on 2 cores",
        "quick": quick,
    }


SPARSE = {
    "meta": _meta("sparse_embeddings"),
    "vocab": 1000000,
    "dim": 64,
    "batch": 1024,
    "optimizer": "sgd",
    "configs": {
        "sparse": {"step_ms": _summary([31.2, 27.0, 33.4]), "bytes_per_step": 270620},
        "dense": {"step_ms": _summary([208.8, 201.3, 220.6]), "bytes_per_step": 256000268},
        "plain": {"step_ms": _summary([24.5, 22.7, 25.8]), "bytes_per_step": 0},
    },
    "ratios": {
        "dense/sparse step time": _summary([7.08, 6.24, 7.45]),
        "sparse/plain step time": _summary([1.30, 1.10, 1.37]),
    },
    "bytes_ratio_dense_over_sparse": 945.98,
}


def _step(step, compute, comm, tail):
    return {
        "step": step,
        "compute": compute,
        "comm": comm,
        "tail": tail,
        "step_over_max_parts": step / max(compute, comm),
        "bound": (compute + tail) / max(compute, comm),
        "weight_sum": -38.7,
    }


MULTI_HOST = {
    "meta": _meta("multi_host", quick=True),
    "repeats": 2,
    "batch": 512,
    "results": [
        {
            "rate": "1gbit",
            "auto_engine": "tcp",
            "link_bytes_per_second": 125000000.0,
            "allreduce": [
                {
                    "name": "64 KB",
                    "bytes": 65536,
                    "bus_fraction": {
                        "ours_ring": 0.199,
                        "ours_gloo": 0.131,
                        "raw_tf": 0.276,
                        "sockets": 0.912,
                    },
                },
                {
                    "name": "4 MB",
                    "bytes": 4194304,
                    "bus_fraction": {
                        "ours_ring": 0.986,
                        "ours_gloo": 0.971,
                        "ours_tcp": 0.951,
                        "ours_auto": 0.948,
                        "raw_tf": 0.987,
                        "sockets": 0.996,
                    },
                    "tcp_over_sockets": 0.955,
                    "auto_over_sockets": 0.952,
                },
            ],
            "train": _step(0.0552, 0.0144, 0.0355, 0.0270),
            "compressed": {"fp16": _step(0.0375, 0.0144, 0.0174, 0.0133)},
        }
    ],
    "one_host": _step(0.0374, 0.0158, 0.0150, 0.0112),
}


def _write(directory, name, data):
    with open(os.path.join(directory, f"{name}.json"), "w") as f:
        json.dump(data, f)


def test_sections_figures_and_missing_benchmarks(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    _write(results, "sparse_embeddings", SPARSE)
    _write(results, "multi_host", MULTI_HOST)
    (results / "multi_host.png").write_bytes(b"\x89PNG\r\n")
    out = tmp_path / "RESULTS.md"

    assert results_md.main(["results_md"], results_dir=str(results), out=str(out)) == 0
    text = out.read_text()

    assert text.startswith("# Benchmark results\n")
    assert "## Sparse embedding gradients (`sparse_embeddings.py`)" in text
    assert "## Two hosts on a rate-limited link (`multi_host.py`)" in text
    # The machine note of each run, and the warning of a --quick one.
    assert "Measured 2026-11-26 13:10:39 +0000 on 2 cores" in text
    assert text.count("--quick") == 1
    # Headline figures and ratios.
    assert "| `dense` | 208.8 [201.3, 220.6] | 244.1 MB |" in text
    assert "| dense/sparse step time | 7.08 [6.24, 7.45] |" in text
    assert "| 1gbit | 4 MB | 0.99 | 0.97 | 0.95 | 0.95 | 0.99 | 1.00 | 0.95 | 0.95 |" in text
    assert '`implementation="auto"` picked, by its probe at start: 1gbit: tcp.' in text
    # A run from before the TCP ring: its columns are dashes.
    assert "| 1gbit | 64 KB | 0.20 | 0.13 | – | – | 0.28 | 0.91 | – | – |" in text
    # step / max and its bound: (14.4 + 27.0) / 35.5 ms.
    assert "| 1gbit | 55.2 | 14.4 | 35.5 | 1.55 | 1.17 | 1.48 |" in text
    assert "| 1gbit, fp16 |" in text
    # The figure beside the file, linked relatively; none for a missing PNG.
    assert "![All-reduce between two hosts against the link rate](results/multi_host.png)" in text
    assert "allreduce_bandwidth.png" not in text
    # A missing benchmark: its section says so in one line.
    assert "## Overhead against plain Keras (`overhead.py`)" in text
    assert "No results: `overhead.json` is missing" in text
    for name in results_md.KNOWN:
        if name not in ("sparse_embeddings", "multi_host"):
            assert f"No results: `{name}.json` is missing" in text
    assert "No results: `multi_host.json`" not in text
    assert not os.path.exists(str(out) + ".tmp")


def test_an_unknown_benchmark_gets_a_generic_section(tmp_path):
    _write(
        tmp_path,
        "new_bench",
        {
            "meta": _meta("new_bench"),
            "batch": 64,
            "ratios": {"ours / peer": _summary([1.5, 1.2, 1.8])},
        },
    )
    text = results_md.render(str(tmp_path), str(tmp_path / "RESULTS.md"))
    assert "## New bench (`new_bench.py`)" in text
    assert "| batch | 64 |" in text
    assert "| ours / peer | 1.50 [1.20, 1.80] |" in text


def test_the_host_engine_section_puts_the_engine_beside_memory_speed(tmp_path):
    ms = {"engine": [1.2, 1.1, 1.3], "numpy": [0.6, 0.5, 0.7], "lockstep": [0.1, 0.1, 0.2]}
    _write(
        tmp_path,
        "host_engine",
        {
            "meta": _meta("host_engine"),
            "repeats": 3,
            "calls": 50,
            "nbytes": 4232232,
            "ms": {k: _summary(v) for k, v in ms.items()},
            "gb_per_s": {"engine": _summary([3.5, 3.8, 3.3]), "numpy": _summary([7.1, 8.5, 6.0])},
            "ratios": {
                "engine_over_numpy": _summary([2.0, 2.2, 1.9]),
                "engine_less_lockstep_ms": _summary([1.1, 1.0, 1.1]),
            },
        },
    )
    text = results_md.render(str(tmp_path), str(tmp_path / "RESULTS.md"))
    assert "## The shared-memory all-reduce against memory speed (`host_engine.py`)" in text
    assert "(4.0 MB float32 in six arrays)" in text
    assert "| engine | 1.20 [1.10, 1.30] | 3.50 [3.30, 3.80] |" in text
    assert "| lockstep | 0.10 [0.10, 0.20] | – |" in text
    assert "| engine / numpy (time) | 2.00 [1.90, 2.20] |" in text


def test_the_tcp_engine_section_splits_the_gap_to_the_link(tmp_path):
    rates = {"sockets": [1.0, 1.1, 0.9], "engine": [0.9, 0.8, 1.0], "in_step": [0.8, 0.7, 0.9]}
    _write(
        tmp_path,
        "tcp_engine",
        {
            "meta": _meta("tcp_engine"),
            "rate": "10gbit",
            "repeats": 3,
            "calls": 5,
            "cases": [
                {
                    "bytes": 16 << 20,
                    "gb_per_s": {k: _summary(v) for k, v in rates.items()},
                    "ratios": {
                        "engine_over_sockets": _summary([0.9, 0.8, 1.0]),
                        "in_step_over_sockets": _summary([0.8, 0.7, 0.9]),
                        "in_step_over_engine": _summary([0.95, 0.9, 1.0]),
                    },
                }
            ],
        },
    )
    text = results_md.render(str(tmp_path), str(tmp_path / "RESULTS.md"))
    assert "## Our TCP ring alone against the plain exchange (`tcp_engine.py`)" in text
    assert "on a 10gbit link" in text
    assert (
        "| 16.0 MB | 1.00 [0.90, 1.10] | 0.90 [0.80, 1.00] | 0.80 [0.70, 0.90] "
        "| 0.90 [0.80, 1.00] | 0.80 [0.70, 0.90] | 0.95 [0.90, 1.00] |"
    ) in text


def test_the_scaling_model_section(tmp_path):
    check = {"check": "raw TF ring, 1gbit link: fit <= 4 MB", "ranks": 2, "bytes": 2**24}
    engine = {
        "efficiency": [0.9, 0.8],
        "stops_paying": {"efficiency_below_half": 16384, "throughput_peak": None},
    }
    data = {
        "meta": _meta("scaling_model"),
        "workers": [2, 1024],
        "stops_paying_searched_up_to": 131072,
        "fits": {
            "raw TF ring, 1gbit link": {
                "alpha": 4.4e-4,
                "bandwidth": 1.151e8,
                "rms_log_error": 0.123,
                "points": 5,
            }
        },
        "overlap": {"fraction": 0.22, "rows": 6},
        "link_efficiency": 0.99,
        "checks": {
            "sizes": [{**check, "measured": 0.1476, "predicted": 0.1285, "relative_error": -0.129}]
        },
        "predictions": [
            {
                "fabric": "A100 NVLink 3 + 200 Gbit/s",
                "workload": "ResNet-50 on A100",
                "engines": {"flat ring": engine},
            }
        ],
    }
    _write(tmp_path, "scaling_model", data)
    text = results_md.render(str(tmp_path), str(tmp_path / "RESULTS.md"))
    assert "## A scaling model past this machine (`scaling_model.py`)" in text
    assert "| raw TF ring, 1gbit link | 0.440 | 115.1 | 0.123 | 5 |" in text
    assert "| fitted on sizes up to 4 MB, predicting 16 and 64 MB | 1 | 13% | 13% |" in text
    assert "| raw TF ring, 1gbit link: fit <= 4 MB | 16.0 MB | 2 | 147.6 | 128.5 | -13% |" in text
    assert (
        "| A100 NVLink 3 + 200 Gbit/s | ResNet-50 on A100 | flat ring | 0.80 | 16,384 "
        "| > 131,072 |" in text
    )


def test_two_hosts_of_two_workers_compare_time_and_bytes_per_host(tmp_path):
    seconds = {"ring": 0.0577, "tcp": 0.0512, "hierarchical": 0.0388}
    sent = {"ring": 1.5 * 2**22, "tcp": 1.5 * 2**22, "hierarchical": 2**22}
    train = {n: {"step": 2 * t, "host_bytes_per_step": sent[n]} for n, t in seconds.items()}
    case = {"name": "4 MB", "bytes": 2**22, "seconds": seconds, "host_bytes": sent}
    _write(
        tmp_path,
        "multi_host_2x2",
        {
            "meta": _meta("multi_host"),
            "repeats": 3,
            "batch": 512,
            "slots": 2,
            "results": [{"rate": "1gbit", "allreduce": [case], "train": train}],
        },
    )
    text = results_md.render(str(tmp_path), str(tmp_path / "RESULTS.md"))
    assert "## Two hosts of two workers: hierarchical against flat " in text
    assert "(`multi_host.py --layout 2x2`)" in text
    assert "| 1gbit | 4 MB | 57.7 | 51.2 | 38.8 | 6.0 MB | 6.0 MB | 4.0 MB |" in text
    assert "| 1gbit | training step | 115.4 | 102.4 | 77.6 | 6.0 MB | 6.0 MB | 4.0 MB |" in text

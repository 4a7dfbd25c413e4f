"""What benchmarks/scaling_model.py reads and assumes: the measured points
from the saved results, and the published numbers of the GPU fabrics and
models it predicts for (each with its source).

Pure Python (json, os, statistics): no TensorFlow, no absl.
"""

from __future__ import annotations

import json
import os
import statistics

import _scaling as sm

# The saved results the model reads (under the results directory); the
# first three are required, the runs beyond two ranks are checks only.
REQUIRED = ("multi_host", "allreduce", "weak_scaling")
OPTIONAL = (
    "scaling/allreduce_nproc4_shm",
    "scaling/allreduce_nproc4_ring",
    "scaling/multi_host_2x2",
)

SHM = "ours, shared memory, one host"
LOOPBACK = "raw TF ring, one host"
OURS_RING_LOCAL = "ours over TF ring, one host"
# Engines measured on 4 ranks only, and the 2-rank fit that predicts them.
TWO_RANK_SOURCE = {OURS_RING_LOCAL: LOOPBACK}

_LINK_ENGINES = {
    "ours_ring": "ours over TF ring",
    "raw_tf": "raw TF ring",
    "ours_gloo": "ours over Gloo",
    "ours_tcp": "ours over TCP ring",
    "sockets": "plain TCP, no reduction",
}

FORMULAS = {
    "ring": "2(n-1)*alpha + 2(n-1)/n * S/B",
    "flat ring (nodes)": "(2(n-1) - 2(m-1))*alpha_intra + 2(m-1)*alpha_inter + 2(n-1)/n * S/B_min",
    "tree": "2*((n/m - 1)*alpha_tree_intra + log2(m)*alpha_tree_inter) + 2*S/B_min",
    "hierarchical": "2*ring(n/m, S, local) + ring(m, S, inter); ring(n, S, local) on one node",
    "step": "compute + comm - overlap*min(compute, comm)",
    "efficiency": "compute / step",
    "sources": "busbw = algbw * 2(n-1)/n: nccl-tests doc/PERFORMANCE.md; ring and tree "
    "latencies and the tree's algbw = busbw/2: NCCL src/graph/tuning.cc",
}


def link_name(engine: str, rate: str) -> str:
    return f"{_LINK_ENGINES[engine]}, {rate} link"


def load(results_dir: str) -> dict:
    """{name: parsed JSON} of every input present."""
    data = {}
    for name in REQUIRED + OPTIONAL:
        path = os.path.join(results_dir, f"{name}.json")
        if os.path.exists(path):
            with open(path) as f:
                data[name] = json.load(f)
    return data


# ----------------------------------------------------------------------------
# Measured points: {engine: [(ranks, bytes, seconds)]}


def _multi_host_points(doc: dict, points: dict) -> None:
    for result in doc["results"]:
        ranks = result.get("ranks", 2)
        wire = result["link_bytes_per_second"]
        for size in result["allreduce"]:
            for engine, fraction in size["bus_fraction"].items():
                if engine not in _LINK_ENGINES:  # "auto": one of the engines again
                    continue
                seconds = size.get("seconds", {}).get(engine)
                if seconds is None:  # bus bytes / (fraction of the link)
                    seconds = size["bytes"] * 2 * (ranks - 1) / ranks / (fraction * wire)
                name = link_name(engine, result["rate"])
                points.setdefault(name, []).append((ranks, size["bytes"], seconds))


def _allreduce_points(doc: dict, ours: str, points: dict) -> None:
    for launch in doc["launches"]:
        n = launch["world_size"]
        for case in launch["cases"]:
            if case["num_tensors"] != 1:  # many-small: a list, not one tensor
                continue
            for variant, name in (("ours", ours), ("raw", LOOPBACK)):
                seconds = statistics.median(case["seconds"][variant])
                points.setdefault(name, []).append((n, case["bytes"], seconds))


def allreduce_points(data: dict) -> dict:
    points: dict = {}
    _multi_host_points(data["multi_host"], points)
    _allreduce_points(data["allreduce"], SHM, points)
    if "scaling/allreduce_nproc4_shm" in data:
        _allreduce_points(data["scaling/allreduce_nproc4_shm"], SHM, points)
    if "scaling/allreduce_nproc4_ring" in data:
        _allreduce_points(data["scaling/allreduce_nproc4_ring"], OURS_RING_LOCAL, points)
    if "scaling/multi_host_2x2" in data:
        _multi_host_points(data["scaling/multi_host_2x2"], points)
    return points


def rates(data: dict) -> list[tuple[str, float]]:
    """(rate, bytes/s) of each link multi_host.json measured, slowest first."""
    found = [(r["rate"], r["link_bytes_per_second"]) for r in data["multi_host"]["results"]]
    return sorted(found, key=lambda x: x[1])


# ----------------------------------------------------------------------------
# Step rows: (step, compute, comm) in seconds


def _row(t: dict) -> tuple[float, float, float]:
    return t["step"], t["compute"], t["comm"]


def fitted_step_rows(data: dict) -> list[tuple[float, float, float]]:
    """The two-host step rows the overlap is fitted on (plain and compressed)."""
    rows = []
    for result in data["multi_host"]["results"]:
        rows.append(_row(result["train"]))
        rows += [_row(t) for t in result.get("compressed", {}).values()]
    return rows


def held_out_step_rows(data: dict) -> dict:
    """{where: row} of the step rows the overlap is not fitted on."""
    rows = {}
    if "one_host" in data["multi_host"]:
        rows["one host, 2 workers (TF ring over loopback)"] = _row(data["multi_host"]["one_host"])
    for result in data.get("scaling/multi_host_2x2", {}).get("results", []):
        rows[f"2 hosts x 2 workers, {result['rate']} link"] = _row(result["train"])
    return rows


# ----------------------------------------------------------------------------
# Fabrics


def bed_fabric(fits: dict, engine: str, rate: str, name: str = "") -> sm.Fabric:
    """This project's engines on hosts of 2 workers joined by `rate`: TF's
    ring over loopback inside a host, `engine` over the link between
    hosts, shared memory as the hierarchical all-reduce's local engine."""
    inside, between = fits[LOOPBACK].link, fits[link_name(engine, rate)].link
    return sm.Fabric(
        name=name or f"{_LINK_ENGINES[engine]}, hosts of 2 on {rate}",
        per_node=2,
        intra=inside,
        inter=between,
        local=fits[SHM].link,
        tree_alpha_intra=inside.alpha,
        tree_alpha_inter=between.alpha,
    )


def bed_fabrics(fits: dict) -> dict:
    """{link engine name: its fabric} for the 2 x 2 check."""
    found = {}
    for name in fits:
        for engine in ("ours_ring", "raw_tf"):
            for rate in ("1gbit", "10gbit"):
                if name == link_name(engine, rate) and LOOPBACK in fits and SHM in fits:
                    found[name] = bed_fabric(fits, engine, rate)
    return found


def link_efficiency(fits: dict, data: dict) -> float:
    """The fraction of a link's rate our faster ring (over TensorFlow's
    collectives or our TCP ring, what `"auto"` would pick) reached where the
    link, not the CPU, was the bottleneck (the slowest link measured), at most 1."""
    rate, wire = rates(data)[0]
    ours = [link_name(e, rate) for e in ("ours_ring", "ours_tcp")]
    return min(1.0, max(fits[n].link.bandwidth for n in ours if n in fits) / wire)


# NCCL's per-step latencies of the Simple protocol (the one large gradients
# use), microseconds: NCCL 2.7's src/graph/tuning.cc, hwLat[NVLINK|NET]
# [TREE|RING][SIMPLE] (commit 01afd20a of NVIDIA/nccl).
NCCL_US = {"ring_nvlink": 3.4, "ring_net": 9.6, "tree_nvlink": 28.0, "tree_net": 50.0}

# Published per-direction rates in bytes/s: NVLink 3 (A100) 300 GB/s and
# NVLink 4 (H100) 450 GB/s per GPU (NVIDIA's A100 and H100 datasheets, 600
# and 900 GB/s both directions); InfiniBand per node: 100 Gbit/s (EDR/HDR100),
# 200 Gbit/s (HDR), 400 Gbit/s (NDR).
GPU_FABRICS = (
    ("A100 NVLink 3 + 100 Gbit/s InfiniBand per node", 300e9, 100e9 / 8, "A100"),
    ("A100 NVLink 3 + 200 Gbit/s HDR InfiniBand per node", 300e9, 200e9 / 8, "A100"),
    ("H100 NVLink 4 + 400 Gbit/s NDR InfiniBand per node", 450e9, 400e9 / 8, "H100"),
)

# Compute per step from published single-GPU training throughput, mixed
# precision, at the recipe's batch per GPU; one all-reduce of fp32
# gradients per step (no gradient accumulation).
WORKLOAD_SOURCES = {
    "ResNet-50": {
        "params": 25.6e6,
        "batch": 256,
        "a100_samples_per_s": 2470.0,
        "source": "NVIDIA DeepLearningExamples, PyTorch/Classification/ConvNets/resnet50v1.5 "
        "README, 'Training performance: NVIDIA DGX A100 (8x A100 80GB)', 1 GPU, mixed "
        "precision, batch 256 per GPU",
        "h100_speedup": 2.0,
    },
    "BERT-large": {
        "params": 340e6,
        "batch": 256,
        "a100_samples_per_s": 694.0,
        "source": "NVIDIA DeepLearningExamples, PaddlePaddle/LanguageModeling/BERT README, "
        "'Pre-training NVIDIA DGX A100 (8x A100 80GB)', 1 GPU, mixed precision, sequence "
        "length 128, batch 256 per GPU",
        "h100_speedup": 4.0,
    },
    "h100_source": "H100 SXM over A100 SXM training speedups, ~2x for vision and ~4x for "
    "language models: Lambda, 'NVIDIA H100 Tensor Core GPU - Deep Learning Performance "
    "Analysis'",
}


def _gpu_workloads(gpu: str) -> list[dict]:
    found = []
    for name in ("ResNet-50", "BERT-large"):
        w = WORKLOAD_SOURCES[name]
        compute = w["batch"] / w["a100_samples_per_s"]
        if gpu == "H100":
            compute /= w["h100_speedup"]
        found.append({"name": f"{name} on {gpu}", "bytes": 4 * w["params"], "compute": compute})
    return found


def _gpu_fabric(name: str, nvlink: float, network: float, efficiency: float) -> sm.Fabric:
    us = 1e-6
    inside = sm.Link(NCCL_US["ring_nvlink"] * us, efficiency * nvlink)
    return sm.Fabric(
        name=name,
        per_node=8,
        intra=inside,
        inter=sm.Link(NCCL_US["ring_net"] * us, efficiency * network),
        local=inside,
        tree_alpha_intra=NCCL_US["tree_nvlink"] * us,
        tree_alpha_inter=NCCL_US["tree_net"] * us,
    )


# The benchmark's MLP (784-1024-256-10): its gradients in bytes.
MLP_BYTES = 4 * (784 * 1024 + 1024 + 1024 * 256 + 256 + 256 * 10 + 10)


def fabrics(fits: dict, data: dict, efficiency: float) -> list[tuple[sm.Fabric, list[dict]]]:
    """(fabric, workloads) to predict for: ours on each measured link, then the GPU fabrics."""
    compute = statistics.median(r["train"]["compute"] for r in data["multi_host"]["results"])
    mlp = {"name": "the multi_host MLP on CPU workers", "bytes": MLP_BYTES, "compute": compute}
    found = [
        (bed_fabric(fits, "ours_ring", rate, f"ours, hosts of 2 CPU workers on {rate}"), [mlp])
        for rate, _ in rates(data)
    ]
    for name, nvlink, network, gpu in GPU_FABRICS:
        found.append((_gpu_fabric(name, nvlink, network, efficiency), _gpu_workloads(gpu)))
    return found

"""benchmarks/_scaling.py, the scaling model's formulas and fit: hand-computed
values, and the fit recovering known parameters from synthetic times."""

import importlib.util
import math
import os
import random
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load(name):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(REPO, "benchmarks", f"{name}.py")
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


sm = _load("_scaling")

MB = 1e6
LINK = sm.Link(alpha=1e-4, bandwidth=1e8)  # 0.1 ms a step, 100 MB/s
NVLINK = sm.Link(alpha=1e-6, bandwidth=1e11)
FABRIC = sm.Fabric(
    name="test: 4 ranks a node",
    per_node=4,
    intra=NVLINK,
    inter=LINK,
    local=NVLINK,
    tree_alpha_intra=2e-6,
    tree_alpha_inter=2e-4,
)


def test_ring_by_hand():
    # n=2: 2 steps of alpha, and the tensor once over the link.
    assert sm.ring(2, 100 * MB, LINK) == pytest.approx(2e-4 + 1.0)
    # n=4: 6 steps; 2*3/4 = 1.5 times the tensor.
    assert sm.ring(4, 100 * MB, LINK) == pytest.approx(6e-4 + 1.5)
    assert sm.ring(1, 100 * MB, LINK) == 0.0


def test_the_fabric_formulas_by_hand():
    # 16 ranks on 4 nodes: 30 steps, 6 of them between nodes; the slowest
    # link (100 MB/s) carries 2*15/16 of 100 MB.
    assert sm.nodes(16, FABRIC) == (4, 4)
    assert sm.flat_ring(16, 100 * MB, FABRIC) == pytest.approx(24e-6 + 6e-4 + 1.875)
    # tree: 2*((4-1)*2us + log2(4)*0.2ms) + 2*100 MB / 100 MB/s.
    assert sm.tree(16, 100 * MB, FABRIC) == pytest.approx(2 * (6e-6 + 4e-4) + 2.0)
    # hierarchical: a local all-reduce of 4 twice, a ring of the 4 nodes.
    local = 6e-6 + 1.5 * 100 * MB / 1e11
    assert sm.hierarchical(16, 100 * MB, FABRIC) == pytest.approx(2 * local + 6e-4 + 1.5)
    # Inside one node every engine stays on the fast links.
    assert sm.flat_ring(4, 100 * MB, FABRIC) == pytest.approx(sm.ring(4, 100 * MB, NVLINK))
    assert sm.hierarchical(4, 100 * MB, FABRIC) == pytest.approx(sm.ring(4, 100 * MB, NVLINK))
    assert sm.tree(4, 100 * MB, FABRIC) == pytest.approx(2 * 3 * 2e-6 + 2 * 100 * MB / 1e11)


def test_one_rank_a_node_is_the_textbook_ring_and_tree():
    flat = sm.Fabric("flat", 1, LINK, LINK, LINK, LINK.alpha, LINK.alpha)
    assert sm.flat_ring(8, 10 * MB, flat) == pytest.approx(sm.ring(8, 10 * MB, LINK))
    assert sm.tree(8, 10 * MB, flat) == pytest.approx(2 * 3 * 1e-4 + 2 * 0.1)
    assert sm.hierarchical(8, 10 * MB, flat) == pytest.approx(sm.ring(8, 10 * MB, LINK))


def test_step_efficiency_and_where_it_stops_paying():
    assert sm.step_time(0.10, 0.04, 0.0) == pytest.approx(0.14)
    assert sm.step_time(0.10, 0.04, 0.5) == pytest.approx(0.12)
    assert sm.step_time(0.10, 0.04, 1.0) == pytest.approx(0.10)  # max(compute, comm)
    assert sm.efficiency(0.10, 0.125) == pytest.approx(0.8)
    workers = [2, 4, 8, 16]
    # Steps 0.1, 0.15, 0.25, 0.6: efficiency 0.4 from 8; 16/0.6 < 8/0.25.
    stop = sm.stops_paying(workers, [0.1, 0.15, 0.25, 0.6], 0.1)
    assert stop == {"efficiency_below_half": 8, "throughput_peak": 8}
    assert sm.stops_paying(workers, [0.1] * 4, 0.1) == {
        "efficiency_below_half": None,
        "throughput_peak": None,
    }


def test_the_fit_recovers_known_parameters():
    sizes = [2**k for k in (12, 16, 20, 22, 24, 26)]
    exact = [(2, s, sm.ring(2, s, LINK)) for s in sizes]
    fit = sm.fit_ring(exact)
    assert fit.link.alpha == pytest.approx(LINK.alpha, rel=1e-6)
    assert fit.link.bandwidth == pytest.approx(LINK.bandwidth, rel=1e-6)
    assert fit.rms_log_error == pytest.approx(0.0, abs=1e-9)
    # 5% multiplicative noise on 2 and 4 ranks: within a few percent.
    rng = random.Random(0)
    noisy = [
        (n, s, sm.ring(n, s, LINK) * math.exp(rng.gauss(0, 0.05))) for n in (2, 4) for s in sizes
    ]
    fit = sm.fit_ring(noisy)
    assert fit.link.alpha == pytest.approx(LINK.alpha, rel=0.1)
    assert fit.link.bandwidth == pytest.approx(LINK.bandwidth, rel=0.05)
    assert 0.01 < fit.rms_log_error < 0.1


def test_the_fit_keeps_both_parameters_positive():
    # Pure bandwidth (no latency at all): alpha goes to ~0, not below.
    fit = sm.fit_ring([(2, s, s / 1e8) for s in (1e4, 1e6, 1e8)])
    assert 0 < fit.link.alpha < 1e-8
    assert fit.link.bandwidth == pytest.approx(1e8, rel=1e-3)
    with pytest.raises(ValueError):
        sm.fit_ring([(2, 1e6, 0.01)])


def test_the_overlap_fit():
    rows = [(0.10 + c - 0.3 * min(0.10, c), 0.10, c) for c in (0.02, 0.05, 0.2)]
    assert sm.fit_overlap(rows) == pytest.approx(0.3)
    assert sm.fit_overlap([(0.5, 0.1, 0.1)]) == 0.0  # slower than serial: clipped
    assert sm.fit_overlap([(0.05, 0.1, 0.1)]) == 1.0

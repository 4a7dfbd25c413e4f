"""The cost model behind benchmarks/scaling_model.py: alpha-beta formulas for
one all-reduce, the training step around it, and the fit of a link's
parameters to measured times.

Pure Python (math only), so the unit tier tests it without TensorFlow.

A `Link` is the alpha-beta description of a path between two ranks: `alpha`
seconds per message step (latency and per-call overhead) and `bandwidth`
bytes per second in each direction. For `n` ranks and a tensor of `size`
bytes:

  ring          2(n-1)·alpha + 2(n-1)/n · size/bandwidth
                (reduce-scatter then all-gather, 2(n-1) steps of size/n
                bytes each; 2(n-1)/n is nccl-tests' bus-bandwidth factor for
                all-reduce, busbw = algbw · 2(n-1)/n, doc/PERFORMANCE.md).

On a `Fabric` of nodes of `per_node` ranks (n ranks on m = n / per_node
nodes; one node when n <= per_node), after NCCL's own cost model
(src/graph/tuning.cc, `ncclTopoTuneModel`: ring latency
`(nsteps - nInterSteps)·intraLat + nInterSteps·interLat` with
nsteps = 2(n-1), nInterSteps = 2(m-1); tree latency
`2·((n/m - 1)·intraLat + log2(m)·interLat)`; tree algorithm bandwidth =
bus bandwidth / 2):

  flat ring     (2(n-1) - 2(m-1))·alpha_intra + 2(m-1)·alpha_inter
                + 2(n-1)/n · size/B, B the slowest link the ring crosses
  tree          2·((n/m - 1)·alpha_tree_intra + log2(m)·alpha_tree_inter)
                + 2·size/B (NCCL's double binary tree: a reduce up and a
                broadcast down, pipelined; each rank sends and receives
                `size` bytes in each)
  hierarchical  reduce to one rank per node and broadcast back, each as
                costly as the local engine's ring all-reduce of size bytes
                over per_node ranks (reduce-scatter + gather; scatter +
                all-gather), and a ring all-reduce over the m nodes between
                them: 2·ring(per_node, local) + ring(m, inter); on one node,
                the local all-reduce alone.

The step of data-parallel training (weak scaling: the same batch per rank):

  step          compute + comm - overlap·min(compute, comm)
                (overlap = 0: the all-reduce waits for the backward pass;
                overlap = 1: the shorter one hides entirely)
  efficiency    compute / step (1: linear scaling).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence


@dataclass(frozen=True)
class Link:
    """alpha: seconds per message step; bandwidth: bytes/s per direction."""

    alpha: float
    bandwidth: float


@dataclass(frozen=True)
class Fabric:
    """Nodes of `per_node` ranks: `intra` between ranks of a node, `inter`
    between nodes (each node's network interface), `local` the engine the
    hierarchical all-reduce uses inside a node, and the tree's own
    latencies per step (NCCL models them apart from the ring's)."""

    name: str
    per_node: int
    intra: Link
    inter: Link
    local: Link
    tree_alpha_intra: float
    tree_alpha_inter: float


def ring(n: int, size: float, link: Link) -> float:
    """Seconds of a ring all-reduce of `size` bytes over `n` ranks."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * link.alpha + 2 * (n - 1) / n * size / link.bandwidth


def nodes(n: int, fabric: Fabric) -> tuple[int, int]:
    """(ranks per node, nodes) for `n` ranks: one node until it is full."""
    per_node = min(n, fabric.per_node)
    return per_node, math.ceil(n / per_node)


def _slowest(fabric: Fabric, m: int) -> float:
    if m == 1:
        return fabric.intra.bandwidth
    return min(fabric.intra.bandwidth, fabric.inter.bandwidth)


def flat_ring(n: int, size: float, fabric: Fabric) -> float:
    """One ring over all `n` ranks (NCCL's ring latency model)."""
    if n <= 1:
        return 0.0
    _, m = nodes(n, fabric)
    steps, inter_steps = 2 * (n - 1), 2 * (m - 1)
    latency = (steps - inter_steps) * fabric.intra.alpha + inter_steps * fabric.inter.alpha
    return latency + 2 * (n - 1) / n * size / _slowest(fabric, m)


def tree(n: int, size: float, fabric: Fabric) -> float:
    """NCCL's double binary tree over the nodes, a chain inside each."""
    if n <= 1:
        return 0.0
    g, m = nodes(n, fabric)
    latency = 2 * ((g - 1) * fabric.tree_alpha_intra + math.log2(m) * fabric.tree_alpha_inter)
    return latency + 2 * size / _slowest(fabric, m)


def hierarchical(n: int, size: float, fabric: Fabric) -> float:
    """Reduce inside each node, ring across nodes (one rank each), broadcast back."""
    if n <= 1:
        return 0.0
    g, m = nodes(n, fabric)
    if m == 1:
        return ring(g, size, fabric.local)
    return 2 * ring(g, size, fabric.local) + ring(m, size, fabric.inter)


ENGINES = {"flat ring": flat_ring, "tree": tree, "hierarchical": hierarchical}


def step_time(compute: float, comm: float, overlap: float) -> float:
    """compute + comm - overlap·min(compute, comm)."""
    return compute + comm - overlap * min(compute, comm)


def efficiency(compute: float, step: float) -> float:
    return compute / step if step > 0 else 1.0


# ----------------------------------------------------------------------------
# Fitting


@dataclass(frozen=True)
class Fit:
    """A fitted link, with the root mean square of log(model / measured)
    over the `points` it was fitted on."""

    link: Link
    rms_log_error: float
    points: int


def _solve2(a11: float, a12: float, a22: float, b1: float, b2: float) -> tuple[float, float]:
    det = a11 * a22 - a12 * a12
    if abs(det) < 1e-300:
        raise ValueError("the points do not determine both parameters")
    return (b1 * a22 - b2 * a12) / det, (a11 * b2 - a12 * b1) / det


def _columns(n: int, size: float) -> tuple[float, float]:
    """The ring formula's coefficients of alpha and of 1/bandwidth."""
    return 2.0 * (n - 1), 2.0 * (n - 1) / n * size


def _relative_least_squares(points: Sequence[tuple[int, float, float]]) -> tuple[float, float]:
    """(alpha, 1/bandwidth) minimising the squared relative errors, both
    kept positive: the linear start of the log-time fit."""
    rows = [(c1 / t, c2 / t) for n, s, t in points for c1, c2 in [_columns(n, s)]]
    suu = sum(u * u for u, _ in rows)
    suv = sum(u * v for u, v in rows)
    svv = sum(v * v for _, v in rows)
    try:
        a, b = _solve2(suu, suv, svv, sum(u for u, _ in rows), sum(v for _, v in rows))
    except ValueError:
        a, b = -1.0, -1.0
    if a > 0 and b > 0:
        return a, b
    # One term alone explains the points better: fit it, keep the other tiny.
    only_a = sum(u for u, _ in rows) / suu
    only_b = sum(v for _, v in rows) / svv
    return max(only_a, 1e-12), max(only_b, 1e-18)


def fit_ring(points: Iterable[tuple[int, float, float]], iterations: int = 100) -> Fit:
    """alpha and bandwidth of the ring formula fitted to `(n, size, seconds)`
    points by least squares on log time (Gauss-Newton with damping, in the
    logs of the parameters, so both stay positive), from the relative
    least-squares solution."""
    pts = [(int(n), float(s), float(t)) for n, s, t in points]
    if len(pts) < 2:
        raise ValueError("fitting two parameters needs at least two points")
    a, b = _relative_least_squares(pts)
    damping = 1e-3
    for _ in range(iterations):
        residuals, jac = [], []
        for n, s, t in pts:
            c1, c2 = _columns(n, s)
            model = a * c1 + b * c2
            residuals.append(math.log(model / t))
            jac.append((a * c1 / model, b * c2 / model))
        cost = sum(r * r for r in residuals)
        j11 = sum(x * x for x, _ in jac) + damping
        j12 = sum(x * y for x, y in jac)
        j22 = sum(y * y for _, y in jac) + damping
        g1 = sum(x * r for (x, _), r in zip(jac, residuals))
        g2 = sum(y * r for (_, y), r in zip(jac, residuals))
        d1, d2 = _solve2(j11, j12, j22, -g1, -g2)
        na, nb = a * math.exp(max(min(d1, 5.0), -5.0)), b * math.exp(max(min(d2, 5.0), -5.0))
        new_cost = sum(math.log(ring(n, s, Link(na, 1 / nb)) / t) ** 2 for n, s, t in pts)
        if new_cost <= cost:
            a, b, damping = na, nb, max(damping / 10, 1e-12)
            if cost - new_cost < 1e-15:
                break
        else:
            damping *= 10
    rms = math.sqrt(
        sum(math.log(ring(n, s, Link(a, 1 / b)) / t) ** 2 for n, s, t in pts) / len(pts)
    )
    return Fit(Link(a, 1 / b), rms, len(pts))


def fit_overlap(rows: Iterable[tuple[float, float, float]]) -> float:
    """The overlap fraction, in [0, 1], that best explains `(step, compute,
    comm)` rows by least squares: step = compute + comm - overlap·min."""
    num = den = 0.0
    for step, compute, comm in rows:
        shorter = min(compute, comm)
        num += (compute + comm - step) * shorter
        den += shorter * shorter
    if den == 0:
        raise ValueError("no rows to fit the overlap on")
    return max(0.0, min(1.0, num / den))


def relative_error(predicted: float, measured: float) -> float:
    """(predicted - measured) / measured."""
    return (predicted - measured) / measured


def stops_paying(
    workers: Sequence[int], steps: Sequence[float], compute: float
) -> dict[str, Optional[int]]:
    """Where adding workers stops paying, under weak scaling (throughput ∝
    workers / step): `efficiency_below_half`, the fewest workers whose
    efficiency is under 0.5, and `throughput_peak`, the count after which
    throughput no longer rises (None: still rising at the last count)."""
    below = next((n for n, s in zip(workers, steps) if efficiency(compute, s) < 0.5), None)
    peak = None
    for i in range(1, len(workers)):
        if workers[i] / steps[i] <= workers[i - 1] / steps[i - 1]:
            peak = workers[i - 1]
            break
    return {"efficiency_below_half": below, "throughput_peak": peak}

"""Which engine `multi_worker(implementation="auto")` reduces with across hosts.

Across hosts, with one device per worker, the candidates are TensorFlow's
collectives (`"tensorflow"`, a gRPC ring on CPUs), our TCP ring over every
worker (`"tcp"`), when some host runs several workers, the hierarchical
all-reduce (`"hierarchical"`: shared memory within hosts, a TCP ring
between them), and where every worker can load Horovod, Horovod's Gloo
(`"gloo"`). Which is fastest depends on the link, the hosts
and the tensors, so the workers measure: each times every candidate on
`PROBE_SIZES` (float32 tensors of a typical gradient list's large and
small sizes), keeping its best of `REPEATS` timings after a warm-up; the
slowest worker's time counts (a collective ends when its last worker
does), agreed by one sum over the workers so that every worker picks the
same; the candidate with the least total wins. Each reduces exactly, so the
choice changes speed only.

`PROBE_ENV=0` skips the measurement: then `rule` picks (hierarchical where
some host has several workers, else the TCP ring).

Pure Python, no TensorFlow: `keras_distrib.strategies.multi_worker_engines`
runs the probe.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping, Optional, Sequence

PROBE_ENV = "KERAS_DISTRIB_PROBE"
PROBE_SIZES = (4 << 20, 64 << 10)  # bytes of each probe tensor (float32)
REPEATS = 2  # timings of each size per candidate, after one warm-up call
TENSORFLOW, TCP, HIERARCHICAL, GLOO = "tensorflow", "tcp", "hierarchical", "gloo"


@dataclasses.dataclass(frozen=True)
class Choice:
    """The engine picked (`name`), and why (`reason`, one line);
    `seconds`: each candidate's measured total, when measured."""

    name: str
    reason: str
    seconds: Optional[Mapping[str, float]] = None

    def __str__(self) -> str:
        return f"{self.name} ({self.reason})"


def several_per_host(hosts: Sequence[str]) -> bool:
    """Whether some host of `hosts` (every worker's, by rank) runs several workers."""
    return len(set(hosts)) < len(hosts)


def candidates(hosts: Sequence[str], gloo: bool = False) -> list[str]:
    """The engines to measure for workers on `hosts`, in the order measured
    (and preferred on a tie); `gloo`: every worker can load Horovod."""
    ours = [HIERARCHICAL, TCP] if several_per_host(hosts) else [TCP]
    return [*ours, *([GLOO] if gloo else []), TENSORFLOW]


def rule(hosts: Sequence[str], why: str) -> Choice:
    """The choice without measuring (`why`: what skipped it)."""
    if several_per_host(hosts):
        return Choice(HIERARCHICAL, f"auto, not measured ({why}): several workers on a host")
    return Choice(TCP, f"auto, not measured ({why}): one worker per host")


def probe_wanted(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether this worker asks for the measurement (`PROBE_ENV` not "0")."""
    value = (os.environ if environ is None else environ).get(PROBE_ENV, "1")
    return value.strip() not in ("0", "false", "no", "off")


def slowest(per_worker: Sequence[Sequence[float]]) -> list[float]:
    """Each timing's slowest worker: the max over `per_worker` (one list of
    timings per worker, in one order)."""
    return [max(column) for column in zip(*per_worker)]


def choose(
    names: Sequence[str], timings: Sequence[float], probe_seconds: Optional[float] = None
) -> Choice:
    """The fastest of `names` given `timings` (each name's timings of
    every `PROBE_SIZES`, in order, end to end: the slowest worker's); a
    tie goes to the first. `probe_seconds`: what the whole probe took, said
    in the reason."""
    per_size = len(PROBE_SIZES)
    if len(timings) != per_size * len(names):
        raise ValueError(f"{len(timings)} timings for {len(names)} engines x {per_size} sizes")
    totals = {
        name: float(sum(timings[i * per_size : (i + 1) * per_size])) for i, name in enumerate(names)
    }
    best = min(names, key=lambda n: (totals[n], names.index(n)))
    sizes = " + ".join(_size(b) for b in PROBE_SIZES)
    measured = ", ".join(f"{n} {1e3 * totals[n]:.1f} ms" for n in names)
    if probe_seconds is not None:
        measured += f"; probe {probe_seconds:.2f} s"
    return Choice(
        best, f"auto: the fastest all-reduce of {sizes} float32 ({measured})", dict(totals)
    )


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"

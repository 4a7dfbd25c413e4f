"""Whether our engines reduce gradient packs while the backward pass runs: where a core is spare.

On our engines (shared memory, the TCP ring, the hierarchical all-reduce)
the reduction is work for a CPU core: adding the workers' gradients and
moving them through memory or the kernel's sockets. In packs
(`numpy_engine.packs`), a pack is reduced as soon as the backward pass
has made its gradients, while the backward pass makes the others; that
pays only where a core is free to do it. Where the workers' computation
already keeps every core busy (TensorFlow's CPU kernels use all the cores
a process may run on unless told otherwise), a pack reduced early takes
its core from the backward pass, and the step gains nothing but the
packs' own per-call cost (benchmarks/RESULTS.md, the two-host step over
our TCP ring: in packs no faster than in one pack, on hosts with no core
spare).

So with `bytes_per_pack=None`, `multi_worker`'s default, our engines
reduce in packs of `OVERLAP_PACK_BYTES` when this host has a core to
spare, and in one pack after the backward pass otherwise. A host's cores
are the ones this process may run on (`os.sched_getaffinity`); each
worker computes on one core when its replica is a GPU or TPU (the thread
that drives the device), else on TensorFlow's intra-op threads (its
`intra_op_parallelism_threads` or `TF_NUM_INTRAOP_THREADS`, all the
cores when neither is set). A pack's collective is a `tf.numpy_function`
that holds the TensorFlow thread running it until the reduction ends: with
one inter-op thread (`inter_op_parallelism_threads` or
`TF_NUM_INTEROP_THREADS` set to 1; left unset, TensorFlow takes one per
core) no pack runs beside the backward pass, so then there is one pack
too. An explicit `bytes_per_pack` is taken as given (`describe` says when
one inter-op thread keeps its packs from overlapping).

Packing changes no sum on one host and only the order of additions in a
ring of more than two workers: the choice changes speed only.

Pure Python, no TensorFlow: `multi_worker` supplies the figures.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

# Packs of this many bytes when a core is spare: a model's last layers
# usually make up a pack of their own, reduced while the first layers'
# gradients are still being made (PyTorch's DistributedDataParallel sizes
# its first bucket alike); small enough to start early, large enough that
# the engine's per-call cost stays a small part of its time.
OVERLAP_PACK_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class Packing:
    """How the step's gradients go to our engines: in packs of about
    `bytes_per_pack` bytes (0: one pack, after the backward pass), and why
    (`reason`, one line)."""

    bytes_per_pack: int
    reason: str

    def __str__(self) -> str:
        return self.reason


def host_cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def intra_op_threads(configured: int) -> int:
    """TensorFlow's intra-op threads: `configured` (its
    `intra_op_parallelism_threads`), else `TF_NUM_INTRAOP_THREADS`, which
    its thread pool reads when that is unset; 0 when neither is set."""
    return _threads(configured, "TF_NUM_INTRAOP_THREADS")


def inter_op_threads(configured: int) -> int:
    """TensorFlow's inter-op threads: `configured` (its
    `inter_op_parallelism_threads`), else `TF_NUM_INTEROP_THREADS`; 0 when
    neither is set (then TensorFlow takes one per core)."""
    return _threads(configured, "TF_NUM_INTEROP_THREADS")


def _threads(configured: int, variable: str) -> int:
    if configured > 0:
        return configured
    value = os.environ.get(variable, "").strip()
    return int(value) if value.isdigit() else 0


def compute_threads(accelerator: bool, intra_op_threads: int, cores: int) -> int:
    """The cores one worker computes on: one for a GPU or TPU replica (it
    drives the device), else TensorFlow's intra-op threads (`0`: unset,
    then all `cores`)."""
    if accelerator:
        return 1
    return min(intra_op_threads, cores) if intra_op_threads > 0 else cores


def spare_cores(cores: int, workers_on_host: int, threads_each: int) -> int:
    """The cores of a host that its workers' computation leaves free."""
    return max(0, cores - workers_on_host * threads_each)


def packing(
    asked: Optional[int],
    cores: int,
    workers_on_host: int,
    accelerator: bool = False,
    intra_op_threads: int = 0,
    inter_op_threads: int = 0,
) -> Packing:
    """The packing of the step's gradients for a worker that shares a host
    of `cores` cores with `workers_on_host - 1` others: `asked` when not
    None, else packs of `OVERLAP_PACK_BYTES` where a core is spare and
    TensorFlow has more than one inter-op thread (`inter_op_threads`, 0:
    one per core), one pack otherwise (see the module doc)."""
    one_thread = inter_op_threads == 1 or (inter_op_threads == 0 and cores == 1)
    blocked = "one inter-op thread, which a pack's collective holds until it ends"
    if asked is not None:
        if asked:
            after = f"; with {blocked}, each after the backward pass" if one_thread else ""
            return Packing(asked, f"packs of {asked} bytes (bytes_per_pack={asked}){after}")
        return Packing(0, "one pack after the backward pass (bytes_per_pack=0)")
    if one_thread:
        return Packing(0, f"one pack after the backward pass: {blocked}")
    threads = compute_threads(accelerator, intra_op_threads, cores)
    spare = spare_cores(cores, workers_on_host, threads)
    what = "device" if accelerator else "intra-op"
    busy = (
        f"{workers_on_host} worker(s) x {threads} {what} thread(s) on {cores} core(s) of this host"
    )
    if spare:
        return Packing(
            OVERLAP_PACK_BYTES,
            f"packs of {OVERLAP_PACK_BYTES >> 20} MiB reduced during the backward pass: "
            f"{spare} core(s) spare ({busy})",
        )
    return Packing(0, f"one pack after the backward pass: no core spare ({busy})")

"""One GPU per process: the GPUs a process of a job sees when several of
its processes share a host.

A process that uses `multi_worker` (or `horovod`) replicates over every GPU
it sees, so 4 processes on a 4-GPU host would each take all 4 GPUs unless
each is told which are its own. `CUDA_VISIBLE_DEVICES` does that, read by
CUDA when TensorFlow first touches the GPUs. The process at local rank r of
the host gets GPUs `r*K .. r*K+K-1` (`K`: `KERAS_DISTRIB_GPUS_PER_WORKER`,
`--gpus_per_worker`, 1 by default; 0 leaves every process every GPU).
When `CUDA_VISIBLE_DEVICES` already lists at least `K` GPUs for each local
process (the GPUs the job may use on this host), each gets its share of
that list; a shorter list was made for this process already (by the
launcher, or a scheduler binding GPUs per task) and stays.

Who is where on the host comes from whoever started the process:
`keras-distrib launch` (`KERAS_DISTRIB_LOCAL_RANK`,
`KERAS_DISTRIB_LOCAL_WORLD_SIZE`), Slurm's `srun` (`SLURM_LOCALID` and the
step's tasks per node) or OpenMPI's `mpirun` (`OMPI_COMM_WORLD_LOCAL_RANK`,
`OMPI_COMM_WORLD_LOCAL_SIZE`). A Kubernetes pod is one process whose GPUs
the device plugin already chose. horovodrun's ranks are left alone: Horovod
scripts pick their GPU themselves (`gpus[hvd.local_rank()]`, which a
narrowed list would break; the `horovod` strategy takes `local_rank` modulo
the GPUs it sees, either way); so is a Horovod script under `mpirun` that
sets `KERAS_DISTRIB_GPUS_PER_WORKER=0`. The launcher sets the variable in each rank's
environment; `import keras_distrib` sets it for the other launchers, before
TensorFlow starts. One process on its host (`mirrored` over its GPUs)
keeps all of them.
"""

from __future__ import annotations

import os
import re
from typing import Mapping, MutableMapping, Optional

from .errors import ClusterConfigError

GPUS_PER_WORKER_ENV = "KERAS_DISTRIB_GPUS_PER_WORKER"
LOCAL_SIZE_ENV = "KERAS_DISTRIB_LOCAL_WORLD_SIZE"
LOCAL_RANK_ENV = "KERAS_DISTRIB_LOCAL_RANK"
VISIBLE = "CUDA_VISIBLE_DEVICES"

# (local rank, processes on this host) as each launcher names them.
_SOURCES = (
    (LOCAL_RANK_ENV, LOCAL_SIZE_ENV),
    ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
)


def share(
    local_rank: int, local_size: int, per_worker: int, visible: Optional[str]
) -> Optional[str]:
    """`CUDA_VISIBLE_DEVICES` for the process at `local_rank` of the
    `local_size` on its host, or None to leave it as it is.

    Example:

    ```python
    share(1, 2, 1, None)          # "1"
    share(1, 2, 2, "4,5,6,7")     # "6,7"
    share(1, 2, 1, "3")           # None: already this process's own
    ```
    """
    if per_worker == 0 or local_size <= 1:
        return None
    start = local_rank * per_worker
    if visible is None:
        return ",".join(str(i) for i in range(start, start + per_worker))
    pool = [d.strip() for d in visible.split(",") if d.strip()]
    if len(pool) < local_size * per_worker:
        return None
    return ",".join(pool[start : start + per_worker])


def per_worker(environ: Mapping[str, str]) -> int:
    """`KERAS_DISTRIB_GPUS_PER_WORKER` (1 when unset).

    Raises:
        ClusterConfigError: not a whole number >= 0 (one line).
    """
    value = environ.get(GPUS_PER_WORKER_ENV, "1").strip() or "1"
    if not value.isdigit():
        raise ClusterConfigError(
            f"{GPUS_PER_WORKER_ENV}={value!r} must be a whole number >= 0 (the GPUs each "
            "process of a host gets; 0: every process sees every GPU)."
        )
    return int(value)


def local_place(environ: Mapping[str, str]) -> Optional[tuple[int, int]]:
    """`(local rank, processes on this host)` from the launcher that
    started this process, or None when none says."""
    for rank_name, size_name in _SOURCES:
        rank, size = environ.get(rank_name), environ.get(size_name)
        if rank is not None and size is not None and rank.isdigit() and size.isdigit():
            return int(rank), int(size)
    if "SLURM_LOCALID" in environ and environ["SLURM_LOCALID"].isdigit():
        per_node = _slurm_tasks_here(environ)
        if per_node is not None:
            return int(environ["SLURM_LOCALID"]), per_node
    return None


def _slurm_tasks_here(environ: Mapping[str, str]) -> Optional[int]:
    """The tasks of this Slurm step on this node, from
    `SLURM_STEP_TASKS_PER_NODE` (or the job's `SLURM_TASKS_PER_NODE`),
    `"2(x3),1"` form, indexed by `SLURM_NODEID`."""
    counts = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    node = environ.get("SLURM_NODEID", "0")
    if not counts or not node.isdigit():
        return None
    per_node = []
    for part in counts.split(","):
        found = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not found:
            return None
        per_node += [int(found[1])] * int(found[2] or 1)
    return per_node[int(node)] if int(node) < len(per_node) else None


def assign(environ: MutableMapping[str, str] = os.environ) -> Optional[str]:
    """Sets this process's `CUDA_VISIBLE_DEVICES` (see the module doc) and
    returns it, or None when it stays as it was."""
    place = local_place(environ)
    if place is None:
        return None
    value = share(*place, per_worker(environ), environ.get(VISIBLE))
    if value is not None:
        environ[VISIBLE] = value
    return value

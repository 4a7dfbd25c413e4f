"""The cluster of an Open MPI job (`mpirun -np N python train.py`): one
worker per process.

`mpirun` tells each process its rank (`OMPI_COMM_WORLD_RANK`) and the job's
size (`OMPI_COMM_WORLD_SIZE`), but not where the other processes run. They
ask MPI itself: through mpi4py, every process contributes its host name and
a TCP port it found free, one `allgather` later every process holds the same
list in rank order, and MPI is finalized again before TensorFlow starts.
Rank 0 is the chief. Processes that all report one host name are on one
machine and listen on 127.0.0.1 (the shared-memory engine then serves
`multi_worker`); otherwise each is reached by its host name, as under Slurm,
so the names must resolve on every host (they do on a cluster whose
`mpirun --host` names do).

mpi4py is an optional dependency (`pip install keras-distrib[mpi]`); it
loads the MPI library `mpirun` belongs to. horovodrun sets no
`OMPI_COMM_WORLD_*` variables, so Horovod jobs are not affected.

Example:

```python
# mpirun -np 2 --host a,b python train.py; in process 1:
from_openmpi().workers  # ('a:41235', 'b:38817')
```
"""

from __future__ import annotations

import functools
import os
import socket
from typing import Callable, Mapping, Optional, Sequence

from .addresses import check_index, whole_number
from .errors import ClusterConfigError
from .info import ClusterInfo
from .network import free_ports

__all__ = ["from_openmpi"]

RANK_ENV = "OMPI_COMM_WORLD_RANK"
SIZE_ENV = "OMPI_COMM_WORLD_SIZE"

# (host name, port) of this process -> every process's, in rank order.
Exchange = Callable[[tuple[str, int]], Sequence[tuple[str, int]]]


def from_openmpi(
    environ: Mapping[str, str] = os.environ, exchange: Optional[Exchange] = None
) -> Optional[ClusterInfo]:
    """Reads the cluster of an `mpirun` job; None outside one (no
    `OMPI_COMM_WORLD_RANK` / `OMPI_COMM_WORLD_SIZE`).

    Args:
        environ: where to read Open MPI's variables; defaults to `os.environ`.
        exchange: gives every process's `(host name, port)` from this
            one's; defaults to an MPI allgather over mpi4py.

    Raises:
        ClusterConfigError: a malformed Open MPI variable, a rank out of
            range, mpi4py missing, or an exchange that does not return one
            entry per process (one line each, with the fix).
    """
    if RANK_ENV not in environ or SIZE_ENV not in environ:
        return None
    rank, size = (
        whole_number(environ, name, "; start the job with mpirun.") for name in (RANK_ENV, SIZE_ENV)
    )
    if size < 1:
        raise ClusterConfigError(f"{SIZE_ENV}={size} must be >= 1; start the job with mpirun.")
    check_index(rank, size, RANK_ENV, "mpirun processes")
    if exchange is None:
        return _this_job(rank, size)
    return _exchanged(rank, size, exchange)


@functools.cache
def _this_job(rank: int, size: int) -> ClusterInfo:
    """The job's cluster through MPI, exchanged once per process (MPI
    cannot start again after it is finalized)."""
    return _exchanged(rank, size, _allgather)


def _exchanged(rank: int, size: int, exchange: Exchange) -> ClusterInfo:
    host = socket.gethostname()
    mine = (host, free_ports(1, host)[0])
    everyone = [tuple(entry) for entry in exchange(mine)]
    if len(everyone) != size or everyone[rank] != mine:
        raise ClusterConfigError(
            f"the mpirun processes exchanged {len(everyone)} addresses for {SIZE_ENV}={size}; "
            "start every process of the job with the same mpirun."
        )
    one_host = len({name for name, _ in everyone}) == 1
    workers = tuple(f"{'127.0.0.1' if one_host else name}:{port}" for name, port in everyone)
    return ClusterInfo(workers, rank)


def _allgather(mine: tuple[str, int]) -> Sequence[tuple[str, int]]:
    """Every process's `mine`, by MPI_Allgather; MPI is finalized after."""
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise ClusterConfigError(
            f"mpirun started this process, and keras_distrib finds the other processes "
            f"through mpi4py, which cannot be loaded ({e}); pip install 'keras-distrib[mpi]' "
            "(mpi4py) in the environment the job runs in."
        ) from None
    try:
        return MPI.COMM_WORLD.allgather(mine)
    finally:
        MPI.Finalize()

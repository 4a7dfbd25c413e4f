"""`resolve()`: this process's cluster from the first source that describes one."""

from __future__ import annotations

import os
from typing import Mapping, Optional

from .errors import ClusterConfigError
from .explicit import ExplicitCluster, from_explicit
from .info import ClusterInfo
from .kubernetes import from_indexed_job
from .openmpi import from_openmpi
from .slurm import from_slurm
from .tf_config import from_tf_config

__all__ = ["resolve"]


def resolve(
    cluster: Optional[ExplicitCluster] = None,
    task_index: Optional[int] = None,
    environ: Mapping[str, str] = os.environ,
    task_type: Optional[str] = None,
) -> Optional[ClusterInfo]:
    """Finds this process's cluster: explicit > `TF_CONFIG` > Slurm >
    `mpirun` (Open MPI) > a Kubernetes Indexed Job (`JOB_COMPLETION_INDEX` with
    `KERAS_DISTRIB_WORLD_SIZE`) > None.

    The cluster may have any roles (chief, worker, ps, evaluator); a
    strategy that trains on workers only checks with
    `require_training_workers`.

    Args:
        cluster: explicit addresses (see `from_explicit`); when given,
            `task_index` is required and the environment is not read.
        task_index: this process's index among the `task_type` tasks of
            `cluster` (its rank, for a list of workers).
        environ: environment to read; defaults to `os.environ`.
        task_type: this process's role in `cluster`; None means `"worker"`.

    Returns:
        The cluster, or None when nothing describes one (single process).

    Raises:
        ClusterConfigError: the chosen source is malformed, or `task_index`
            or `task_type` is given without `cluster` (or `cluster` without
            `task_index`).

    Example:

    ```python
    info = resolve()                             # from the environment
    info = resolve(["h1:2222", "h2:2222"], 1)     # explicit
    info = resolve({"worker": ["h1:2222"], "ps": ["h2:2222"]}, 0, task_type="ps")
    ```
    """
    if cluster is not None:
        if task_index is None:
            raise ClusterConfigError(
                "cluster was given without task_index; pass this process's rank as task_index."
            )
        return from_explicit(cluster, task_index, task_type)
    if task_index is not None:
        raise ClusterConfigError(
            f"task_index={task_index!r} was given without cluster; pass the "
            "worker addresses as cluster too, or neither."
        )
    if task_type is not None:
        raise ClusterConfigError(
            f"task_type={task_type!r} was given without cluster; pass the "
            "cluster and task_index too, or none of them."
        )
    for source in (from_tf_config, from_slurm, from_openmpi, from_indexed_job):
        info = source(environ)
        if info is not None:
            return info
    return None

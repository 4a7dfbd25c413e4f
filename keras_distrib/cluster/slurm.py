"""The cluster of a Slurm job step (`srun`): one worker per task.

Slurm has no roles: every task is a `worker` (no dedicated chief, no `ps`,
no evaluator), and task `SLURM_PROCID` is the worker of that rank, so rank
0 is the chief.

Parameter servers: with `KERAS_DISTRIB_NUM_PS=M` (M >= 1) in the step's
environment, task 0 is a dedicated `chief`, the last M tasks are `ps`
tasks (`ps` index `SLURM_PROCID - (N - M)` of N tasks) and the others
`worker` tasks (index `SLURM_PROCID - 1`), as `strategy="parameter_server"`
needs; so the step needs at least M + 2 tasks. Unset, blank or 0: every
task is a worker, as above. A job that needs an evaluator describes its
cluster with `TF_CONFIG` or an explicit dict instead.

Example:

```sh
# 1 chief, 2 workers, 1 ps:
KERAS_DISTRIB_NUM_PS=1 srun -N 4 --ntasks-per-node=1 python train.py
```
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Mapping, Optional, Sequence

from .addresses import check_index, parse_address
from .errors import ClusterConfigError
from .info import ClusterInfo
from .roles import CHIEF, PS, WORKER

__all__ = ["DEFAULT_SLURM_PORT_BASE", "NUM_PS_ENV", "from_slurm"]

# Same default as tf.distribute.cluster_resolver.SlurmClusterResolver, so a
# job that moves between the two finds its workers on the same ports.
DEFAULT_SLURM_PORT_BASE = 8888

# How many of a Slurm step's tasks (the last ones) are parameter servers.
NUM_PS_ENV = "KERAS_DISTRIB_NUM_PS"


def from_slurm(
    environ: Mapping[str, str] = os.environ,
    port_base: int = DEFAULT_SLURM_PORT_BASE,
) -> Optional[ClusterInfo]:
    """Reads the cluster of a Slurm job step (`srun`), one worker per task.

    The node list and tasks per node are expanded by TensorFlow's
    `SlurmClusterResolver` (imported here, lazily). As there, nodes are
    taken in sorted order and a node's tasks get ports `port_base`,
    `port_base + 1`, ... by local task index, so task `SLURM_PROCID` is the
    worker at that rank. This matches Slurm's default block distribution;
    when `SLURMD_NODENAME` / `SLURM_LOCALID` say this task landed elsewhere
    (e.g. `--distribution=cyclic`), it fails instead of training with a
    wrong rank. GPUs are not assigned here (`CUDA_VISIBLE_DEVICES` is left
    alone). All tasks are workers, unless `KERAS_DISTRIB_NUM_PS` asks for
    a chief and parameter servers (see the module docstring).

    Variables read: `SLURM_PROCID`, `SLURM_STEP_NUM_TASKS`,
    `SLURM_STEP_NODELIST`, `SLURM_STEP_TASKS_PER_NODE`,
    `KERAS_DISTRIB_NUM_PS`, and, for the check, `SLURMD_NODENAME` and
    `SLURM_LOCALID`.

    Args:
        environ: where to read the Slurm variables; defaults to `os.environ`.
        port_base: the first port on every node.

    Returns:
        The cluster, or None when not inside a Slurm job step (no
        `SLURM_PROCID` or no `SLURM_STEP_NUM_TASKS`).

    Raises:
        ClusterConfigError: a missing or malformed Slurm variable, task counts
            that do not add up, a bad `port_base`, a non-block placement, or
            a `KERAS_DISTRIB_NUM_PS` that is not a count leaving a chief and
            a worker.

    Example:

    ```python
    # srun -N 2 --ntasks-per-node=2 python train.py  on nodes n1, n2:
    info = from_slurm()
    info.workers  # ('n1:8888', 'n1:8889', 'n2:8888', 'n2:8889')
    # the same with KERAS_DISTRIB_NUM_PS=1, seen from task 3:
    info.workers, info.ps, info.task_type  # (('n1:8888', 'n1:8889', 'n2:8888'), ('n2:8889',), 'ps')
    ```
    """
    if "SLURM_PROCID" not in environ or "SLURM_STEP_NUM_TASKS" not in environ:
        return None
    rank = _slurm_int(environ, "SLURM_PROCID")
    num_tasks = _slurm_int(environ, "SLURM_STEP_NUM_TASKS")
    num_ps = _num_ps(environ, num_tasks)
    _check_port_base(port_base)
    task_config = _slurm_task_configuration(environ, num_tasks)
    check_index(rank, num_tasks, "SLURM_PROCID", "Slurm tasks")
    workers = _slurm_workers(rank, num_tasks, task_config, port_base)
    _check_slurm_placement(environ, workers, rank, port_base)
    if not num_ps:
        return ClusterInfo(tuple(workers), rank)
    return _with_parameter_servers(workers, rank, num_ps)


def _with_parameter_servers(workers: Sequence[str], rank: int, num_ps: int) -> ClusterInfo:
    """Task 0 the chief, the last `num_ps` tasks ps, the others workers."""
    training, ps = tuple(workers[:-num_ps]), tuple(workers[-num_ps:])
    if rank == 0:
        task_type, index = CHIEF, 0
    elif rank < len(training):
        task_type, index = WORKER, rank - 1
    else:
        task_type, index = PS, rank - len(training)
    return ClusterInfo(training, index, ps=ps, has_chief=True, task_type=task_type)


def _num_ps(environ: Mapping[str, str], num_tasks: int) -> int:
    """`KERAS_DISTRIB_NUM_PS` as a count (0 when unset or blank), checked."""
    text = environ.get(NUM_PS_ENV, "")
    if not text.strip():
        return 0
    if not text.strip().isdigit():
        raise ClusterConfigError(
            f"{NUM_PS_ENV}={text!r} is not a non-negative integer; set it to the "
            "number of parameter-server tasks (the last Slurm tasks), or unset it."
        )
    num_ps = int(text)
    if num_ps and num_ps + 2 > num_tasks:
        raise ClusterConfigError(
            f"{NUM_PS_ENV}={num_ps} leaves no chief and worker among the step's "
            f"{num_tasks} Slurm tasks; start at least {num_ps + 2} tasks (a chief, "
            f"a worker and {num_ps} ps) or lower {NUM_PS_ENV}."
        )
    return num_ps


def _slurm_int(environ: Mapping[str, str], name: str) -> int:
    text = environ.get(name, "")
    if not text.strip().isdigit():
        raise ClusterConfigError(
            f"{name}={text!r} is not a non-negative integer; start the script "
            "with srun inside a Slurm allocation."
        )
    return int(text)


def _check_port_base(port_base: Any) -> None:
    if (
        isinstance(port_base, bool)
        or not isinstance(port_base, int)
        or not (1 <= port_base <= 65535)
    ):
        raise ClusterConfigError(f"port_base={port_base!r} must be an integer port in 1..65535.")


def _tensorflow_helpers():
    """`keras_distrib._compat` (it imports TensorFlow: only under Slurm).

    Keras first: once `keras_distrib` is imported, importing Keras imports
    `keras_distrib.model` (see the package's `_RegisterAfterKeras`), which
    needs `_compat` whole; were `_compat` the module bringing Keras in, the
    model would find it half-imported (an AttributeError at `from_slurm()`
    in a script that had not imported Keras yet).
    """
    importlib.import_module("keras")
    return importlib.import_module("keras_distrib._compat")


def _slurm_task_configuration(environ: Mapping[str, str], num_tasks: int) -> dict[str, int]:
    """Node name -> number of tasks, from the step's node list; `num_tasks` in all."""
    _compat = _tensorflow_helpers()
    values = {}
    for name in ("SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE"):
        if not environ.get(name):
            raise ClusterConfigError(
                f"{name} is not set; start the script with srun so Slurm describes the job step."
            )
        values[name] = environ[name]
    try:
        hosts, counts = _compat.slurm_hosts_and_tasks(
            values["SLURM_STEP_NODELIST"], values["SLURM_STEP_TASKS_PER_NODE"]
        )
    except ValueError as e:
        raise ClusterConfigError(f"Slurm: {e}; check the job's srun options.") from None
    if len(hosts) != len(counts) or len(set(hosts)) != len(hosts):
        raise ClusterConfigError(
            f"SLURM_STEP_NODELIST names {len(hosts)} node(s) but "
            f"SLURM_STEP_TASKS_PER_NODE gives {len(counts)} count(s); they "
            "must match one to one."
        )
    task_config = dict(zip(hosts, counts))
    if sum(task_config.values()) != num_tasks:
        raise ClusterConfigError(
            f"SLURM_STEP_TASKS_PER_NODE adds up to {sum(task_config.values())} "
            f"tasks but SLURM_STEP_NUM_TASKS={num_tasks}; start the script with "
            "srun so Slurm sets both for the same step."
        )
    return task_config


def _slurm_workers(
    rank: int, num_tasks: int, task_config: dict[str, int], port_base: int
) -> list[str]:
    _compat = _tensorflow_helpers()
    max_per_node = max(task_config.values())
    last_port = port_base + max_per_node - 1
    if last_port > 65535:
        raise ClusterConfigError(
            f"port_base={port_base} with {max_per_node} tasks per node needs "
            f"port {last_port} > 65535; use a lower port_base."
        )
    return _compat.slurm_worker_addresses(rank, num_tasks, task_config, port_base)


def _check_slurm_placement(
    environ: Mapping[str, str], workers: Sequence[str], rank: int, port_base: int
) -> None:
    host, port = parse_address(workers[rank], "Slurm worker")
    node = environ.get("SLURMD_NODENAME")
    local_id = environ.get("SLURM_LOCALID")
    expected_port = port_base + int(local_id) if local_id and local_id.isdigit() else port
    if (node and node != host) or expected_port != port:
        raise ClusterConfigError(
            f"Slurm task {rank} runs on node {node or host!r} with local id "
            f"{local_id}, but block placement puts rank {rank} at "
            f"{workers[rank]}; start the step with srun --distribution=block "
            "(the default)."
        )

"""Who am I, who are my peers: cluster discovery for multi-worker training.

A cluster is an ordered list of worker addresses (`"host:port"`, index =
rank) and the index of this process in it. It comes from, in this order:

1. an explicit list passed by the user (`from_explicit`),
2. the `TF_CONFIG` environment variable, as Kubeflow's TFJob and
   `keras-distrib launch` set it (`from_tf_config`),
3. a Slurm job step started with `srun` (`from_slurm`),

and `resolve()` tries them in that order. Every malformed input fails with a
`ClusterConfigError` (a `ValueError`) whose one-line message names the field
or peer at fault and the fix.

This module is pure Python on purpose: the launcher and the tests import it
without paying for TensorFlow's import. Only `from_slurm` imports TensorFlow,
lazily, to reuse its Slurm host-list expansion.

Example:

```python
from keras_distrib import cluster

info = cluster.resolve()  # None when this process is not part of a cluster
if info is not None:
    cluster.check_own_port_free(info)
    cluster.wait_for_peers(info, timeout=60)
    print(info.rank, info.world_size, info.peers)
```
"""

from __future__ import annotations

import dataclasses
import errno
import ipaddress
import json
import os
import socket
import time
from typing import Any, Mapping, Optional, Sequence, Union

__all__ = [
    "ClusterConfigError",
    "ClusterInfo",
    "DEFAULT_SLURM_PORT_BASE",
    "check_own_port_free",
    "free_ports",
    "from_explicit",
    "from_slurm",
    "from_tf_config",
    "is_local_host",
    "parse_address",
    "resolve",
    "wait_for_peers",
]

# Same default as tf.distribute.cluster_resolver.SlurmClusterResolver, so a
# job that moves between the two finds its workers on the same ports.
DEFAULT_SLURM_PORT_BASE = 8888

# TF_CONFIG task types that train. "master" is what older Kubeflow TFJob
# versions called the chief.
_CHIEF_TYPES = ("chief", "master")
_WORKER_TYPES = ("worker",)
_IGNORED_TYPES = ("evaluator",)
_PS_TYPES = ("ps",)
_KNOWN_TYPES = _CHIEF_TYPES + _WORKER_TYPES + _IGNORED_TYPES + _PS_TYPES

_PS_HINT = (
    "parameter servers are handled by the parameter_server strategy, not by "
    "this one; drop the 'ps' tasks or use strategy='parameter_server'"
)


class ClusterConfigError(ValueError):
    """A cluster description is malformed; the message is one line with the fix."""

    def __init__(self, message: str):
        # Launchers and log scrapers print errors as one line; collapse any
        # newline a caller's value may have smuggled in.
        super().__init__(" ".join(str(message).split()))


@dataclasses.dataclass(frozen=True)
class ClusterInfo:
    """The workers of a cluster and this process's place in it.

    Attributes:
        workers: `"host:port"` addresses; the index of an address is the
            rank of the worker there. IPv6 hosts are bracketed: `"[::1]:2222"`.
        task_index: the rank of this process.

    Example:

    ```python
    info = ClusterInfo(("10.0.0.1:2222", "10.0.0.2:2222"), task_index=1)
    info.rank, info.world_size, info.is_chief  # (1, 2, False)
    info.peers  # ('10.0.0.1:2222',)
    os.environ["TF_CONFIG"] = info.tf_config_json()
    ```
    """

    workers: tuple[str, ...]
    task_index: int

    def __post_init__(self):
        # Accept any sequence but store a tuple so the object stays hashable.
        if isinstance(self.workers, str):
            raise ClusterConfigError(
                f"workers={self.workers!r} must be a list of 'host:port' "
                f"strings, e.g. [{self.workers!r}]."
            )
        object.__setattr__(self, "workers", tuple(self.workers))
        _check_workers(self.workers, [f"workers[{i}]" for i in range(len(self.workers))])
        _check_index(self.task_index, len(self.workers), "task_index", "workers")

    @property
    def rank(self) -> int:
        """This process's rank (its index in `workers`)."""
        return self.task_index

    @property
    def world_size(self) -> int:
        """Number of workers."""
        return len(self.workers)

    @property
    def is_chief(self) -> bool:
        """True on rank 0, the worker that saves, logs and prints."""
        return self.task_index == 0

    @property
    def address(self) -> str:
        """This process's own `"host:port"`."""
        return self.workers[self.task_index]

    @property
    def peers(self) -> tuple[str, ...]:
        """Every worker address but this process's own, in rank order."""
        return tuple(a for i, a in enumerate(self.workers) if i != self.task_index)

    def to_tf_config(self) -> dict:
        """The `TF_CONFIG` dict describing this cluster (all tasks are workers).

        Example:

        ```python
        ClusterInfo(("h:1", "h:2"), 0).to_tf_config()
        # {"cluster": {"worker": ["h:1", "h:2"]},
        #  "task": {"type": "worker", "index": 0}}
        ```
        """
        return {
            "cluster": {"worker": list(self.workers)},
            "task": {"type": "worker", "index": self.task_index},
        }

    def tf_config_json(self) -> str:
        """`to_tf_config()` as compact JSON, ready for `os.environ["TF_CONFIG"]`.

        Example:

        ```python
        env = {**os.environ, "TF_CONFIG": info.tf_config_json()}
        ```
        """
        return json.dumps(self.to_tf_config(), separators=(",", ":"))


# --------------------------------------------------------------------------
# Addresses


def parse_address(address: Any, field: str = "address") -> tuple[str, int]:
    """Splits `"host:port"` into `(host, port)`, checking both.

    IPv6 hosts must be bracketed (`"[::1]:2222"`); the returned host keeps
    the brackets off (`"::1"`).

    Args:
        address: the string to check.
        field: how error messages name the value, e.g. `"cluster.worker[1]"`.

    Raises:
        ClusterConfigError: not a string, a URL scheme, whitespace, no port,
            a port that is not an integer in 1..65535, an empty host, or an
            unbracketed IPv6 address.

    Example:

    ```python
    parse_address("10.0.0.1:2222")  # ("10.0.0.1", 2222)
    parse_address("[::1]:2222")     # ("::1", 2222)
    ```
    """
    if not isinstance(address, str):
        raise ClusterConfigError(
            f"{field}={address!r} must be a 'host:port' string, e.g. 'localhost:2222'."
        )
    if "://" in address:
        raise ClusterConfigError(
            f"{field}={address!r} has a URL scheme; write it as plain 'host:port'."
        )
    if any(c.isspace() for c in address):
        raise ClusterConfigError(
            f"{field}={address!r} contains whitespace; write it as 'host:port'."
        )
    if address.startswith("["):
        host, port_text = _split_bracketed(address, field)
    else:
        if address.count(":") > 1:
            raise ClusterConfigError(
                f"{field}={address!r} looks like an IPv6 address; bracket the "
                "host, e.g. '[::1]:2222'."
            )
        host, sep, port_text = address.rpartition(":")
        if not sep:
            raise ClusterConfigError(
                f"{field}={address!r} has no port; write it as 'host:port', "
                f"e.g. '{address}:2222'."
            )
    if not host:
        raise ClusterConfigError(
            f"{field}={address!r} has an empty host; write it as 'host:port', "
            f"e.g. 'localhost{address}'."
        )
    return host, _parse_port(port_text, address, field)


def _split_bracketed(address: str, field: str) -> tuple[str, str]:
    host, sep, rest = address[1:].partition("]")
    if not sep or not rest.startswith(":"):
        raise ClusterConfigError(
            f"{field}={address!r} has no port after the bracketed host; "
            "write it as '[host]:port', e.g. '[::1]:2222'."
        )
    if host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ClusterConfigError(
                f"{field}={address!r}: {host!r} is not an IPv6 address; only "
                "IPv6 hosts take brackets."
            ) from None
    return host, rest[1:]


def _parse_port(port_text: str, address: str, field: str) -> int:
    # int() accepts "+1", " 1" and "1_000"; a port is plain digits.
    if not port_text.isdigit() or not port_text.isascii():
        raise ClusterConfigError(
            f"{field}={address!r}: port {port_text!r} is not an integer; "
            "write it as 'host:port' with a port in 1..65535."
        )
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise ClusterConfigError(
            f"{field}={address!r}: port {port} is out of range; use a port "
            "in 1..65535."
        )
    return port


def _check_workers(workers: Sequence[Any], fields: Sequence[str]) -> None:
    if not workers:
        raise ClusterConfigError(
            "the cluster has no workers; list at least one 'host:port'."
        )
    seen: dict[str, int] = {}
    for rank, (address, field) in enumerate(zip(workers, fields)):
        parse_address(address, field)
        key = address.lower()  # host names are case-insensitive
        if key in seen:
            raise ClusterConfigError(
                f"{fields[seen[key]]} and {field} are both {address!r}; give "
                "each worker its own host:port."
            )
        seen[key] = rank


def _check_index(index: Any, size: int, field: str, what: str) -> None:
    # bool is an int subclass; "index": true is a typo, not rank 1.
    if index is None:
        raise ClusterConfigError(
            f"{field} is missing; set it to this process's rank in 0..{size - 1}."
        )
    if isinstance(index, bool) or not isinstance(index, int):
        raise ClusterConfigError(
            f"{field}={index!r} must be an integer rank in 0..{size - 1}."
        )
    if index < 0:
        raise ClusterConfigError(
            f"{field}={index} is negative; set it to this process's rank in "
            f"0..{size - 1}."
        )
    if index >= size:
        raise ClusterConfigError(
            f"{field}={index} is out of range for {size} {what}; use 0..{size - 1}."
        )


# --------------------------------------------------------------------------
# Sources


def from_explicit(
    cluster: Union[Sequence[str], Mapping[str, Sequence[str]]], task_index: int
) -> ClusterInfo:
    """Builds a `ClusterInfo` from addresses the user wrote down.

    Args:
        cluster: `"host:port"` strings in rank order, or `{"worker": [...]}`.
        task_index: this process's rank.

    Raises:
        ClusterConfigError: anything malformed (see `parse_address`),
            duplicate addresses, or `task_index` outside the list.

    Example:

    ```python
    info = from_explicit(["10.0.0.1:2222", "10.0.0.2:2222"], task_index=0)
    info = from_explicit({"worker": ["10.0.0.1:2222"]}, task_index=0)
    ```
    """
    if isinstance(cluster, Mapping):
        extra = sorted(set(cluster) - {"worker"})
        if extra:
            raise ClusterConfigError(
                f"cluster has keys {extra}; an explicit cluster is "
                "{'worker': ['host:port', ...]} or a plain list."
            )
        if "worker" not in cluster:
            raise ClusterConfigError(
                "cluster has no 'worker' key; pass {'worker': ['host:port', ...]}."
            )
        workers, prefix = cluster["worker"], "cluster['worker']"
    else:
        workers, prefix = cluster, "cluster"
    if isinstance(workers, str) or not isinstance(workers, Sequence):
        raise ClusterConfigError(
            f"{prefix}={workers!r} must be a list of 'host:port' strings."
        )
    fields = [f"{prefix}[{i}]" for i in range(len(workers))]
    _check_workers(workers, fields)
    _check_index(task_index, len(workers), "task_index", "workers")
    return ClusterInfo(tuple(workers), task_index)


def from_tf_config(environ: Mapping[str, str] = os.environ) -> Optional[ClusterInfo]:
    """Reads the cluster from `TF_CONFIG`, as Kubeflow's TFJob sets it.

    A `chief` (or legacy `master`) task becomes rank 0 and the `worker`
    tasks follow it in order; `evaluator` entries are not part of training
    and are ignored.

    Args:
        environ: where to read `TF_CONFIG`; defaults to `os.environ`.

    Returns:
        The cluster, or None when `TF_CONFIG` is unset or blank.

    Raises:
        ClusterConfigError: invalid JSON (with the error position), a missing
            `cluster` or `task`, an unknown or `ps` task type, an index out
            of range, a duplicate or malformed address, or this process
            being the evaluator.

    Example:

    ```python
    env = {"TF_CONFIG": '{"cluster": {"chief": ["a:2222"], "worker": ["b:2222"]},'
                        ' "task": {"type": "worker", "index": 0}}'}
    from_tf_config(env)  # ClusterInfo(workers=('a:2222', 'b:2222'), task_index=1)
    ```
    """
    text = environ.get("TF_CONFIG", "")
    if not text.strip():
        return None
    config = _load_tf_config(text)
    chiefs, workers = _tf_config_tasks(config.get("cluster"))
    task_type, index = _tf_config_task(config.get("task"))
    all_workers = chiefs + workers
    if task_type in _CHIEF_TYPES:
        if not chiefs:
            raise ClusterConfigError(
                f"TF_CONFIG task.type is {task_type!r} but cluster lists no "
                f"{task_type!r} task; add cluster.{task_type} or make this task "
                "a 'worker'."
            )
        _check_index(index, len(chiefs), "TF_CONFIG task.index", f"{task_type!r} tasks")
        rank = index
    else:
        if not workers:
            raise ClusterConfigError(
                "TF_CONFIG task.type is 'worker' but cluster lists no 'worker' "
                "tasks; add cluster.worker or make this task the 'chief'."
            )
        _check_index(index, len(workers), "TF_CONFIG task.index", "'worker' tasks")
        rank = len(chiefs) + index
    fields = [f"TF_CONFIG cluster.chief[{i}]" for i in range(len(chiefs))]
    fields += [f"TF_CONFIG cluster.worker[{i}]" for i in range(len(workers))]
    _check_workers(all_workers, fields)
    return ClusterInfo(tuple(all_workers), rank)


def _load_tf_config(text: str) -> dict:
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ClusterConfigError(
            f"TF_CONFIG is not valid JSON: {e.msg} at line {e.lineno} column "
            f"{e.colno} (char {e.pos}); fix the JSON or unset TF_CONFIG."
        ) from None
    if not isinstance(config, dict):
        raise ClusterConfigError(
            f"TF_CONFIG must be a JSON object with 'cluster' and 'task', got "
            f"{type(config).__name__}."
        )
    for key in ("cluster", "task"):
        if key not in config:
            raise ClusterConfigError(
                f"TF_CONFIG has no {key!r}; it needs both 'cluster' "
                "({\"worker\": [\"host:port\", ...]}) and 'task' "
                "({\"type\": \"worker\", \"index\": i})."
            )
    return config


def _tf_config_tasks(cluster: Any) -> tuple[list, list]:
    if not isinstance(cluster, dict):
        raise ClusterConfigError(
            f"TF_CONFIG cluster must be an object like "
            f"{{\"worker\": [\"host:port\", ...]}}, got {type(cluster).__name__}."
        )
    for task_type, tasks in cluster.items():
        if task_type in _PS_TYPES and tasks:
            raise ClusterConfigError(f"TF_CONFIG cluster has 'ps' tasks: {_PS_HINT}.")
        if task_type not in _KNOWN_TYPES:
            raise ClusterConfigError(
                f"TF_CONFIG cluster has unknown task type {task_type!r}; "
                f"use 'chief' and/or 'worker' ('evaluator' is ignored)."
            )
        if not isinstance(tasks, list):
            raise ClusterConfigError(
                f"TF_CONFIG cluster.{task_type} must be a list of 'host:port' "
                f"strings, got {type(tasks).__name__}."
            )
    chiefs = [a for t in _CHIEF_TYPES for a in cluster.get(t, [])]
    if len(chiefs) > 1:
        raise ClusterConfigError(
            f"TF_CONFIG cluster lists {len(chiefs)} chief tasks; there is at "
            "most one chief, list the others under 'worker'."
        )
    workers = list(cluster.get("worker", []))
    if not chiefs and not workers:
        raise ClusterConfigError(
            "TF_CONFIG cluster has no 'worker' or 'chief' tasks; list the "
            "workers as {\"worker\": [\"host:port\", ...]}."
        )
    return chiefs, workers


def _tf_config_task(task: Any) -> tuple[str, Any]:
    if not isinstance(task, dict):
        raise ClusterConfigError(
            "TF_CONFIG task must be an object like {\"type\": \"worker\", "
            f"\"index\": 0}}, got {type(task).__name__}."
        )
    task_type = task.get("type")
    if task_type is None:
        raise ClusterConfigError(
            "TF_CONFIG task.type is missing; set it to 'worker' or 'chief'."
        )
    if task_type in _PS_TYPES:
        raise ClusterConfigError(f"TF_CONFIG task.type is 'ps': {_PS_HINT}.")
    if task_type in _IGNORED_TYPES:
        raise ClusterConfigError(
            "TF_CONFIG task.type is 'evaluator', which is not a training "
            "worker; run side-car evaluation without keras_distrib's cluster "
            "or make this task a 'worker'."
        )
    if task_type not in _CHIEF_TYPES + _WORKER_TYPES:
        raise ClusterConfigError(
            f"TF_CONFIG task.type={task_type!r} is unknown; use 'worker' or 'chief'."
        )
    return task_type, task.get("index")


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
    alone).

    Variables read: `SLURM_PROCID`, `SLURM_STEP_NUM_TASKS`,
    `SLURM_STEP_NODELIST`, `SLURM_STEP_TASKS_PER_NODE`, and, for the check,
    `SLURMD_NODENAME` and `SLURM_LOCALID`.

    Args:
        environ: where to read the Slurm variables; defaults to `os.environ`.
        port_base: the first port on every node.

    Returns:
        The cluster, or None when not inside a Slurm job step (no
        `SLURM_PROCID` or no `SLURM_STEP_NUM_TASKS`).

    Raises:
        ClusterConfigError: a missing or malformed Slurm variable, task counts
            that do not add up, a bad `port_base`, or a non-block placement.

    Example:

    ```python
    # srun -N 2 --ntasks-per-node=2 python train.py  on nodes n1, n2:
    info = from_slurm()
    info.workers  # ('n1:8888', 'n1:8889', 'n2:8888', 'n2:8889')
    ```
    """
    if "SLURM_PROCID" not in environ or "SLURM_STEP_NUM_TASKS" not in environ:
        return None
    rank = _slurm_int(environ, "SLURM_PROCID")
    num_tasks = _slurm_int(environ, "SLURM_STEP_NUM_TASKS")
    _check_port_base(port_base)
    task_config = _slurm_task_configuration(environ)
    if sum(task_config.values()) != num_tasks:
        raise ClusterConfigError(
            f"SLURM_STEP_TASKS_PER_NODE adds up to {sum(task_config.values())} "
            f"tasks but SLURM_STEP_NUM_TASKS={num_tasks}; start the script with "
            "srun so Slurm sets both for the same step."
        )
    _check_index(rank, num_tasks, "SLURM_PROCID", "Slurm tasks")
    workers = _slurm_workers(rank, num_tasks, task_config, port_base)
    _check_slurm_placement(environ, workers, rank, port_base)
    return ClusterInfo(tuple(workers), rank)


def _slurm_int(environ: Mapping[str, str], name: str) -> int:
    text = environ.get(name, "")
    if not text.strip().isdigit():
        raise ClusterConfigError(
            f"{name}={text!r} is not a non-negative integer; start the script "
            "with srun inside a Slurm allocation."
        )
    return int(text)


def _check_port_base(port_base: Any) -> None:
    if isinstance(port_base, bool) or not isinstance(port_base, int) or not (
        1 <= port_base <= 65535
    ):
        raise ClusterConfigError(
            f"port_base={port_base!r} must be an integer port in 1..65535."
        )


def _slurm_task_configuration(environ: Mapping[str, str]) -> dict[str, int]:
    """Node name -> number of tasks, from the step's node list."""
    from tensorflow.python.distribute.cluster_resolver import (  # pylint: disable=g-import-not-at-top
        slurm_cluster_resolver as slurm_lib,
    )

    values = {}
    for name in ("SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE"):
        if not environ.get(name):
            raise ClusterConfigError(
                f"{name} is not set; start the script with srun so Slurm "
                "describes the job step."
            )
        values[name] = environ[name]
    try:
        hosts = slurm_lib.expand_hostlist(values["SLURM_STEP_NODELIST"])
        counts = slurm_lib.expand_tasks_per_node(values["SLURM_STEP_TASKS_PER_NODE"])
    except ValueError as e:
        raise ClusterConfigError(f"Slurm: {e}; check the job's srun options.") from None
    if len(hosts) != len(counts) or len(set(hosts)) != len(hosts):
        raise ClusterConfigError(
            f"SLURM_STEP_NODELIST names {len(hosts)} node(s) but "
            f"SLURM_STEP_TASKS_PER_NODE gives {len(counts)} count(s); they "
            "must match one to one."
        )
    return dict(zip(hosts, counts))


def _slurm_workers(
    rank: int, num_tasks: int, task_config: dict[str, int], port_base: int
) -> list[str]:
    from tensorflow.python.distribute.cluster_resolver import (  # pylint: disable=g-import-not-at-top
        slurm_cluster_resolver as slurm_lib,
    )

    class _Resolver(slurm_lib.SlurmClusterResolver):
        # The stock resolver reads SLURM_PROCID from os.environ; read ours.
        def _resolve_own_rank(self):
            return rank

    max_per_node = max(task_config.values())
    last_port = port_base + max_per_node - 1
    if last_port > 65535:
        raise ClusterConfigError(
            f"port_base={port_base} with {max_per_node} tasks per node needs "
            f"port {last_port} > 65535; use a lower port_base."
        )
    resolver = _Resolver(
        jobs={"worker": num_tasks},
        port_base=port_base,
        tasks_per_node=task_config,
        # One fake "GPU" per task keeps the resolver from calling nvidia-smi
        # and from assigning devices; which devices a worker uses is the
        # strategy's business, and auto_set_gpu=False leaves the env alone.
        gpus_per_node=max_per_node,
        gpus_per_task=1,
        auto_set_gpu=False,
    )
    return resolver.cluster_spec().job_tasks("worker")


def _check_slurm_placement(
    environ: Mapping[str, str], workers: Sequence[str], rank: int, port_base: int
) -> None:
    host, port = parse_address(workers[rank], "Slurm worker")
    node = environ.get("SLURMD_NODENAME")
    local_id = environ.get("SLURM_LOCALID")
    expected_port = port_base + int(local_id) if (local_id or "").isdigit() else port
    if (node and node != host) or expected_port != port:
        raise ClusterConfigError(
            f"Slurm task {rank} runs on node {node or host!r} with local id "
            f"{local_id}, but block placement puts rank {rank} at "
            f"{workers[rank]}; start the step with srun --distribution=block "
            "(the default)."
        )


def resolve(
    cluster: Union[Sequence[str], Mapping[str, Sequence[str]], None] = None,
    task_index: Optional[int] = None,
    environ: Mapping[str, str] = os.environ,
) -> Optional[ClusterInfo]:
    """Finds this process's cluster: explicit > `TF_CONFIG` > Slurm > None.

    Args:
        cluster: explicit addresses (see `from_explicit`); when given,
            `task_index` is required and the environment is not read.
        task_index: this process's rank in `cluster`.
        environ: environment to read; defaults to `os.environ`.

    Returns:
        The cluster, or None when nothing describes one (single process).

    Raises:
        ClusterConfigError: the chosen source is malformed, or `task_index`
            is given without `cluster` (or the reverse).

    Example:

    ```python
    info = resolve()                             # from the environment
    info = resolve(["h1:2222", "h2:2222"], 1)     # explicit
    ```
    """
    if cluster is not None:
        if task_index is None:
            raise ClusterConfigError(
                "cluster was given without task_index; pass this process's "
                "rank as task_index."
            )
        return from_explicit(cluster, task_index)
    if task_index is not None:
        raise ClusterConfigError(
            f"task_index={task_index!r} was given without cluster; pass the "
            "worker addresses as cluster too, or neither."
        )
    info = from_tf_config(environ)
    if info is not None:
        return info
    return from_slurm(environ)


# --------------------------------------------------------------------------
# Network checks


def is_local_host(host: str) -> bool:
    """True when `host` names this machine (loopback, wildcard, own name or IP).

    IP literals are tested by binding to them, so any address of a local
    interface counts; other names count only when they are `localhost` or
    this machine's host name (no DNS lookup, which could hang).

    Example:

    ```python
    is_local_host("127.0.0.1"), is_local_host("localhost")  # (True, True)
    is_local_host("10.255.255.1")                            # False (usually)
    ```
    """
    host = host.strip("[]").lower()
    if host in ("localhost", "0.0.0.0", "::", ""):
        return True
    hostname = socket.gethostname().lower()
    if host in (hostname, hostname.split(".")[0]):
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    if ip.is_loopback:
        return True
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, 0))
        except OSError:
            return False  # EADDRNOTAVAIL: not an address of this machine
    return True


def check_own_port_free(info: ClusterInfo) -> None:
    """Fails early when this process's own port is already taken here.

    TensorFlow's gRPC server listens on every interface (`[::]:port`)
    whatever host the address names, so the port is probed on the wildcard
    address. Skipped when the own host is not this machine.

    Raises:
        ClusterConfigError: naming the rank, address and the fix.

    Example:

    ```python
    info = resolve()
    check_own_port_free(info)  # before starting TensorFlow's server
    ```
    """
    host, port = parse_address(info.address, f"worker {info.rank}")
    if not is_local_host(host):
        return
    error = _probe_port(port)
    if error == errno.EACCES:
        raise ClusterConfigError(
            f"worker {info.rank} at {info.address}: this user may not listen on "
            f"port {port} (EACCES); give this worker a port >= 1024."
        )
    if error is not None:
        raise ClusterConfigError(
            f"worker {info.rank} at {info.address}: port {port} is already in "
            f"use on this machine ({errno.errorcode.get(error, error)}); stop "
            "the process holding it or give this worker another port."
        )


def _probe_port(port: int) -> Optional[int]:
    """Tries to bind `port` on all interfaces; returns the errno, if any."""
    error = None
    # Dual-stack first, as gRPC listens; IPv4 when this host has no IPv6.
    for family, address in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            probe = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue
        with probe:
            # gRPC sets SO_REUSEADDR too; without it lingering TIME_WAIT
            # connections from a previous run would look like a conflict.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                if family == socket.AF_INET6:
                    probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                probe.bind((address, port))
                return None
            except OSError as e:
                error = e.errno
                if e.errno in (errno.EADDRINUSE, errno.EACCES):
                    return e.errno
    return error


def wait_for_peers(info: ClusterInfo, timeout: Optional[float], poll: float = 0.2) -> None:
    """Blocks until every peer accepts a TCP connection.

    Useful before the first collective: a peer that never started then
    gives a clear error instead of a gRPC hang.

    Args:
        info: the cluster.
        timeout: seconds to wait in all; None or <= 0 waits forever.
        poll: seconds between connection attempts.

    Raises:
        ClusterConfigError: on timeout, naming the first peer (lowest rank)
            that did not answer.

    Example:

    ```python
    wait_for_peers(info, timeout=60)
    ```
    """
    pending = [(r, a) for r, a in enumerate(info.workers) if r != info.rank]
    deadline = time.monotonic() + timeout if timeout and timeout > 0 else None
    while True:
        pending = [(r, a) for r, a in pending if not _answers(a, poll)]
        if not pending:
            return
        if deadline is not None and time.monotonic() >= deadline:
            rank, address = pending[0]
            _, port = parse_address(address, f"worker {rank}")
            raise ClusterConfigError(
                f"worker {rank} at {address} did not answer within {timeout:g}s; "
                f"is it started? Check that it runs and that port {port} is "
                "reachable from this host (firewall, --bind address)."
            )
        time.sleep(poll)


def _answers(address: str, timeout: float) -> bool:
    host, port = parse_address(address)
    try:
        with socket.create_connection((host, port), timeout=max(timeout, 0.05)):
            return True
    except OSError:
        return False


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """Asks the OS for `n` distinct free TCP ports on `host`.

    All sockets stay open until every port is chosen, so the ports differ;
    they are free when this returns, though another process could take one
    before it is used.

    Example:

    ```python
    ports = free_ports(2)  # e.g. [41235, 38817]
    workers = [f"127.0.0.1:{p}" for p in ports]
    ```
    """
    if n < 0:
        raise ValueError(f"n={n} must be >= 0.")
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sockets = []
    try:
        for _ in range(n):
            sock = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind((host.strip("[]"), 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()

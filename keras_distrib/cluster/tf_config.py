"""The cluster from `TF_CONFIG`, as Kubeflow's TFJob and `keras-distrib launch` set it."""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Optional

from . import roles
from .addresses import check_addresses, check_index
from .errors import ClusterConfigError
from .info import ClusterInfo

__all__ = ["from_tf_config"]

# Cluster keys read, in the order their tasks are listed; "master" is what
# older Kubeflow TFJob versions called the chief.
_CLUSTER_KEYS = (roles.CHIEF, roles.LEGACY_CHIEF, roles.WORKER, roles.PS, roles.EVALUATOR)
_VALID_TYPES = roles.quoted(roles.TASK_TYPES)


def from_tf_config(environ: Mapping[str, str] = os.environ) -> Optional[ClusterInfo]:
    """Reads the cluster from `TF_CONFIG`, as Kubeflow's TFJob sets it.

    A `chief` (or legacy `master`) task becomes rank 0 and the `worker`
    tasks follow it in order; `ps` and `evaluator` tasks are kept as such,
    and this process may be any of the four (`master` reads as `chief`).
    Whether a strategy accepts `ps` or evaluator tasks is its business: see
    `require_training_workers`.

    Args:
        environ: where to read `TF_CONFIG`; defaults to `os.environ`.

    Returns:
        The cluster, or None when `TF_CONFIG` is unset or blank.

    Raises:
        ClusterConfigError: invalid JSON (with the error position), a missing
            `cluster` or `task`, an unknown task type, more than one chief,
            no training task, a task type the cluster does not list, an
            index out of range, or a duplicate (across all roles) or
            malformed address.

    Example:

    ```python
    env = {"TF_CONFIG": '{"cluster": {"chief": ["a:2222"], "worker": ["b:2222"],'
                        ' "ps": ["p:2222"]}, "task": {"type": "worker", "index": 0}}'}
    info = from_tf_config(env)
    info.workers, info.rank, info.ps  # (('a:2222', 'b:2222'), 1, ('p:2222',))
    ```
    """
    text = environ.get("TF_CONFIG", "")
    if not text.strip():
        return None
    config = _load_tf_config(text)
    tasks = _tf_config_tasks(config.get("cluster"))
    task_type, index = _tf_config_task(config.get("task"))
    chiefs = [a for _, a in tasks[roles.CHIEF]]
    own = (
        chiefs
        if task_type in (roles.CHIEF, roles.LEGACY_CHIEF)
        else [a for _, a in tasks[task_type]]
    )
    if not own:
        raise ClusterConfigError(_no_such_tasks(task_type))
    check_index(index, len(own), "TF_CONFIG task.index", f"{task_type!r} tasks")
    entries = [e for t in roles.TASK_TYPES for e in tasks[t]]
    check_addresses([a for _, a in entries], [f for f, _ in entries])
    return ClusterInfo(
        tuple(chiefs + [a for _, a in tasks[roles.WORKER]]),
        index,
        ps=tuple(a for _, a in tasks[roles.PS]),
        evaluators=tuple(a for _, a in tasks[roles.EVALUATOR]),
        has_chief=bool(chiefs),
        task_type=roles.CHIEF if task_type == roles.LEGACY_CHIEF else task_type,
    )


def _no_such_tasks(task_type: str) -> str:
    if task_type == roles.WORKER:
        return (
            "TF_CONFIG task.type is 'worker' but cluster lists no 'worker' "
            "tasks; add cluster.worker or make this task the 'chief'."
        )
    if task_type in (roles.CHIEF, roles.LEGACY_CHIEF):
        return (
            f"TF_CONFIG task.type is {task_type!r} but cluster lists no "
            f"{task_type!r} task; add cluster.{task_type} or make this task "
            "a 'worker'."
        )
    return (
        f"TF_CONFIG task.type is {task_type!r} but cluster lists no "
        f"{task_type!r} tasks; add cluster.{task_type} or fix task.type."
    )


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
                '({"worker": ["host:port", ...]}) and \'task\' '
                '({"type": "worker", "index": i}).'
            )
    return config


def _tf_config_tasks(cluster: Any) -> dict[str, list[tuple[str, Any]]]:
    """Task type -> `[(field, address), ...]`; `master` is filed as chief."""
    if not isinstance(cluster, dict):
        raise ClusterConfigError(
            f"TF_CONFIG cluster must be an object like "
            f'{{"worker": ["host:port", ...]}}, got {type(cluster).__name__}.'
        )
    for task_type, addresses in cluster.items():
        if task_type not in _CLUSTER_KEYS:
            raise ClusterConfigError(
                f"TF_CONFIG cluster has unknown task type {task_type!r}; use {_VALID_TYPES}."
            )
        if not isinstance(addresses, list):
            raise ClusterConfigError(
                f"TF_CONFIG cluster.{task_type} must be a list of 'host:port' "
                f"strings, got {type(addresses).__name__}."
            )
    tasks: dict[str, list[tuple[str, Any]]] = {t: [] for t in roles.TASK_TYPES}
    for key in _CLUSTER_KEYS:
        task_type = roles.CHIEF if key == roles.LEGACY_CHIEF else key
        tasks[task_type] += [
            (f"TF_CONFIG cluster.{key}[{i}]", a) for i, a in enumerate(cluster.get(key, []))
        ]
    if len(tasks[roles.CHIEF]) > 1:
        raise ClusterConfigError(
            f"TF_CONFIG cluster lists {len(tasks[roles.CHIEF])} chief tasks; there "
            "is at most one chief, list the others under 'worker'."
        )
    if not tasks[roles.CHIEF] and not tasks[roles.WORKER]:
        others = [t for t in (roles.PS, roles.EVALUATOR) if tasks[t]]
        only = f" (only {roles.quoted(others, last='and')})" if others else ""
        raise ClusterConfigError(
            f"TF_CONFIG cluster has no 'worker' or 'chief' tasks{only}; list "
            'the workers as {"worker": ["host:port", ...]}.'
        )
    return tasks


def _tf_config_task(task: Any) -> tuple[str, Any]:
    if not isinstance(task, dict):
        raise ClusterConfigError(
            'TF_CONFIG task must be an object like {"type": "worker", '
            f'"index": 0}}, got {type(task).__name__}.'
        )
    task_type = task.get("type")
    if task_type is None:
        raise ClusterConfigError(f"TF_CONFIG task.type is missing; set it to {_VALID_TYPES}.")
    if task_type not in _CLUSTER_KEYS:
        raise ClusterConfigError(
            f"TF_CONFIG task.type={task_type!r} is unknown; use 'worker' or "
            "'chief' to train ('ps' or 'evaluator' otherwise)."
        )
    return task_type, task.get("index")

"""A cluster the user wrote down: a list of workers, or a dict of roles."""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence, Union

from . import roles
from .addresses import check_addresses, check_index
from .errors import ClusterConfigError
from .info import ClusterInfo

__all__ = ["from_explicit"]

ExplicitCluster = Union[Sequence[str], Mapping[str, Sequence[str]]]

_DICT_FORM = (
    f"a list of 'host:port' or a dict with keys {roles.quoted(roles.TASK_TYPES, last='and/or')}"
)


def from_explicit(
    cluster: ExplicitCluster, task_index: int, task_type: Optional[str] = None
) -> ClusterInfo:
    """Builds a `ClusterInfo` from addresses the user wrote down.

    Args:
        cluster: `"host:port"` strings in rank order (all workers), or a
            dict like `TF_CONFIG`'s cluster: `{"worker": [...]}`, plus
            optionally `"chief"` (at most one address; rank 0), `"ps"` and
            `"evaluator"`.
        task_index: this process's index among the tasks of `task_type`
            (its rank, for a list or a cluster without chief).
        task_type: this process's role, `"chief"`, `"worker"`, `"ps"` or
            `"evaluator"`; None means `"worker"`. A plain list only has
            workers.

    Raises:
        ClusterConfigError: anything malformed (see `parse_address`),
            duplicate addresses across all roles, unknown keys or task type,
            more than one chief, no training task, or `task_index` out of
            range for `task_type`.

    Example:

    ```python
    info = from_explicit(["10.0.0.1:2222", "10.0.0.2:2222"], task_index=0)
    info = from_explicit({"worker": ["10.0.0.1:2222"]}, task_index=0)
    info = from_explicit({"chief": ["c:2222"], "worker": ["w:2222"],
                          "ps": ["p:2222"]}, task_index=0, task_type="ps")
    ```
    """
    task_type = roles.WORKER if task_type is None else task_type
    tasks, prefixes = _tasks(cluster, task_type)
    chiefs = tasks.get(roles.CHIEF, [])
    workers = tasks.get(roles.WORKER, [])
    _check_training_tasks(tasks)
    addresses, fields = [], []
    for t in roles.TASK_TYPES:
        values = tasks.get(t, [])
        addresses += values
        fields += [f"{prefixes[t]}[{i}]" for i in range(len(values))]
    check_addresses(addresses, fields)
    own = tasks.get(task_type, [])
    if not own:
        raise ClusterConfigError(
            f"task_type={task_type!r} but cluster has no {task_type!r} tasks; "
            f"add cluster[{task_type!r}] or pick another task_type."
        )
    what = "workers" if task_type == roles.WORKER and not chiefs else f"{task_type!r} tasks"
    check_index(task_index, len(own), "task_index", what)
    return ClusterInfo(
        tuple(chiefs + workers),
        task_index,
        ps=tuple(tasks.get(roles.PS, [])),
        evaluators=tuple(tasks.get(roles.EVALUATOR, [])),
        has_chief=bool(chiefs),
        task_type=task_type,
    )


def _tasks(cluster: ExplicitCluster, task_type: str) -> tuple[dict[str, list], dict[str, str]]:
    """The addresses by role, and each role's field name for messages."""
    if task_type not in roles.TASK_TYPES:
        raise ClusterConfigError(
            f"task_type={task_type!r} is unknown; use {roles.quoted(roles.TASK_TYPES)}."
        )
    if isinstance(cluster, Mapping):
        return _tasks_from_dict(cluster)
    if task_type != roles.WORKER:
        raise ClusterConfigError(
            f"task_type={task_type!r} needs a dict cluster with a "
            f"{task_type!r} key; a plain list holds only workers."
        )
    return {roles.WORKER: _address_list(cluster, "cluster")}, {roles.WORKER: "cluster"}


def _check_training_tasks(tasks: Mapping[str, list]) -> None:
    """At most one chief, and a chief or a worker to train."""
    chiefs = tasks.get(roles.CHIEF, [])
    if len(chiefs) > 1:
        raise ClusterConfigError(
            f"cluster['chief'] lists {len(chiefs)} addresses; there is at most "
            "one chief, list the others under 'worker'."
        )
    if chiefs or tasks.get(roles.WORKER, []):
        return
    others = [t for t in (roles.PS, roles.EVALUATOR) if tasks.get(t)]
    if others:
        raise ClusterConfigError(
            f"cluster has {roles.quoted(others, last='and')} tasks but no "
            "'worker' or 'chief'; add cluster['worker'] = ['host:port', ...]."
        )
    if roles.WORKER not in tasks and roles.CHIEF not in tasks:
        raise ClusterConfigError(
            "cluster has no 'worker' key; pass {'worker': ['host:port', ...]}."
        )
    raise ClusterConfigError("the cluster has no workers; list at least one 'host:port'.")


def _tasks_from_dict(
    cluster: Mapping[str, Any],
) -> tuple[dict[str, list], dict[str, str]]:
    extra = sorted((k for k in cluster if k not in roles.TASK_TYPES), key=str)
    if extra:
        raise ClusterConfigError(f"cluster has keys {extra}; an explicit cluster is {_DICT_FORM}.")
    tasks, prefixes = {}, {}
    for task_type in roles.TASK_TYPES:
        if task_type in cluster:
            prefixes[task_type] = f"cluster[{task_type!r}]"
            tasks[task_type] = _address_list(cluster[task_type], prefixes[task_type])
    return tasks, prefixes


def _address_list(value: Any, field: str) -> list:
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise ClusterConfigError(f"{field}={value!r} must be a list of 'host:port' strings.")
    return list(value)

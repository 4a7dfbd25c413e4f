"""`ClusterInfo`: the tasks of a cluster, by role, and this process's place.

A cluster has training tasks (an optional dedicated `chief`, then
`worker`s), and optionally parameter servers (`ps`) and `evaluator`s.
`ClusterInfo.workers` holds the training tasks in rank order (the chief, if
any, first); `rank`, `world_size`, `is_chief` and `peers` are about them.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Optional

from . import roles
from .addresses import check_addresses, check_index, parse_address
from .errors import ClusterConfigError

__all__ = ["ClusterInfo", "require_training_workers"]

# ClusterInfo field holding each role's addresses (the chief is workers[0]).
_FIELDS = {roles.PS: "ps", roles.EVALUATOR: "evaluators"}


@dataclasses.dataclass(frozen=True)
class ClusterInfo:
    """The tasks of a cluster and this process's place in it.

    Attributes:
        workers: the training tasks' `"host:port"` addresses in rank order:
            the index of an address is the rank of the task there. When
            `has_chief`, `workers[0]` is the dedicated chief task and
            `workers[1:]` are the `worker` tasks. IPv6 hosts are bracketed:
            `"[::1]:2222"`.
        task_index: this process's index among the tasks of its
            `task_type`, as `TF_CONFIG`'s `task.index`. For a cluster of
            `worker`s only this is the rank; with a chief, worker `i` has
            rank `i + 1`.
        ps: parameter-server addresses (keyword-only; default none).
        evaluators: evaluator addresses (keyword-only; default none).
        has_chief: whether `workers[0]` is a dedicated `chief` task
            (`TF_CONFIG` `chief` or `master`) rather than worker 0
            (keyword-only; default False).
        task_type: this process's role: `"chief"`, `"worker"`, `"ps"` or
            `"evaluator"` (keyword-only; default `"worker"`).

    `rank`, `is_chief` and `peers` concern the training tasks. `rank` is
    only defined for a training task: on a `ps` or `evaluator` process it
    raises `ClusterConfigError` naming the role instead of passing for a
    worker's rank (check `is_training_task`, or call
    `require_training_workers` first).

    Raises:
        ClusterConfigError: a malformed or duplicate address (across all
            roles), no training task, an unknown `task_type`, `"chief"`
            without `has_chief`, or `task_index` out of range for its type.

    Example:

    ```python
    info = ClusterInfo(("10.0.0.1:2222", "10.0.0.2:2222"), task_index=1)
    info.rank, info.world_size, info.is_chief  # (1, 2, False)
    info.peers  # ('10.0.0.1:2222',)
    os.environ["TF_CONFIG"] = info.tf_config_json()

    # Kubeflow TFJob: a chief, two workers, a ps; this process is worker 1.
    info = ClusterInfo(("c:2222", "w0:2222", "w1:2222"), 1, ps=("p:2222",),
                       has_chief=True)
    info.rank, info.role, info.num_ps  # (2, 'worker', 1)
    info.cluster_spec()
    # {'chief': ['c:2222'], 'worker': ['w0:2222', 'w1:2222'], 'ps': ['p:2222']}
    ```
    """

    workers: tuple[str, ...]
    task_index: int
    ps: tuple[str, ...] = dataclasses.field(default=(), kw_only=True)
    evaluators: tuple[str, ...] = dataclasses.field(default=(), kw_only=True)
    has_chief: bool = dataclasses.field(default=False, kw_only=True)
    task_type: str = dataclasses.field(default=roles.WORKER, kw_only=True)

    def __post_init__(self):
        # Accept any sequence but store tuples so the object stays hashable.
        for name in ("workers", "ps", "evaluators"):
            value = getattr(self, name)
            if isinstance(value, str) or not _is_iterable(value):
                example = f"[{value!r}]" if isinstance(value, str) else "['host:port']"
                raise ClusterConfigError(
                    f"{name}={value!r} must be a list of 'host:port' strings, e.g. {example}."
                )
            object.__setattr__(self, name, tuple(value))
        if not isinstance(self.has_chief, bool):
            raise ClusterConfigError(f"has_chief={self.has_chief!r} must be True or False.")
        if self.task_type not in roles.TASK_TYPES:
            raise ClusterConfigError(
                f"task_type={self.task_type!r} is unknown; use {roles.quoted(roles.TASK_TYPES)}."
            )
        if not self.workers:
            if self.ps or self.evaluators:
                raise ClusterConfigError(
                    "the cluster has 'ps'/'evaluator' tasks but no training "
                    "task; list at least one 'host:port' in workers."
                )
            raise ClusterConfigError("the cluster has no workers; list at least one 'host:port'.")
        addresses, fields = [], []
        for name in ("workers", "ps", "evaluators"):
            values = getattr(self, name)
            addresses += values
            fields += [f"{name}[{i}]" for i in range(len(values))]
        check_addresses(addresses, fields)
        self._check_task()

    def _check_task(self) -> None:
        if self.task_type == roles.CHIEF and not self.has_chief:
            raise ClusterConfigError(
                "task_type='chief' but has_chief=False; put the chief first in "
                "workers and set has_chief=True, or make this task a 'worker'."
            )
        size = len(self._addresses(self.task_type))
        if size == 0:
            field = _FIELDS.get(self.task_type, "workers")
            raise ClusterConfigError(
                f"task_type={self.task_type!r} but the cluster has no "
                f"{self.task_type!r} tasks; add them to {field} or pick "
                "another task_type."
            )
        if self.task_type == roles.WORKER and not self.has_chief:
            what = "workers"
        elif self.task_type == roles.WORKER:
            what = "'worker' tasks (after the chief)"
        else:
            what = f"{self.task_type!r} tasks"
        check_index(self.task_index, size, "task_index", what)

    def _addresses(self, task_type: str) -> tuple[str, ...]:
        """The addresses of the tasks of one type, by `task.index`."""
        if task_type == roles.CHIEF:
            return self.workers[:1] if self.has_chief else ()
        if task_type == roles.WORKER:
            return self.workers[1:] if self.has_chief else self.workers
        if task_type == roles.PS:
            return self.ps
        if task_type == roles.EVALUATOR:
            return self.evaluators
        raise ClusterConfigError(
            f"task type {task_type!r} is unknown; use {roles.quoted(roles.TASK_TYPES)}."
        )

    # ----------------------------------------------------------------------
    # Roles

    @property
    def role(self) -> str:
        """This process's task type: `"chief"`, `"worker"`, `"ps"` or `"evaluator"`."""
        return self.task_type

    @property
    def is_training_task(self) -> bool:
        """True for the chief and workers; False for ps and evaluator tasks."""
        return self.task_type in roles.TRAINING_TASK_TYPES

    @property
    def num_ps(self) -> int:
        """Number of parameter-server tasks."""
        return len(self.ps)

    @property
    def has_ps(self) -> bool:
        """True when the cluster has parameter-server tasks."""
        return bool(self.ps)

    @property
    def tasks(self) -> tuple[tuple[str, int, str], ...]:
        """Every task as `(task_type, task_index, address)`, in `TF_CONFIG`
        order: the chief, the workers, the ps tasks, the evaluators."""
        return tuple(
            (task_type, i, address)
            for task_type in roles.TASK_TYPES
            for i, address in enumerate(self._addresses(task_type))
        )

    # ----------------------------------------------------------------------
    # Training tasks

    @property
    def rank(self) -> int:
        """This training task's rank: its index in `workers` (chief first).

        Raises:
            ClusterConfigError: this process is a `ps` or `evaluator` task,
                which has no rank among the training tasks.
        """
        if not self.is_training_task:
            raise ClusterConfigError(
                f"this process is {self.task_type!r} task {self.task_index} at "
                f"{self.address}, not a training task, so it has no rank; check "
                "info.is_training_task or call require_training_workers() first."
            )
        if self.task_type == roles.WORKER and self.has_chief:
            return self.task_index + 1
        return self.task_index

    @property
    def world_size(self) -> int:
        """Number of training tasks (chief and workers)."""
        return len(self.workers)

    @property
    def worker_hosts(self) -> tuple[str, ...]:
        """Each training task's host (its address without the port), in rank order."""
        return tuple(parse_address(a)[0] for a in self.workers)

    @property
    def is_chief(self) -> bool:
        """True on rank 0 (the chief task, or worker 0 when there is none),
        the task that saves, logs and prints; False on ps and evaluators."""
        return self.is_training_task and self.rank == 0

    @property
    def address(self) -> str:
        """This process's own `"host:port"`, whatever its role."""
        return self._addresses(self.task_type)[self.task_index]

    @property
    def peers(self) -> tuple[str, ...]:
        """Every training task's address but this process's own, in rank order."""
        own = self.address
        return tuple(a for a in self.workers if a != own)

    # ----------------------------------------------------------------------
    # TF_CONFIG

    def cluster_spec(self) -> dict[str, list[str]]:
        """`{task_type: [addresses]}` for the roles present, as
        `tf.train.ClusterSpec` takes it.

        Example:

        ```python
        ClusterInfo(("h:1", "h:2"), 0).cluster_spec()  # {"worker": ["h:1", "h:2"]}
        tf.train.ClusterSpec(info.cluster_spec())
        ```
        """
        spec = {}
        for task_type in roles.TASK_TYPES:
            addresses = self._addresses(task_type)
            if addresses:
                spec[task_type] = list(addresses)
        return spec

    def to_tf_config(self) -> dict:
        """The `TF_CONFIG` dict describing this cluster and task.

        A dedicated chief is written as `chief` (never `master`), so
        `from_tf_config` reads back an equal `ClusterInfo`.

        Example:

        ```python
        ClusterInfo(("h:1", "h:2"), 0).to_tf_config()
        # {"cluster": {"worker": ["h:1", "h:2"]},
        #  "task": {"type": "worker", "index": 0}}
        ```
        """
        return {
            "cluster": self.cluster_spec(),
            "task": {"type": self.task_type, "index": self.task_index},
        }

    def tf_config_json(self) -> str:
        """`to_tf_config()` as compact JSON, ready for `os.environ["TF_CONFIG"]`.

        Example:

        ```python
        env = {**os.environ, "TF_CONFIG": info.tf_config_json()}
        ```
        """
        return json.dumps(self.to_tf_config(), separators=(",", ":"))


def _is_iterable(value: Any) -> bool:
    try:
        iter(value)
    except TypeError:
        return False
    return True


def require_training_workers(
    info: Optional[ClusterInfo], strategy_name: str
) -> Optional[ClusterInfo]:
    """Insists on a cluster of training tasks only; for worker-only strategies.

    A strategy that all-reduces among the chief and workers calls this on
    the cluster it resolved. Evaluators elsewhere in the cluster are fine
    (they are not part of training); parameter servers are not.

    Args:
        info: the resolved cluster; None (no cluster) is passed through.
        strategy_name: the strategy's name, for the message.

    Returns:
        `info`, unchanged.

    Raises:
        ClusterConfigError: the cluster has `ps` tasks (pointing to the
            `parameter_server` strategy), or this process is an `evaluator`.

    Example:

    ```python
    info = require_training_workers(resolve(cluster, task_index), "multi_worker")
    ```
    """
    if info is None:
        return None
    if info.task_type == roles.PS:
        raise ClusterConfigError(
            f"strategy {strategy_name!r}: this process's task type is 'ps': {roles.PS_HINT}."
        )
    if info.has_ps:
        raise ClusterConfigError(
            f"strategy {strategy_name!r}: the cluster has 'ps' tasks: {roles.PS_HINT}."
        )
    if info.task_type == roles.EVALUATOR:
        raise ClusterConfigError(
            f"strategy {strategy_name!r}: this process's task type is "
            f"'evaluator', {roles.EVALUATOR_HINT}."
        )
    return info

"""Where a strategy's work runs: replicas, devices, processes, data shards.

These are kept apart on purpose (as `keras.distribution` does with
`num_model_replicas`, `num_processes`, `num_data_shards`): a data-parallel
strategy has one replica per device, but a pipeline spreads one replica over
several devices, and a parameter-server job has processes (ps tasks) that
hold variables but read no data. Code that needs one of these numbers asks
for it by name instead of deriving it from another.

Pure Python: the launcher and cluster tools may import it without
TensorFlow.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

ROLES = ("chief", "worker", "ps", "evaluator")


@dataclasses.dataclass(frozen=True)
class Topology:
    """The shape of one strategy's job, seen from this process.

    Attributes:
        num_replicas: model replicas that train in sync, over all processes
            (the data-parallel width; gradients are combined across them).
        num_local_replicas: replicas that run in this process.
        first_local_replica: global index of this process's first replica;
            replica `first_local_replica + i` runs on `devices[i]` when each
            replica has one device.
        devices: the local devices this process computes on.
        num_processes: processes that take part in training.
        process_index: this process's index among them (its rank).
        local_rank: this process's index among the processes on its host.
        role: `"chief"`, `"worker"`, `"ps"` or `"evaluator"`.
        num_data_shards: how many distinct parts the input is split into
            across processes (one per process that reads input).
        data_shard_index: the part this process reads.

    Example:

    ```python
    t = model.strategy.topology
    print(t.num_replicas, t.num_processes, t.data_shard_index)
    ```
    """

    num_replicas: int
    num_local_replicas: int
    first_local_replica: int
    devices: tuple[str, ...]
    num_processes: int = 1
    process_index: int = 0
    local_rank: int = 0
    role: str = "worker"
    num_data_shards: int = 1
    data_shard_index: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(self.devices))
        if self.role not in ROLES:
            raise ValueError(f"role={self.role!r} is not one of {ROLES}.")
        for name in ("num_replicas", "num_processes", "num_data_shards"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1.")
        if not 0 <= self.process_index < self.num_processes:
            raise ValueError(
                f"process_index={self.process_index} is outside 0..{self.num_processes - 1}."
            )
        if not 0 <= self.data_shard_index < self.num_data_shards:
            raise ValueError(
                f"data_shard_index={self.data_shard_index} is outside "
                f"0..{self.num_data_shards - 1}."
            )
        last = self.first_local_replica + self.num_local_replicas
        if self.first_local_replica < 0 or last > self.num_replicas:
            raise ValueError(
                f"local replicas {self.first_local_replica}..{last - 1} are outside "
                f"the {self.num_replicas} replicas."
            )

    @classmethod
    def data_parallel(
        cls,
        devices: Sequence[str],
        num_processes: int = 1,
        process_index: int = 0,
        local_rank: int = 0,
    ) -> "Topology":
        """One replica per local device, the same count in every process, and
        one data shard per process (the synchronous data-parallel shape).

        Example:

        ```python
        Topology.data_parallel(["/gpu:0", "/gpu:1"], num_processes=2, process_index=1)
        # 4 replicas; this process runs replicas 2 and 3 and reads shard 1 of 2
        ```
        """
        devices = tuple(devices)
        return cls(
            num_replicas=len(devices) * num_processes,
            num_local_replicas=len(devices),
            first_local_replica=process_index * len(devices),
            devices=devices,
            num_processes=num_processes,
            process_index=process_index,
            local_rank=local_rank,
            role="chief" if process_index == 0 else "worker",
            num_data_shards=num_processes,
            data_shard_index=process_index,
        )

    @property
    def is_chief(self) -> bool:
        """Whether this process writes checkpoints and logs (process 0)."""
        return self.process_index == 0

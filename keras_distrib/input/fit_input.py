"""What `fit` hands its strategy, and what the strategy hands Keras back.

`DistributedModel.fit` gathers the user's input arguments into one
`FitInput`; the strategy's `distribute_fit_input` returns another
(`dataclasses.replace`) with the input Keras's loop should iterate instead:
this process's shard, a stream of tickets for parameter-server workers, or
the same input untouched. Nothing else travels between the two.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union


@dataclasses.dataclass(frozen=True)
class Start:
    """Where `fit` starts: the first epoch, steps already done in it, the seed.

    Array and PyDataset input shuffle epoch `e` by `(seed, e)` alone, so a
    run resumed at epoch `e` with the same seed sees the same order as an
    uninterrupted one (`keras_distrib.callbacks.BackupAndRestore`). The
    input always starts at the beginning of `epoch`; `DistributedModel.fit`
    replays its first `step` steps as no-ops that only pull their batches.
    """

    epoch: int = 0
    step: int = 0
    seed: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class FitInput:
    """`fit`'s input arguments, as the user passed them or as Keras gets them.

    The first group are `fit`'s own arguments. `steps_per_execution` is the
    model's (read only). `start` and `resumable` come from a
    `BackupAndRestore` among the callbacks: a resumable fit routes its input
    through the sharding pipeline even with one process, so that epoch `e`
    has the same order after a restart. The strategy fills the last group:
    `seed`, the shuffle seed it used (recorded in the backup), and
    `build_batch`, a batch to build the model on when the strategy feeds
    Keras no real batches (parameter servers).
    """

    x: Any
    y: Any = None
    sample_weight: Any = None
    batch_size: Optional[int] = None
    shuffle: Union[bool, str] = True
    validation_split: float = 0.0
    validation_data: Any = None
    validation_batch_size: Optional[int] = None
    steps_per_epoch: Optional[int] = None
    class_weight: Optional[dict] = None
    steps_per_execution: int = 1
    start: Optional[Start] = None
    resumable: bool = False
    seed: Optional[int] = None
    build_batch: Any = None

    def replace(self, **changes) -> "FitInput":
        return dataclasses.replace(self, **changes)

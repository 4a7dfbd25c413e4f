"""The `optimizer_sharding` option of the data-parallel strategies.

`None` (the default): every replica keeps the optimizer's slots for every
variable. `"optimizer"` (ZeRO stage 1): each of the N replicas keeps them
for 1/N of every trainable variable and updates only that part; the parts
then travel to every replica (`keras_distrib.training.optimizer_shards`).
"""

from __future__ import annotations

from typing import Optional

OPTIMIZER = "optimizer"
GRADIENTS = "gradients"


def check(strategy: str, value, one_replica_per_process: bool = True) -> Optional[str]:
    """`value` if `strategy` can shard that way, else a one-line error."""
    if value is None:
        return None
    if value == GRADIENTS:
        raise ValueError(
            f"optimizer_sharding='gradients' (ZeRO stage 2) is not available in strategy "
            f"{strategy!r}; use optimizer_sharding='optimizer' (stage 1: the optimizer's "
            "slots sharded) or None.")
    if value != OPTIMIZER:
        raise ValueError(
            f"optimizer_sharding={value!r} is not one of None, 'optimizer' (the optimizer's "
            "slots sharded over the replicas).")
    if not one_replica_per_process:
        raise ValueError(
            f"optimizer_sharding='optimizer' needs one replica per process; strategy "
            f"{strategy!r} runs several in one: use 'multi_worker' (one worker per device) "
            "or 'horovod'.")
    return value

"""The `optimizer_sharding` option of the data-parallel strategies.

`None` (the default): every replica keeps the optimizer's slots for every
variable. `"optimizer"` (ZeRO stage 1): each of the N replicas keeps them
for 1/N of every trainable variable and updates only that part; the parts
then travel to every replica (`keras_distrib.arithmetic.optimizer_shards`).
`"gradients"` (ZeRO stage 2): the same, and the step's gradients are
reduce-scattered instead of all-reduced, so each replica receives only the
reduced gradient of its parts.
"""

from __future__ import annotations

from typing import Optional

OPTIMIZER = "optimizer"
GRADIENTS = "gradients"


def check(strategy: str, value, one_replica_per_process: bool = True) -> Optional[str]:
    """`value` if `strategy` can shard that way, else a one-line error."""
    if value is None:
        return None
    if value not in (OPTIMIZER, GRADIENTS):
        raise ValueError(
            f"optimizer_sharding={value!r} is not one of None, 'optimizer' (the optimizer's "
            "slots sharded over the replicas), 'gradients' (the reduced gradients too)."
        )
    if not one_replica_per_process:
        raise ValueError(
            f"optimizer_sharding={value!r} needs one replica per worker, but strategy "
            f"{strategy!r} runs several in each: start one worker per device, or use "
            "'mirrored' on one machine."
        )
    return value

"""What one replica holds for a model, in bytes (`Strategy.describe`):
`ReplicaMemory`, and `variable_bytes` that counts it from variables."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np
import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class ReplicaMemory:
    """Bytes one replica holds for a model (`Strategy.describe`), read from
    its variables: `weights` (all of the model's), `gradients` (one per
    trainable weight, whole: the step all-reduces them whole) and
    `optimizer` (the optimizer's variables, which with
    `optimizer_sharding="optimizer"` are this replica's parts).
    `collectives`: which engine all-reduces the gradients across
    processes, and why (`multi_worker`'s; empty elsewhere)."""

    weights: int
    gradients: int
    optimizer: int
    collectives: str = ""

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer

    def __str__(self) -> str:
        return (
            f"per replica: weights {_size(self.weights)}, gradients "
            f"{_size(self.gradients)}, optimizer {_size(self.optimizer)}, "
            f"total {_size(self.total)}"
        ) + (f"; gradients all-reduced by {self.collectives}" if self.collectives else "")


def _size(count: float) -> str:
    if count < 1024:
        return f"{count:.0f} B"
    for unit in ("KiB", "MiB"):
        count /= 1024
        if count < 1024:
            return f"{count:.1f} {unit}"
    return f"{count / 1024:.1f} GiB"


def variable_bytes(variables: Sequence[Any], parts: int = 1) -> int:
    """Bytes of `variables`' values (one copy each), or of one of `parts`
    equal parts of each (rounded up)."""
    return sum(
        -(-int(np.prod(v.shape)) // parts) * np.dtype(tf.as_dtype(v.dtype).as_numpy_dtype).itemsize
        for v in variables
    )

"""The small interface every strategy implements.

A strategy owns an engine (here: a `tf.distribute.Strategy`) and answers
four questions for `DistributedModel`: where variables live (`scope`), how a
global batch becomes per-replica work (`run`), how per-replica values are
combined (`all_reduce`, `reduce_mean`, `concat`), and who this process is
(`rank`, `world_size`, `is_chief`).
"""

from __future__ import annotations

import abc
import contextlib
from typing import Any, Callable, Sequence

import tensorflow as tf

from keras_distrib import data as data_lib


class Strategy(abc.ABC):
    """Base class of all keras_distrib strategies.

    Subclasses set `name` and `description` (shown by
    `keras_distrib.strategies.available()`) and build their engine in
    `__init__`.

    Example:

    ```python
    strategy = keras_distrib.strategies.get("mirrored")
    print(strategy.name, strategy.num_replicas, strategy.is_chief)
    ```
    """

    name: str = ""
    description: str = ""
    # Whether steps run as several replicas whose results need combining.
    replicates: bool = True

    def __init__(self, tf_strategy: tf.distribute.Strategy):
        self._tf_strategy = tf_strategy

    # -- identity -----------------------------------------------------------

    @property
    def tf_strategy(self) -> tf.distribute.Strategy:
        """The `tf.distribute.Strategy` that places variables and runs steps."""
        return self._tf_strategy

    @property
    def num_replicas(self) -> int:
        """Replicas that train in sync, across all processes."""
        return self._tf_strategy.num_replicas_in_sync

    @property
    def num_local_replicas(self) -> int:
        """Replicas that run in this process."""
        return len(self.devices)

    @property
    def first_local_replica(self) -> int:
        """Global index of this process's first replica."""
        return self.rank * self.num_local_replicas

    @property
    def rank(self) -> int:
        """Index of this process among `world_size` processes."""
        return 0

    @property
    def world_size(self) -> int:
        """Number of processes taking part in training."""
        return 1

    @property
    def is_chief(self) -> bool:
        """Whether this process writes checkpoints and logs."""
        return self.rank == 0

    @property
    def devices(self) -> Sequence[str]:
        """The devices this process runs replicas on."""
        return tuple(self._tf_strategy.extended.worker_devices)

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} name={self.name!r} "
            f"num_replicas={self.num_replicas} rank={self.rank} "
            f"world_size={self.world_size}>"
        )

    # -- placement ----------------------------------------------------------

    def scope(self) -> contextlib.AbstractContextManager:
        """Context under which variables are created for this strategy."""
        return self._tf_strategy.scope()

    def holds(self, variable: Any) -> bool:
        """Whether `variable` was created under this strategy's scope."""
        value = getattr(variable, "value", variable)
        return getattr(value, "_distribute_strategy", None) is self._tf_strategy

    # -- the step -----------------------------------------------------------

    def run(self, replica_fn: Callable, batch: Any):
        """Runs `replica_fn(shard)` once per local replica.

        `batch` is this process's part of the global batch (every tensor's
        first dimension is the batch); it is split across the local replicas
        as `keras_distrib.data.split_batch` documents.

        Returns per-replica outputs (`tf.distribute.DistributedValues`).
        """
        shards = data_lib.split_batch(batch, self.num_local_replicas)
        first = self.first_local_replica

        def value_fn(ctx):
            return shards[ctx.replica_id_in_sync_group - first]

        per_replica = self._tf_strategy.experimental_distribute_values_from_function(
            value_fn
        )
        return self._tf_strategy.run(replica_fn, args=(per_replica,))

    def all_reduce(self, values: Any, op: str = "sum") -> Any:
        """Reduces a structure of tensors across replicas (replica context)."""
        ctx = tf.distribute.get_replica_context()
        return ctx.all_reduce(_reduce_op(op), values)

    def reduce_mean(self, per_replica: Any) -> Any:
        """Mean over replicas of per-replica values (cross-replica context)."""
        return tf.nest.map_structure(
            lambda v: self._tf_strategy.reduce("MEAN", v, axis=None), per_replica
        )

    def concat(self, per_replica: Any) -> Any:
        """Concatenates per-replica outputs in global replica order."""

        def concat_one(value):
            parts = self._tf_strategy.experimental_local_results(value)
            if parts[0].shape.rank == 0:
                return tf.stack(parts)
            return tf.concat(parts, axis=0)

        return tf.nest.map_structure(concat_one, per_replica)


def _reduce_op(op: str) -> tf.distribute.ReduceOp:
    ops = {"sum": tf.distribute.ReduceOp.SUM, "mean": tf.distribute.ReduceOp.MEAN}
    if op not in ops:
        raise ValueError(f"Unknown reduce op {op!r}; use one of {sorted(ops)}.")
    return ops[op]

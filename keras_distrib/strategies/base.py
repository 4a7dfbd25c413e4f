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
from typing import Any, Callable, Optional, Sequence

import numpy as np

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
    # Whether per-batch logs are global values (reading them costs a
    # cross-process collective per metric and step where processes differ).
    exact_batch_logs: bool = True

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

    def all_reduce(self, values: Sequence[tf.Tensor], op: str = "sum") -> list:
        """Reduces a list of tensors across replicas (replica context).

        Tensors of one dtype travel together (TF packs them into few
        collectives); each dtype is its own group.
        """
        ctx = tf.distribute.get_replica_context()
        # tf.identity places values made outside the replica (e.g. a batch
        # passed straight through) on its device; TF needs one to reduce.
        values = [v if v.device else tf.identity(v) for v in values]
        reduced = list(values)
        for dtype in dict.fromkeys(v.dtype for v in values):
            positions = [i for i, v in enumerate(values) if v.dtype == dtype]
            group = ctx.all_reduce(_reduce_op(op), [values[i] for i in positions])
            for i, value in zip(positions, group):
                reduced[i] = value
        return reduced

    def reduce_mean(self, per_replica: Any) -> Any:
        """Mean over replicas of per-replica values (cross-replica context)."""
        return tf.nest.map_structure(
            lambda v: self._tf_strategy.reduce("MEAN", v, axis=None), per_replica
        )

    def local_mean(self, per_replica: Any) -> Any:
        """Mean over this process's replicas only (no communication)."""

        def mean(value):
            parts = self._tf_strategy.experimental_local_results(value)
            return tf.add_n(list(parts)) / len(parts) if len(parts) > 1 else parts[0]

        return tf.nest.map_structure(mean, per_replica)

    def concat(self, per_replica: Any) -> Any:
        """Concatenates per-replica outputs in global replica order."""

        def concat_one(value):
            parts = self._tf_strategy.experimental_local_results(value)
            if parts[0].shape.rank == 0:
                return tf.stack(parts)
            return tf.concat(parts, axis=0)

        return tf.nest.map_structure(concat_one, per_replica)


    # -- between steps: eager collectives across processes --------------------
    # Called by callbacks on every worker, in the same order on all of them.

    def sync_sum(self, values: Sequence[Any]) -> list[np.ndarray]:
        """Elementwise sums over processes of one value per process (eager).

        All values travel in one collective. With one process this is the
        identity.
        """
        arrays = [np.asarray(v) for v in values]
        if self.world_size == 1:
            return arrays
        dtype = np.result_type(*arrays) if arrays else np.float64
        flat = np.concatenate([a.astype(dtype).ravel() for a in arrays])
        summed = np.asarray(self._sum_over_processes(flat))
        out, start = [], 0
        for a in arrays:
            out.append(summed[start : start + a.size].reshape(a.shape).astype(a.dtype))
            start += a.size
        return out

    def _sum_over_processes(self, flat: np.ndarray) -> np.ndarray:
        value = tf.constant(flat)
        zeros = tf.zeros_like(value)
        first = self.first_local_replica
        per_replica = self._tf_strategy.experimental_distribute_values_from_function(
            lambda ctx: value if ctx.replica_id_in_sync_group == first else zeros
        )
        return self._tf_strategy.reduce("SUM", per_replica, axis=None).numpy()

    def sync_gather(self, value: Any) -> np.ndarray:
        """Stacks one value per process into `[world_size, ...]` (eager)."""
        value = np.asarray(value)
        slots = np.zeros((self.world_size, *value.shape), value.dtype)
        slots[self.rank] = value
        return self.sync_sum([slots])[0]

    def broadcast_variables(self, variables: Sequence[Any], root: int = 0) -> None:
        """Gives every process `root`'s values of `variables` (eager)."""
        if self.world_size == 1 or not variables:
            return
        mine = [
            np.asarray(v) if self.rank == root else np.zeros(v.shape, _np_dtype(v))
            for v in variables
        ]
        for variable, value in zip(variables, self.sync_sum(mine)):
            variable.assign(value)

    def agree_on_seed(self, seed: Optional[int] = None) -> int:
        """A seed every process agrees on: the chief's (random unless given)."""
        if seed is None:
            seed = int(np.random.default_rng().integers(2**31))
        return int(self.sync_sum([np.int64(seed if self.is_chief else 0)])[0])

    def local_replica_values(self, variable: Any) -> list[np.ndarray]:
        """This process's copies of `variable`, one per local replica."""
        value = getattr(variable, "value", variable)
        return [np.asarray(v) for v in self._tf_strategy.experimental_local_results(value)]

    def sync_initial_state(self, model) -> None:
        """Makes every replica start from the same weights (after builds).

        tf.distribute already broadcasts initial values when variables are
        created; engines without that override this.
        """

    def combine_metric_results(self, results: dict) -> dict:
        """Metric results as every process should report them.

        tf.distribute metric variables already sum across replicas when read,
        so this is the identity here; engines without that override it.
        """
        return results


def _np_dtype(variable) -> np.dtype:
    return np.dtype(getattr(variable.dtype, "as_numpy_dtype", variable.dtype))


def _reduce_op(op: str) -> tf.distribute.ReduceOp:
    ops = {"sum": tf.distribute.ReduceOp.SUM, "mean": tf.distribute.ReduceOp.MEAN}
    if op not in ops:
        raise ValueError(f"Unknown reduce op {op!r}; use one of {sorted(ops)}.")
    return ops[op]

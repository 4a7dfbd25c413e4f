"""TensorFlow's collectives, through the `tf.distribute.Strategy` whose replicas run the step.

In a step each replica reduces with its replica context's `all_reduce`
(TensorFlow packs the tensors of one dtype into few collectives): the
cross-device ops of one process's engines (`mirrored`, `central_storage`,
`tpu`), TensorFlow's collective ops between processes for `multi_worker`'s
(a gRPC ring between CPUs, NCCL between GPUs). Between steps a process's
values are summed by the engine's `reduce`, its other replicas adding
zeros.

`multi_worker`'s collectives come with its options: `bytes_per_pack`
(tensors cut into pieces, `keras_distrib.collectives.pieces`) and the
watchdog that enforces `collective_timeout` on the steps' collectives
(`keras_distrib.collectives.watchdog`), which then get no TensorFlow
timeout of their own (docs/design.md, section 1.2, row 12).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np
import tensorflow as tf

from keras_distrib import _compat
from keras_distrib.collectives import pieces
from keras_distrib.collectives.transport import (
    Transport,
    gather_by_sum,
    reduce_op,
    scatter_by_sum,
)
from keras_distrib.collectives.watchdog import CollectiveWatchdog

_REDUCE_OPS = {"sum": tf.distribute.ReduceOp.SUM, "mean": tf.distribute.ReduceOp.MEAN}


class TFCollectives(Transport):
    """The collectives of the `tf.distribute.Strategy` `engine`.

    Args:
        engine: the engine whose `run` runs the step on this process's replicas.
        first_local_replica: the global index of this process's first replica.
        multi_worker: the engine spans processes (`multi_worker`'s): rows
            and all-gathers travel by TensorFlow's gathers between
            processes. One process's replicas concatenate their rows, and
            add their values into zeros for an all-gather.
        watchdog: times the steps' collectives (`collective_timeout`).
        bytes_per_pack: the steps' all-reduces cut tensors into pieces of
            about this many bytes (0: whole).
    """

    name = "tensorflow"

    def __init__(
        self,
        engine: tf.distribute.Strategy,
        first_local_replica: int = 0,
        multi_worker: bool = False,
        watchdog: Optional[CollectiveWatchdog] = None,
        bytes_per_pack: int = 0,
    ):
        self._engine = engine
        self._first = first_local_replica
        self._multi_worker = multi_worker
        self._watchdog = watchdog
        self._bytes_per_pack = bytes_per_pack
        # Options of the steps' collectives over the engine's own: none of
        # TensorFlow's timeout threads where the watchdog times them.
        self._step_options: Optional[Any] = None
        if watchdog is not None:
            self._step_options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=0)

    # -- in a replica's step ----------------------------------------------------------

    def all_reduce(self, values: Sequence[Any], op: str = "sum") -> list[Any]:
        if not self._bytes_per_pack:
            return self._watched(values, lambda vs: self._reduce(vs, op))
        values, plan = pieces.cut([tf.convert_to_tensor(v) for v in values], self._bytes_per_pack)
        return pieces.join(self._watched(values, lambda vs: self._reduce(vs, op)), plan)

    def _reduce(self, values: Sequence[Any], op: str) -> list[Any]:
        """The replica context's all-reduce, one per dtype."""
        ctx = tf.distribute.get_replica_context()
        # tf.identity places values made outside the replica (e.g. a batch
        # passed straight through) on its device; TF needs one to reduce.
        values = [v if v.device else tf.identity(v) for v in values]
        reduced = list(values)
        for dtype in dict.fromkeys(v.dtype for v in values):
            positions = [i for i, v in enumerate(values) if v.dtype == dtype]
            group = ctx.all_reduce(
                _REDUCE_OPS[reduce_op(op)],
                [values[i] for i in positions],
                options=self._step_options,
            )
            for i, value in zip(positions, group):
                reduced[i] = value
        return reduced

    def all_gather(self, value: Any) -> Any:
        value = tf.convert_to_tensor(value)
        context = tf.distribute.get_replica_context()
        if not self._multi_worker:
            here = tf.cast(context.replica_id_in_sync_group, tf.int32)
            return gather_by_sum(self, value, here, self._engine.num_replicas_in_sync)
        options = self._step_options
        return self._watched(
            [value], lambda vs: [context.all_gather(vs[0][None], axis=0, options=options)]
        )[0]

    def reduce_scatter(self, tables: Sequence[Any]) -> list[Any]:
        # The replica context has no reduce-scatter.
        here = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.int32)
        return scatter_by_sum(self, tables, here)

    def gather_rows(self, per_replica: Any) -> Any:
        if not self._multi_worker:
            return tf.nest.map_structure(self._local_rows, per_replica)
        # Every worker ends with all rows, in global replica order.
        if self._watchdog is None:
            return tf.nest.map_structure(lambda v: self._engine.gather(v, axis=0), per_replica)
        options = self._step_options
        return self._watchdog.around_call(
            lambda: tf.nest.map_structure(
                lambda v: _compat.gather(self._engine, v, 0, options), per_replica
            ),
            "a collective of the predict step",
        )

    def _local_rows(self, value: Any) -> Any:
        parts = self._engine.experimental_local_results(value)
        if parts[0].shape.rank == 0:
            return tf.stack(parts)
        return tf.concat(parts, axis=0)

    # -- outside the replicas' step ----------------------------------------------------

    def all_reduce_across_processes(self, values: Sequence[Any], op: str = "sum") -> list[Any]:
        engine = self._engine

        def across(values: list[Any]) -> list[Any]:
            per_replica = self._once_per_process(values)
            reduced = engine.run(lambda vs: self._reduce(vs, op), args=(per_replica,))
            return [engine.experimental_local_results(r)[0] for r in reduced]

        return self._watched([tf.convert_to_tensor(v) for v in values], across)

    def sum_over_processes(self, flat: np.ndarray) -> np.ndarray:
        per_replica = self._once_per_process(tf.constant(flat))
        summed: np.ndarray = self._engine.reduce("SUM", per_replica, axis=None).numpy()
        return summed

    def _once_per_process(self, values: Any) -> Any:
        """`values` (a tensor or a list of them) as the per-replica values of
        this process's replicas: on its first replica, zeros on its others
        (its other GPUs), so that a sum over all replicas counts each
        process once."""
        first = self._first
        return self._engine.experimental_distribute_values_from_function(
            lambda ctx: (
                values
                if ctx.replica_id_in_sync_group == first
                else tf.nest.map_structure(tf.zeros_like, values)
            )
        )

    def _watched(
        self, values: Sequence[Any], collective: Callable[[list[Any]], list[Any]]
    ) -> list[Any]:
        """`collective(values)` (in a step) under the watchdog that enforces
        `collective_timeout`, if there is one."""
        if self._watchdog is None:
            return collective(list(values))
        return self._watchdog.around(values, collective, "a collective of the training step")

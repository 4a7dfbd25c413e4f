"""A transport's collectives for a step that runs outside its replicas, one replica per process.

Hybrid data x model parallelism (`keras_distrib.strategies.hybrid`): each
worker runs one model replica split over its own devices, in a step of its
own, and the replicas reduce with the workers' transport (`multi_worker`'s)
across processes. Its all-reduce is the transport's
`all_reduce_across_processes`, and the rest is built on it: an all-gather
or a reduce-scatter is a sum at the process's row, the rows of every
process two all-reduces.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from keras_distrib.collectives.transport import Transport, gather_by_sum, scatter_by_sum


class AcrossProcesses(Transport):
    """`transport` with each of its `size` processes one replica, this one `rank`."""

    def __init__(self, transport: Transport, rank: int, size: int):
        self._transport = transport
        self._rank = rank
        self._size = size

    def all_reduce(self, values: Sequence[Any], op: str = "sum") -> list[Any]:
        return self._transport.all_reduce_across_processes(values, op)

    def all_gather(self, value: Any) -> Any:
        return gather_by_sum(self, value, self._rank, self._size)

    def reduce_scatter(self, tables: Sequence[Any]) -> list[Any]:
        return scatter_by_sum(self, tables, self._rank)

    def gather_rows(self, per_replica: Any) -> Any:
        """In a step: two all-reduces per tensor (row counts, rows)."""
        return tf.nest.map_structure(self._rows_of_one, per_replica)

    def _rows_of_one(self, value: Any) -> Any:
        value = tf.convert_to_tensor(value)
        if value.shape.rank == 0:
            value = tf.reshape(value, [1])
        size, rank = self._size, self._rank
        mine = tf.one_hot(rank, size, dtype=tf.float32) * tf.cast(tf.shape(value)[0], tf.float32)
        (counts,) = self.all_reduce([mine])
        counts = tf.cast(counts, tf.int32)
        longest = tf.reduce_max(counts)
        padding = [[0, longest - tf.shape(value)[0]]] + [[0, 0]] * (value.shape.rank - 1)
        padded = tf.pad(value, padding)
        wire = padded if padded.dtype.is_floating else tf.cast(padded, tf.float64)
        slot = tf.reshape(tf.one_hot(rank, size, dtype=wire.dtype), [size] + [1] * wire.shape.rank)
        (table,) = self.all_reduce([slot * wire[None]])
        rows = tf.concat([table[r, : counts[r]] for r in range(size)], axis=0)
        return tf.cast(rows, value.dtype)

    def sum_over_processes(self, flat: np.ndarray) -> np.ndarray:
        return self._transport.sum_over_processes(flat)

    def broadcast(self, variables: Sequence[Any], root: int = 0) -> list[Any]:
        return self._transport.broadcast(variables, root)

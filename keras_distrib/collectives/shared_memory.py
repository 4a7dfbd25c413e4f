"""Shared memory between the worker processes of one host, as a transport.

The engine is `keras_distrib.collectives.host_allreduce.HostAllReduce`
(NumPy only); here its collectives run in the step through
`tf.numpy_function`. Stateful: never pruned, and kept in program order with
any other collective of the same function, which every worker must agree
on. TensorFlow's gRPC collectives are slow even between local processes
(docs/design.md, section 1.2, row 4): `multi_worker` reduces here when every
worker is on this host and has one device (`implementation="shm"`). The
predict step's rows still travel by the transport given as `rows`
(TensorFlow's), and so does whatever ran before the workers joined here.
A peer that exits is detected within a second, one stopped (SIGSTOP) within
seconds, whatever the timeout.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np
import tensorflow as tf

from keras_distrib.collectives.host_allreduce import HostAllReduce
from keras_distrib.collectives.transport import Transport, reduce_op


class SharedMemory(Transport):
    """All-reduces, all-gathers and reduce-scatters through shared memory.

    Every worker makes one with the same `job_id` and its own `rank`;
    making it waits until all have joined (see `HostAllReduce`).

    Args:
        rows: the transport the predict step's rows travel by.
        rank: this worker's index; `world_size`: the workers (one replica each).
        job_id: a secret shared by the job's workers (names its files).
        timeout: seconds a collective may wait for peers (None: no limit).
        connect_timeout: seconds to wait for every worker to join.
    """

    name = "shm"
    _ops = "kd_host"  # the prefix of its ops' names
    _engine: Any  # HostAllReduce here; a subclass may run another engine (tcp_collectives)

    def __init__(
        self,
        rows: Transport,
        rank: int,
        world_size: int,
        job_id: str,
        timeout: Optional[float] = None,
        connect_timeout: float = 120.0,
    ):
        self._rows = rows
        self._world_size = world_size
        self._engine = HostAllReduce(
            rank, world_size, job_id, timeout=timeout, connect_timeout=connect_timeout
        )

    # -- in a replica's step ----------------------------------------------------------

    def all_reduce(self, values: Sequence[Any], op: str = "sum") -> list[Any]:
        reduce_op(op)  # validates op, as TensorFlow's path does
        values = [tf.convert_to_tensor(v) for v in values]
        reduced = _on_host(self._engine.all_reduce, values, f"{self._ops}_all_reduce")
        if op == "mean":
            return [total / tf.cast(self._world_size, total.dtype) for total in reduced]
        return reduced

    def mean_by_count(
        self, values: Sequence[Any], num_samples: Any, compression: Optional[Any] = None
    ) -> list[Any]:
        if compression is not None or any(v.dtype != tf.float32 for v in values):
            return super().mean_by_count(values, num_samples, compression)
        # The division by the global count rides in the all-reduce's last
        # copy (the same float32 math as the default).
        counted = [*values, tf.cast(num_samples, tf.float32)]
        return _on_host(self._engine.mean_by_count, counted, f"{self._ops}_mean_by_count")[:-1]

    def all_gather(self, value: Any) -> Any:
        value = tf.convert_to_tensor(value)
        (table,) = tf.numpy_function(
            self._engine.all_gather,
            [value],
            [value.dtype],
            stateful=True,
            name=f"{self._ops}_all_gather",
        )
        table.set_shape([self._world_size, *value.shape])
        return table

    def reduce_scatter(self, tables: Sequence[Any]) -> list[Any]:
        tables = [tf.convert_to_tensor(t) for t in tables]
        rows = tf.numpy_function(
            self._engine.reduce_scatter,
            tables,
            [t.dtype for t in tables],
            stateful=True,
            name=f"{self._ops}_reduce_scatter",
        )
        for row, table in zip(rows, tables):
            row.set_shape([table.shape[1]])
        return list(rows)

    def gather_rows(self, per_replica: Any) -> Any:
        return self._rows.gather_rows(per_replica)

    # -- between steps ------------------------------------------------------------------

    def sum_over_processes(self, flat: np.ndarray) -> np.ndarray:
        # On the engine too: it notices a stopped or exited peer within
        # seconds.
        (total,) = self._engine.all_reduce(flat)
        summed: np.ndarray = total
        return summed

    def close(self) -> None:
        self._engine.close()


def _on_host(function: Callable[..., Any], values: list[Any], name: str) -> list[Any]:
    """`function(*values)` (a shared-memory collective) in the step, with
    each result shaped like its input."""
    reduced = tf.numpy_function(
        function, values, [v.dtype for v in values], stateful=True, name=name
    )
    for value, result in zip(values, reduced):
        result.set_shape(value.shape)
    return list(reduced)
